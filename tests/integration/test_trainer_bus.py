"""The trainer against a real nats-server: run state in, rollouts and scores in, weights out.

The trainer runs in this process (its composition root, signals left to pytest) on the
tiny model. The test plays inference and the scorers: it publishes groups of rollouts and
their scores step by step, and checks the weight updates (version 0 first, blobs that
verify and load), the metrics, drops (stale, scorer error, a malformed rollout
dead-lettered), the run state and the checkpoint.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import nats.js.errors
import pytest

from flywheel.contract import events, weights
from flywheel.contract.bus import Bus
from flywheel.contract.config import RunConfig
from flywheel.contract.runs import get_run, register_run, update_run
from flywheel.contract.settings import Settings, TrainerSettings
from flywheel.runtime.natsserver import NatsServer
from flywheel.sdk import models
from flywheel_trainer import service
from flywheel_trainer.ledger import Journal, RunFolder
from tests.helpers import until
from tests.integration.services import Workers
from tests.integration.test_inference_worker import count_is, stored
from tests.unit.test_trainer_join import make_rollout, make_score

RUN = "trainer-itest"


def run_config(model_dir: Path, run: str = RUN, **trainer: object) -> RunConfig:
    return RunConfig(run=run, env="reverse_text", group_size=2, model={"name": str(model_dir)},
                     trainer={"batch_size": 4, "num_steps": 3, "max_off_policy_steps": 1, **trainer})


class Inference:
    """Plays inference and the scorers: groups of two rollouts with random completions, and their scores."""

    def __init__(self, bus: Bus, model_dir: Path, run: str = RUN) -> None:
        _, self.tok = models.load_model(model_dir)
        self.bus = bus
        self.run = run
        self.rng = random.Random(0)
        self.published: list[str] = []

    def rollout(self, rollout_id: str, group_id: str, policy_version: int) -> events.Rollout:
        text = "".join(self.rng.choice("abcdef") for _ in range(4))
        prompt = models.render_prompt(self.tok, [events.Message(role="system", content="Reverse the text."),
                                                 events.Message(role="user", content=text)])
        completion = [self.rng.randrange(3, 200) for _ in range(self.rng.randint(2, 6))] + [self.tok.eos_token_id]
        return make_rollout(rollout_id, group_id, prompt=prompt, completion=completion,
                            logprobs=[-3.0] * len(completion), policy_version=policy_version, run=self.run)

    async def group(self, group_id: str, policy_version: int, scorer_error: bool = False) -> list[events.Rollout]:
        rollouts = [self.rollout(f"{group_id}-{i}", group_id, policy_version) for i in range(2)]
        await self.bus.publish_many(rollouts, content_type=events.MSGPACK)
        scores = []
        for i, r in enumerate(rollouts):
            failed = scorer_error and i == 1
            scores += [make_score(r, "similarity", self.rng.random(), error="ValueError: boom" if failed else None),
                       make_score(r, "exact", float(i == 0))]
        await self.bus.publish_many(scores)
        self.published += [r.id for r in rollouts]
        return rollouts


async def weight_updates(bus: Bus, run: str = RUN) -> list[events.WeightUpdate]:
    """Every weight update of ``run`` in the WEIGHTS stream, in order."""
    decoder = events.Decoder(events.WeightUpdate)
    sub = await bus.js.subscribe(f"weights.{run}", ordered_consumer=True)
    out = []
    try:
        info = await bus.js.stream_info("WEIGHTS", subjects_filter=f"weights.{run}")
        total = (info.state.subjects or {}).get(f"weights.{run}", 0)
        for _ in range(total):
            out.append(decoder.decode((await sub.next_msg(timeout=5)).data))
    finally:
        await sub.unsubscribe()
    return out


async def wait_for_version(bus: Bus, version: int, task: asyncio.Future[None], run: str = RUN) -> None:
    async def published() -> bool:
        if task.done():
            task.result()  # raises what the trainer raised
        return any(u.version >= version for u in await weight_updates(bus, run))

    await until(published, timeout_s=60, what=f"weights version {version}")


async def test_trainer_publishes_version_0_then_a_version_a_step_and_counts_what_it_drops(
        bus: Bus, nats_server: NatsServer, tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = run_config(tiny_model_dir)
    await register_run(bus, RUN, config=cfg.model_dump())
    settings = Settings(nats_url=nats_server.url, data_dir=tmp_path / "data",
                        trainer=TrainerSettings(weight_versions_kept=2))
    trainer = asyncio.ensure_future(service.run(settings, RUN, handle_signals=False))
    inference = Inference(bus, tiny_model_dir)
    await wait_for_version(bus, 0, trainer)

    await inference.group("g1", 0)
    await inference.group("g2", 0)
    malformed = make_rollout("bad", "g-bad", completion=[5, 6], logprobs=[-1.0], run=RUN)
    await bus.publish(malformed)
    await wait_for_version(bus, 1, trainer)
    await inference.group("g3", 0)  # one version behind: within max_off_policy_steps
    await inference.group("g4", 1)
    await wait_for_version(bus, 2, trainer)
    stale = await inference.group("g5", 0)  # two versions behind now: dropped
    await inference.group("g6", 2, scorer_error=True)  # one rollout left to train
    await inference.group("g7", 2)
    leftover = await inference.group("g8", 2)  # one group too many for the last step
    await asyncio.wait_for(trainer, timeout=60)  # exits by itself after num_steps

    updates = await weight_updates(bus)
    assert [(u.version, u.trainer_step) for u in updates] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    model, _ = models.load_model(tiny_model_dir)
    blobs = [await weights.get(bus, u) for u in updates[-2:]]  # checks size and sha256
    models.load_weights(model, blobs[-1])
    for dropped in updates[:-2]:  # the bucket keeps the last weight_versions_kept versions
        with pytest.raises(nats.js.errors.NotFoundError):
            await weights.get(bus, dropped)
    assert len({u.sha256 for u in updates}) == 4
    last = updates[-1].metrics
    assert last["num_rollouts"] == 3 and last["num_groups"] == 2
    assert last["num_dropped_stale"] == 2 and last["num_dropped_scorer_error"] == 1
    assert last["staleness_max"] == 0 and updates[2].metrics["staleness_mean"] == 0.5
    assert updates[2].metrics["staleness_max"] == 1
    for key in ("loss", "reward_mean", "reward_std", "tokens_per_s", "sampled_tokens_per_s", "step_s", "grad_norm",
                "logprob_diff_abs_mean"):
        assert all(key in u.metrics for u in updates[1:]), key

    state = await get_run(bus, RUN)
    assert state is not None and (state.status, state.trainer_step, state.policy_version) == ("finished", 3, 3)
    folder = RunFolder(settings.data_dir, RUN)
    assert [m["step"] for m in folder.metrics.read()] == [0, 1, 2, 3]
    assert folder.metrics.read()[3]["loss"] == pytest.approx(last["loss"])
    latest = folder.checkpoints.latest()
    assert latest is not None  # the run saved a checkpoint
    _, checkpoint = latest
    assert checkpoint.step == 3 and checkpoint.trained[1] == ["g1-0", "g1-1", "g2-0", "g2-1"]
    assert checkpoint.trained[3] == ["g6-0", "g7-0", "g7-1"]
    assert checkpoint.dropped == {stale[0].id: "stale", stale[1].id: "stale", "g6-1": "scorer_error"}
    # Received but never trained: still in the journal for a later run of the trainer.
    journal = [e.id for e in Journal(folder.journal_path).replay()]
    assert {r.id for r in leftover} <= set(journal)

    dead = await bus.js.subscribe("dead.ROLLOUTS", ordered_consumer=True)
    letter = events.Decoder(events.DeadLetter).decode((await dead.next_msg(timeout=5)).data)
    await dead.unsubscribe()
    assert letter.consumer == f"trainer-{RUN}-rollouts" and "2 token ids but 1 logprobs" in letter.reason


async def test_logprobs_are_recomputed_at_the_temperature_each_rollout_was_sampled_with(
        bus: Bus, nats_server: NatsServer, tiny_model_dir: Path, tmp_path: Path, start_worker: Workers) -> None:
    # The real inference worker and the trainer, a task with a temperature of its own (the run's
    # is 1.0). With lr 0 the weights do not move, so the trainer's logprobs match the sampler's
    # only when it recomputes them at the temperature the rollout was sampled with.
    run = "own-temperature"
    cfg = RunConfig(run=run, env="reverse_text", group_size=2, model={"name": str(tiny_model_dir)},
                    sampling={"max_tokens": 8}, scorers={"fixed": 1.0}, replace_rewards=True,
                    trainer={"batch_size": 2, "num_steps": 1, "lr": 0.0, "max_off_policy_steps": 0})
    await register_run(bus, run, config=cfg.model_dump(), scorers=cfg.scorers)
    settings = Settings(nats_url=nats_server.url, data_dir=tmp_path / "data")
    trainer = asyncio.ensure_future(service.run(settings, run, handle_signals=False))
    await wait_for_version(bus, 0, trainer, run)
    await start_worker()
    sampling = events.Sampling(temperature=0.4, max_tokens=8, seed=5)
    await bus.publish(events.Task(id="t0", run=run, env="reverse_text", data={"text": "abcdef"}, num_rollouts=2,
                                  sampling=sampling))
    await until(lambda: count_is(bus, "ROLLOUTS", 2), timeout_s=60, what="the task's 2 rollouts")
    rollouts = sorted(await stored(bus, "ROLLOUTS", events.Rollout), key=lambda r: r.index)
    assert all(r.status in ("completed", "truncated") for r in rollouts), rollouts
    # Each rollout records what it was sampled with: the task's settings, its own seed.
    assert [r.sampling for r in rollouts] == [events.Sampling(temperature=0.4, max_tokens=8, seed=5 + i)
                                              for i in range(2)]
    await bus.publish_many([make_score(r, "fixed", float(r.index)) for r in rollouts])
    await asyncio.wait_for(trainer, timeout=60)  # one step, then it exits
    (_, step) = await weight_updates(bus, run)
    assert step.metrics["num_rollouts"] == 2
    assert step.metrics["logprob_diff_abs_mean"] < 1e-3, step.metrics


async def test_a_run_that_is_missing_or_without_its_checkpoint_fails_with_the_reason(
        bus: Bus, nats_server: NatsServer, tmp_path: Path, tiny_model_dir: Path) -> None:
    settings = Settings(nats_url=nats_server.url, data_dir=tmp_path)
    with pytest.raises(ValueError, match="not in the runs KV bucket"):
        await service.run(settings, "nope", handle_signals=False)
    await register_run(bus, "moved", config=run_config(tiny_model_dir, run="moved").model_dump())
    await update_run(bus, "moved", trainer_step=5)
    with pytest.raises(ValueError, match=r"trainer step 5\), but .* holds no checkpoint"):
        await service.run(settings, "moved", handle_signals=False)


async def test_the_last_published_version_is_found_past_messages_that_are_not_weight_updates(bus: Bus) -> None:
    # Anyone may publish on weights.<run>: a trainer restarting after garbage there must still
    # find the version it last published (it crashed on the garbage, on every restart).
    def update(version: int) -> events.WeightUpdate:
        return events.WeightUpdate(run="r1", version=version, uri=f"nats-os://b/{version}", sha256="0" * 64,
                                   size_bytes=1)

    assert await service.last_published_version(bus, "r1") is None
    await bus.publish(update(3))
    await bus.publish(update(4))
    await bus.publish(events.WeightUpdate(run="r2", version=9, uri="nats-os://b/x", sha256="0" * 64, size_bytes=1))
    await bus.publish_raw("weights.r1", b"\x00garbage", {"Nats-Msg-Id": "g1"})
    another_runs = events.WeightUpdate(run="other", version=8, uri="u", sha256="0" * 64, size_bytes=1)
    await bus.publish_raw("weights.r1", events.encode(another_runs), {"Nats-Msg-Id": "g2"})
    assert await service.last_published_version(bus, "r1") == 4
    await bus.publish(update(5))
    assert await service.last_published_version(bus, "r1") == 5
