"""A rollout's reward is one definition: the trace API gives the reward the trainer trains on,
with a custom scorer publishing on the run that is not among the run's scorers.

Everything but inference is real, on a real nats-server: the run registered as ``flywheel
run`` registers it (its config and its scorers, :func:`flywheel.sdk.scoring.required_scorers`),
the built-in scorer and a custom scorer (``brevity``, weight 1, outside the run's reward)
as their composition roots build them, the recorder writing the gateway's store (and
mirroring the run state), and the trainer on the tiny model. The test plays inference: one
rollout of ``reverse_text`` a step (group size 1, batch size 1), so each step's
``reward_mean`` is exactly the trainer's reward of that step's rollout.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import msgspec
import pytest
from fastapi import FastAPI

from flywheel.contract import events
from flywheel.contract.bus import Bus, Consumer
from flywheel.contract.config import RunConfig
from flywheel.contract.runs import register_run
from flywheel.contract.settings import RecorderSettings, ScorerSettings, Settings
from flywheel.runtime.natsserver import NatsServer
from flywheel.sdk.environment import load_environment
from flywheel.sdk.scoring import required_scorers
from flywheel_gateway import recorder
from flywheel_gateway.recorder import mirror_runs
from flywheel_gateway.store import Store
from flywheel_scorer import scorer
from flywheel_scorer.partitions import Partitions
from flywheel_scorer.scorer import EnvironmentRewards, custom_reward
from flywheel_trainer import service
from flywheel_trainer.ledger import RunFolder
from tests.helpers import until, worker_pool
from tests.integration.test_trainer_bus import wait_for_version, weight_updates
from tests.unit.test_trainer_join import make_rollout

RUN = "reward-def"
TEXTS = ["abcdef", "tnassistan", "xy"]


def brevity(completion: str) -> float:
    """The custom scorer: more for shorter answers (not part of the run's reward)."""
    return 10.0 / (1 + len(completion))


@pytest.mark.long
async def test_the_trace_api_reward_is_the_trainers_with_a_custom_scorer_on_the_run(
        app: FastAPI, client: httpx.AsyncClient, store: Store, bus: Bus,
        nats_server: NatsServer, tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = RunConfig(run=RUN, env="reverse_text", group_size=1, model={"name": str(tiny_model_dir)},
                    trainer={"batch_size": 1, "num_steps": len(TEXTS), "max_off_policy_steps": 10})
    env = load_environment("reverse_text")
    await register_run(bus, RUN, config=cfg.model_dump(), scorers=required_scorers(cfg, env))
    stopping = asyncio.Event()
    pooled = worker_pool("scorer")
    workers = await pooled.__aenter__()
    bounds = ScorerSettings(max_in_flight=8)
    builtin, custom = EnvironmentRewards(), custom_reward(f"{__name__}:brevity", "reverse_text")
    await builtin.start(bus, workers)
    await custom.start(bus, workers)
    consumers: list[Consumer | Partitions]
    consumers = [*recorder.build(bus, store, RecorderSettings(), streams=("ROLLOUTS", "SCORES")),
                 scorer.build(bus, builtin, bounds)[0], scorer.build(bus, custom, bounds)[0]]
    running = [asyncio.ensure_future(c.run()) for c in consumers]
    mirroring = asyncio.ensure_future(mirror_runs(bus, store, stopping))
    settings = Settings(nats_url=nats_server.url, data_dir=tmp_path / "data")
    trainer = asyncio.ensure_future(service.run(settings, RUN, handle_signals=False))
    try:
        await wait_for_version(bus, 0, trainer, RUN)
        ids = []
        for step, text in enumerate(TEXTS, 1):
            r = make_rollout(f"ro{step}", f"g{step}", group_size=1, run=RUN, policy_version=step - 1)
            await bus.publish(msgspec.structs.replace(r, task_data={"text": text}), events.MSGPACK)
            ids.append(r.id)
            await wait_for_version(bus, step, trainer, RUN)
        await asyncio.wait_for(trainer, timeout=60)

        async def scored_thrice() -> bool:
            found = [await store.get_rollout(i) for i in ids]
            return all(f is not None and len(f["scores"]) == 3 for f in found)

        await until(scored_thrice, timeout_s=30, what="each rollout's three scores recorded")
    finally:
        stopping.set()
        for c in consumers:
            c.stop()
        await asyncio.gather(*running, mirroring)
        if not trainer.done():
            trainer.cancel()
        await pooled.__aexit__(None, None, None)

    latest = RunFolder(settings.data_dir, RUN).checkpoints.latest()
    assert latest is not None  # the run saved a checkpoint
    _, checkpoint = latest
    updates = {u.trainer_step: u for u in await weight_updates(bus, RUN)}
    for step in range(1, len(TEXTS) + 1):
        (rollout_id,) = checkpoint.trained[step]
        got = (await client.get(f"/v1/rollouts/{rollout_id}")).json()
        brevity_score = next(s for s in got["scores"] if s["scorer"] == "brevity")
        assert brevity_score["value"] > 0 and brevity_score["weight"] == 1.0  # published, on the run
        assert got["reward"] == pytest.approx(updates[step].metrics["reward_mean"], abs=1e-12)
    listed = (await client.get("/v1/rollouts", params={"run": RUN, "min_reward": 0})).json()["items"]
    assert sorted(r["id"] for r in listed) == sorted(ids)

