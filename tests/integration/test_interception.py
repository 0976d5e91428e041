"""A harness written with the plain `openai` SDK, run unchanged as a program, yields
training-ready rollouts through the interception endpoint of a real inference server (HTTP on
a free port, real nats-server, the tiny model): three turns, tool calls in its history, one
streamed request, and the token spans of every branch exactly what the model was given. The
same for agents on the Responses API and on the Messages API."""

from __future__ import annotations

from pathlib import Path

import pytest

from flywheel.contract import events
from flywheel.contract.bus import Bus
from flywheel.sdk import models
from flywheel.sdk.environment import GroupReward, Reward, load_environment
from flywheel.sdk.scoring import Scoring
from flywheel.sdk.tracegraph import branches
from flywheel_sandbox.backends import LocalBackend, LocalConfig, python_path
from flywheel_trainer.join import sequences_of
from tests.helpers import until
from tests.integration.services import Served
from tests.integration.test_inference_worker import count_is, create_run, publish_weights, span_of, stored
from tests.sandbox_service import serving


@pytest.fixture(scope="module")
def long_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with room for a multi-turn conversation with tools (1024 positions); it
    overrides the conftest's longer one."""
    return models.build_tiny(tmp_path_factory.mktemp("model") / "tiny-1k", max_positions=1024)


async def test_an_openai_sdk_program_yields_training_ready_exact_rollouts(
        bus: Bus, long_tiny_model: Path, server: Served) -> None:
    await create_run(bus, long_tiny_model, env="openai_sdk_agent", group_size=2,
                     trainer={"batch_size": 4, "max_off_policy_steps": 0})
    base, _ = models.load_model(long_tiny_model)
    await publish_weights(bus, "r1", 0, base)
    tasks = [events.Task(id=f"t{i}", run="r1", env="openai_sdk_agent", data={"text": text}, num_rollouts=2)
             for i, text in enumerate(["abc", "cab"])]
    await bus.publish_many(tasks)
    await until(lambda: count_is(bus, "ROLLOUTS", 4), timeout_s=120, what="4 rollouts")

    rollouts: list[events.Rollout] = await stored(bus, "ROLLOUTS", events.Rollout)
    prompts = server.prompts
    for r in rollouts:
        assert r.status in ("completed", "truncated"), r.error
        assert r.metrics["num_calls"] == 3 and r.metrics["num_rerenders"] == 0
        assert len(r.state["answers"]) == 3 and r.state["usage_prompt_tokens"] > 0
        roles = [n.message.role for n in branches(r.nodes)[-1]]
        assert roles == ["system", "user", "assistant", "tool", "assistant", "user", "assistant", "user", "assistant",
                         "user", "assistant"]
        assert branches(r.nodes)[-1][2].message.tool_calls[0].name == "rev"  # the few-shot call, rendered
        # Token exactness: each answer's branch, up to its sampled tokens, is a prompt the model got.
        for node in (n for n in r.nodes if n.tokens and any(n.tokens.loss_mask)):
            branch = next(b for b in branches(r.nodes) if node in b)
            upto = branch[:branch.index(node) + 1]
            ids = [t for n in upto for t in span_of(n).token_ids]
            span = span_of(node)
            n_sampled = sum(span.loss_mask)
            assert ids[:-n_sampled] in prompts
            assert span.policy_version == 0 and all(lp <= 0 for lp in span.logprobs)
        # Training-ready: one sequence per branch, loss on the sampled tokens only.
        (sequence,) = sequences_of(r)
        assert sum(sequence.loss_mask) == r.metrics["num_completion_tokens"]

    traces: list[events.TraceNode] = await stored(bus, "TRACES", events.TraceNode)
    for r in rollouts:
        assert {t.node.id for t in traces if t.rollout_id == r.id} == {n.id for n in r.nodes}


@pytest.mark.long
async def test_an_openai_sdk_program_runs_alike_in_a_subprocess_and_in_a_sandbox(
        bus: Bus, long_tiny_model: Path, server: Served) -> None:
    """Runtimes: the same agent in two runs, one run with runtime subprocess, one with sandbox
    (a sandbox service on the bus, local backend, sharing this Python's packages): under the
    same seeds, the same answers and rewards. In either, the agent reaches its interception URL
    (through a model relay) and not the inference server's own address."""
    probe = f"{server.url}/health"
    backend = LocalBackend(LocalConfig(python_path=python_path("auto")))
    async with serving(bus, backend, warm_pool=0, max_alive=4):
        for run, runtime in (("r-sub", "subprocess"), ("r-box", "sandbox")):
            await create_run(bus, long_tiny_model, run=run, env="openai_sdk_agent", env_args={"probe_url": probe},
                             runtime=runtime, group_size=2, trainer={"batch_size": 4, "max_off_policy_steps": 0})
            await publish_weights(bus, run, 0, models.load_model(long_tiny_model)[0])
            sampling = events.Sampling(temperature=1.0, top_p=1.0, max_tokens=4, seed=7)
            await bus.publish_many([events.Task(id=f"{run}-t{i}", run=run, env="openai_sdk_agent", data={"text": text},
                                                num_rollouts=2, sampling=sampling)
                                    for i, text in enumerate(["abc", "cab"])])
        await until(lambda: count_is(bus, "ROLLOUTS", 8), timeout_s=180, what="4 rollouts of each run")
    await backend.close()
    rollouts: list[events.Rollout] = await stored(bus, "ROLLOUTS", events.Rollout)
    runs = {run: {(r.task_id.removeprefix(f"{run}-"), r.index): r for r in rollouts if r.run == run}
            for run in ("r-sub", "r-box")}
    for run, by_key in runs.items():
        for r in by_key.values():
            assert r.status in ("completed", "truncated"), (run, r.error, r.state.get("stdout"))
            assert r.metrics["num_calls"] == 3
    assert runs["r-sub"].keys() == runs["r-box"].keys() and len(runs["r-sub"]) == 4
    env = load_environment("openai_sdk_agent")
    keys = sorted(runs["r-sub"])
    env_rewards = [r for r in env.rewards if isinstance(r, (Reward, GroupReward))]
    rewards = {run: [[s.value for s in scores] for scores in await Scoring().score_group(
        env_rewards, [runs[run][key] for key in keys])] for run in runs}
    assert rewards["r-sub"] == rewards["r-box"] == [[1.0]] * 4
    for key in keys:
        outside, inside = runs["r-sub"][key], runs["r-box"][key]
        assert inside.state["answers"] == outside.state["answers"], key
        # Training-ready alike: the same tokens under the loss, recorded by the same interception.
        (seq_in,), (seq_out,) = sequences_of(inside), sequences_of(outside)
        assert (seq_in.token_ids, seq_in.loss_mask) == (seq_out.token_ids, seq_out.loss_mask), key
        # Neither reaches the inference server's own address: a program of a subprocess runtime runs in
        # a sandbox of its rollout's own too (its environment worker's view, no network).
        assert outside.state["probe"].startswith("refused"), outside.state["probe"]
        assert inside.state["probe"].startswith("refused"), inside.state["probe"]


async def test_responses_and_messages_sdk_programs_yield_exact_rollouts(
        bus: Bus, long_tiny_model: Path, server: Served) -> None:
    """The same, for an agent on the openai SDK's Responses API (stateful, previous_response_id)
    and one on the anthropic SDK's Messages API, each streaming one turn."""
    await create_run(bus, long_tiny_model, env="sdk_agents", group_size=1,
                     trainer={"batch_size": 2, "max_off_policy_steps": 0})
    base, _ = models.load_model(long_tiny_model)
    await publish_weights(bus, "r1", 0, base)
    await bus.publish_many([events.Task(id=api, run="r1", env="sdk_agents", data={"text": "abc", "api": api})
                            for api in ("responses", "messages")])
    await until(lambda: count_is(bus, "ROLLOUTS", 2), timeout_s=120, what="2 rollouts")
    rollouts: list[events.Rollout] = await stored(bus, "ROLLOUTS", events.Rollout)
    assert sorted(r.task_id for r in rollouts) == ["messages", "responses"]
    for r in rollouts:
        assert r.status in ("completed", "truncated"), (r.task_id, r.error, r.state.get("stdout"))
        assert r.metrics["num_calls"] == 3 and r.metrics["num_rerenders"] == 0, r.task_id
        assert len(r.state["answers"]) == 3 and r.state["usage_prompt_tokens"] > 0
        (branch,) = branches(r.nodes)  # every turn extended the one conversation
        assert [n.message.role for n in branch] == ["system", "user", "assistant", "tool", "assistant", "user",
                                                    "assistant", "user", "assistant", "user", "assistant"]
        assert branch[2].message.tool_calls[0].id == "c0"
        for node in (n for n in r.nodes if n.tokens and any(n.tokens.loss_mask)):
            upto = branch[:branch.index(node) + 1]
            ids = [t for n in upto for t in span_of(n).token_ids]
            assert ids[:-sum(span_of(node).loss_mask)] in server.prompts
        (sequence,) = sequences_of(r)
        assert sum(sequence.loss_mask) == r.metrics["num_completion_tokens"]


async def test_a_failing_harness_is_an_error_rollout_and_a_bad_row_a_dead_letter(
        bus: Bus, long_tiny_model: Path, server: Served) -> None:
    await create_run(bus, long_tiny_model, env="flaky_env", group_size=1, trainer={"batch_size": 1})
    base, _ = models.load_model(long_tiny_model)
    await publish_weights(bus, "r1", 0, base)
    await bus.publish_many([
        events.Task(id="bad-row", run="r1", env="flaky_env", data={"text": 3, "fail": False}),
        events.Task(id="fails", run="r1", env="flaky_env", data={"text": "ab", "fail": True}),
        events.Task(id="works", run="r1", env="flaky_env", data={"text": "ab", "fail": False}),
    ])
    await until(lambda: count_is(bus, "ROLLOUTS", 2), timeout_s=60, what="2 rollouts")
    by_task = {r.task_id: r for r in await stored(bus, "ROLLOUTS", events.Rollout)}
    assert by_task["fails"].status == "error"
    assert by_task["fails"].error == "harness failed: RuntimeError: the tool server is down"
    assert by_task["works"].status in ("completed", "truncated") and by_task["works"].error is None
    await until(lambda: count_is(bus, "DEAD", 1), what="the bad row dead-lettered")
    (dead,) = await stored(bus, "DEAD", events.DeadLetter)
    assert "field 'text' is 3 (int); the schema wants str" in dead.reason
