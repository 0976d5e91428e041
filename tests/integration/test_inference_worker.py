"""The inference worker against a real nats-server with the tiny model: tasks become
groups of rollouts and trace nodes; nothing is sampled before version 0; admission holds
the pipeline to the trainer; new weights change what is sampled and the recorded version."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import torch

from flywheel.contract import events, weights
from flywheel.contract.bus import Bus, Delivery, read_stream
from flywheel.contract.config import RunConfig
from flywheel.contract.settings import InferenceSettings
from flywheel.sdk import models
from flywheel.sdk.environment import load_environment
from tests.helpers import until
from tests.integration.services import Workers


async def create_run(bus: Bus, model_dir: Path, run: str = "r1", **overrides: Any) -> RunConfig:
    cfg = RunConfig.parse({"run": run, "env": "reverse_text", "group_size": 4, "model": {"name": str(model_dir)},
                           "sampling": {"max_tokens": 8},
                           "trainer": {"batch_size": 8, "max_off_policy_steps": 0}} | overrides)
    await (await bus.runs_kv()).put(run, events.encode(events.RunState(id=run, config=cfg.model_dump())))
    return cfg


async def publish_weights(bus: Bus, run: str, version: int, model: torch.nn.Module) -> events.WeightUpdate:
    uri, sha, size = await weights.put(bus, run, version, models.save_weights(model))
    update = events.WeightUpdate(run=run, version=version, uri=uri, sha256=sha, size_bytes=size,
                                 trainer_step=version)
    await bus.publish(update)
    return update


def perturbed(model_dir: Path, seed: int) -> torch.nn.Module:
    model, _ = models.load_model(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    return model


async def stored(bus: Bus, stream: str, type_: Any) -> list[Any]:
    """The events ``stream`` holds (a group's rollouts travel as one batch message)."""
    return await read_stream(bus, stream, type_)


def span_of(node: events.Node) -> events.TokenSpan:
    """The node's tokens: the inference service records them on every node it writes."""
    assert node.tokens is not None, node
    return node.tokens


async def count(bus: Bus, stream: str) -> int:
    """Events in ``stream``, not messages."""
    return len(await read_stream(bus, stream))


async def test_tasks_become_groups_of_rollouts_with_trace_nodes(bus: Bus, tiny_model_dir: Path,
                                                                start_worker: Workers) -> None:
    await create_run(bus, tiny_model_dir)
    base, tok = models.load_model(tiny_model_dir)
    await publish_weights(bus, "r1", 0, base)
    await publish_weights(bus, "r1", 1, base)  # a replica that starts late begins at the last update
    tasks = [events.Task(id=f"t{i}", run="r1", env="reverse_text", data={"text": text}, num_rollouts=4)
             for i, text in enumerate(["abc", "fedcba"])]
    await bus.publish_many(tasks)
    worker = await start_worker()
    await until(lambda: count_is(bus, "ROLLOUTS", 8), timeout_s=30, what="8 rollouts")
    await until(lambda: count_is(bus, "TRACES", 24), what="their 24 trace nodes")

    rollouts: list[events.Rollout] = await stored(bus, "ROLLOUTS", events.Rollout)
    assert len(rollouts) == 8
    env = load_environment("reverse_text")
    for task in tasks:
        group = sorted((r for r in rollouts if r.task_id == task.id), key=lambda r: r.index)
        assert [r.index for r in group] == [0, 1, 2, 3]
        assert all(r.group_id == task.id and r.group_size == 4 and r.task_data == task.data for r in group)
        prompt = models.render_prompt(tok, env.prompt_messages(task.data))
        for r in group:
            system, user, assistant = r.nodes
            assert [n.message.role for n in r.nodes] == ["system", "user", "assistant"]
            assert (system.parent_id, user.parent_id, assistant.parent_id) == (None, system.id, user.id)
            # The prompt messages' nodes hold their rendered tokens; the assistant node holds the
            # generation prompt (not trained), then the sampled tokens.
            messages = env.prompt_messages(task.data)
            system_span, user_span, span = span_of(system), span_of(user), span_of(assistant)
            assert system_span.token_ids + user_span.token_ids == models.render_messages(tok, messages)
            assert system_span.token_ids == models.render_messages(tok, messages[:1])
            for s in (system_span, user_span):
                assert s.loss_mask == [False] * len(s.token_ids)
                assert s.logprobs == [0.0] * len(s.token_ids) and s.policy_version is None
            n_gen = len(prompt) - len(system_span.token_ids + user_span.token_ids)
            assert system_span.token_ids + user_span.token_ids + span.token_ids[:n_gen] == prompt
            sampled = span.token_ids[n_gen:]
            assert 1 <= len(sampled) <= 8 and len(span.logprobs) == len(span.token_ids)
            assert span.loss_mask == [False] * n_gen + [True] * len(sampled)
            assert span.policy_version == r.policy_version == 1
            assert r.status == ("truncated" if len(sampled) == 8 and sampled[-1] != tok.eos_token_id else "completed")
            assert r.metrics["num_completion_tokens"] == len(sampled) and r.metrics["generation_s"] > 0

    traces: list[events.TraceNode] = await stored(bus, "TRACES", events.TraceNode)
    by_rollout = {r.id: r for r in rollouts}
    assert {t.rollout_id for t in traces} == set(by_rollout)
    for t in traces:
        assert t.node in by_rollout[t.rollout_id].nodes
    assert worker.info["runs"]["r1"] | {"num_issued": 8, "num_in_flight": 0, "num_waiting": 0} \
        == worker.info["runs"]["r1"]

    # A redelivered task publishes the same rollout ids: the bus stores them once.
    await worker.intake.handle(Delivery(event=tasks[0], subject="tasks.r1.reverse_text", stream_seq=1, num_delivered=2,
                                 headers={}, msg=None))  # type: ignore[arg-type]  # handle() never reads the NATS message
    assert await count(bus, "ROLLOUTS") == 8


async def test_short_rollouts_send_their_trace_nodes_only_in_the_rollout(bus: Bus, tiny_model_dir: Path,
                                                                         start_worker: Workers) -> None:
    await create_run(bus, tiny_model_dir)
    base, _ = models.load_model(tiny_model_dir)
    await publish_weights(bus, "r1", 0, base)
    await bus.publish(events.Task(id="t0", run="r1", env="reverse_text", data={"text": "abc"}, num_rollouts=4))
    await start_worker(InferenceSettings(backoff_s=(0.2,), max_deliver=50, live_trace_after_s=30.0))
    await until(lambda: count_is(bus, "ROLLOUTS", 4), timeout_s=30, what="4 rollouts")
    assert await count(bus, "TRACES") == 0
    rollouts: list[events.Rollout] = await stored(bus, "ROLLOUTS", events.Rollout)
    assert all([n.message.role for n in r.nodes] == ["system", "user", "assistant"] for r in rollouts)


async def count_is(bus: Bus, stream: str, n: int) -> bool:
    return await count(bus, stream) == n


async def test_admission_holds_sampling_to_the_trainer_and_new_weights_take_over(
        bus: Bus, tiny_model_dir: Path, start_worker: Workers) -> None:
    await create_run(bus, tiny_model_dir)  # batch_size 8, max_off_policy_steps 0: 8 rollouts per version
    worker = await start_worker()
    seeded = events.Sampling(max_tokens=8, seed=7)
    await bus.publish_many([events.Task(id=f"t{i}", run="r1", env="reverse_text", data={"text": "abcd"},
                                        num_rollouts=4, sampling=seeded) for i in range(4)])
    await until(lambda: "r1" in worker.info["runs"], what="the run to be hosted")
    assert worker.info["runs"]["r1"]["policy_version"] is None
    assert await count(bus, "ROLLOUTS") == 0  # nothing is sampled before version 0

    base, _ = models.load_model(tiny_model_dir)
    await publish_weights(bus, "r1", 0, base)
    await until(lambda: worker.info["runs"]["r1"]["num_waiting"] == 8 and count_is(bus, "ROLLOUTS", 8),
                timeout_s=30, what="two groups published, the other two waiting for the trainer")
    assert worker.info["runs"]["r1"]["num_issued"] == 8
    assert await count(bus, "ROLLOUTS") == 8  # the bound holds: no more before a new version

    await publish_weights(bus, "r1", 1, perturbed(tiny_model_dir, seed=1))
    await until(lambda: count_is(bus, "ROLLOUTS", 16), timeout_s=30, what="the waiting groups, after version 1")
    rollouts: list[events.Rollout] = await stored(bus, "ROLLOUTS", events.Rollout)
    by_version: dict[int, list[events.Rollout]] = {}
    for r in rollouts:
        assert span_of(r.nodes[-1]).policy_version == r.policy_version
        by_version.setdefault(r.policy_version, []).append(r)
    assert sorted(by_version) == [0, 1] and len(by_version[0]) == len(by_version[1]) == 8

    def answers(rs: list[events.Rollout]) -> dict[str, list[int]]:
        return {f"{r.task_id}.{r.index}": span_of(r.nodes[-1]).token_ids for r in rs}

    # Same prompt, same seeds: the two groups of a version agree; the versions do not.
    v0 = sorted(answers(by_version[0]).items())
    v1 = sorted(answers(by_version[1]).items())
    assert [tokens for _, tokens in v0[:4]] == [tokens for _, tokens in v0[4:]]
    assert [tokens for _, tokens in v0[:4]] != [tokens for _, tokens in v1[:4]]


async def test_a_corrupt_blob_is_not_loaded_and_the_next_good_one_is(bus: Bus, tiny_model_dir: Path,
                                                                     start_worker: Workers) -> None:
    await create_run(bus, tiny_model_dir)
    base, _ = models.load_model(tiny_model_dir)
    good = await publish_weights(bus, "r1", 0, base)
    corrupt = msgspec.structs.replace(good, id=events.new_id(), version=1, sha256="0" * 64)
    await bus.publish(corrupt)
    worker = await start_worker()
    await bus.publish(events.Task(id="t0", run="r1", env="reverse_text", data={"text": "abc"}, num_rollouts=4))
    # The replica starts at the last update, which fails: with no weights at all, the failure
    # is reported and the task waits (it is not failed because of a bogus update).
    await until(lambda: worker.info["runs"].get("r1", {}).get("weights_error") is not None, what="the failed load")
    error = worker.info["runs"]["r1"]["weights_error"]
    assert "weights version 1" in error and "sha256" in error and "no weights loaded yet" in error, error
    # (its environment loads in a worker first, so the task reaches the admission's queue a little later)
    await until(lambda: worker.info["runs"]["r1"]["num_waiting"] == 4, what="the task waiting for weights")
    assert await count(bus, "ROLLOUTS") == 0 and await count(bus, "DEAD") == 0
    await publish_weights(bus, "r1", 2, base)
    await until(lambda: count_is(bus, "ROLLOUTS", 4), timeout_s=30, what="the task, once version 2 loads")
    assert {r.policy_version for r in await stored(bus, "ROLLOUTS", events.Rollout)} == {2}
    assert worker.info["runs"]["r1"]["weights_error"] is None


async def test_tasks_left_when_the_run_ends_are_released_not_held(
        bus: Bus, tiny_model_dir: Path, start_worker: Workers) -> None:
    cfg = await create_run(bus, tiny_model_dir)  # 8 rollouts per version
    worker = await start_worker()
    await bus.publish_many([events.Task(id=f"t{i}", run="r1", env="reverse_text", data={"text": "abcd"},
                                        num_rollouts=4) for i in range(4)])
    await until(lambda: "r1" in worker.info["runs"], what="the run to be hosted")
    base, _ = models.load_model(tiny_model_dir)
    await publish_weights(bus, "r1", 0, base)
    await until(lambda: worker.info["runs"]["r1"]["num_waiting"] == 8 and count_is(bus, "ROLLOUTS", 8),
                timeout_s=30, what="two groups published, two waiting")

    finished = events.RunState(id="r1", status="finished", config=cfg.model_dump())
    await (await bus.runs_kv()).put("r1", events.encode(finished))
    await until(lambda: worker.info["runs"]["r1"]["num_skipped"] == 8, timeout_s=15, what="the waiting groups skipped")

    async def nothing_held() -> bool:  # the screen's and the run's consumer
        infos = await bus.js.consumers_info("TASKS")
        return all(info.num_ack_pending == 0 and info.num_pending == 0 for info in infos)

    await until(nothing_held, timeout_s=15, what="the leftover tasks acked")
    await bus.publish(events.Task(id="late", run="r1", env="reverse_text", data={"text": "ab"}, num_rollouts=4))
    await until(nothing_held, timeout_s=15, what="a task published after the end, dead-lettered at once")
    (letter,) = await stored(bus, "DEAD", events.DeadLetter)
    assert "after the run ended" in letter.reason and "register a new run" in letter.reason, letter.reason
    assert await count(bus, "ROLLOUTS") == 8


async def test_a_rollout_that_goes_stale_while_its_environment_works_is_stopped_and_says_why(
        bus: Bus, tiny_model_dir: Path, start_worker: Workers, monkeypatch: Any) -> None:
    # max_off_policy_steps 0: once version 1 is loaded, a rollout sampled by version 0 can no
    # longer be trained. Its environment's turn would hold it for a minute; it is stopped at
    # once and published as an error naming the staleness, and its place comes back.
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "envs"))
    await create_run(bus, tiny_model_dir, env="slow_turn_env")
    worker = await start_worker()
    base, _ = models.load_model(tiny_model_dir)
    await publish_weights(bus, "r1", 0, base)
    await bus.publish(events.Task(id="slow", run="r1", env="slow_turn_env", data={"text": "abc", "wait_s": 60.0},
                                  num_rollouts=4))
    await until(lambda: worker.info.get("runs", {}).get("r1", {}).get("num_in_flight") == 4,
                timeout_s=30, what="the group's four rollouts in their environment's turn")

    async def sampled() -> bool:  # each made its model call (its worker may take a moment to start)
        nodes = await stored(bus, "TRACES", events.TraceNode)
        return sum(t.node.message.role == "assistant" for t in nodes) == 4

    await until(sampled, timeout_s=30, what="the four rollouts' model calls")
    await publish_weights(bus, "r1", 1, perturbed(tiny_model_dir, seed=1))
    await until(lambda: count_is(bus, "ROLLOUTS", 4), timeout_s=15, what="the stale group published")
    rollouts: list[events.Rollout] = await stored(bus, "ROLLOUTS", events.Rollout)
    for r in rollouts:
        assert r.status == "error" and r.policy_version == 0
        assert r.error is not None and r.error.startswith("stopped: stale: sampled by weights version 0, version 1 "
                                                          "is loaded and trainer.max_off_policy_steps = 0")
        assert r.metrics["rollout_s"] < 30
    await until(lambda: worker.info["runs"]["r1"]["num_in_flight"] == 0, what="the places given back")
