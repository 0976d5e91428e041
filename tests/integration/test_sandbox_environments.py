"""Sandbox environments where they run, against a real sandbox service (local backend) over a real
nats-server: in a training run, the inference service hands each rollout's harness a sandbox
client over its own bus (the ctf harness plants its flag; the sandbox is gone once the rollout
is published; the tiny model answers nonsense, so this checks the plumbing); in ``flywheel
eval``, harnesses and rewards reach the service where NATS answers, and a rollout that needs
a sandbox fails with what to start where it does not, and ``--runtime sandbox`` runs a program
harness inside each rollout's sandbox; the RLM harness (long_context) in training and in eval,
its sub-calls recorded as sub-agent branches."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

import coding
import long_context
from flywheel.contract import events
from flywheel.contract.bus import Bus
from flywheel.runtime import runs
from flywheel.runtime.evalresults import read_results
from flywheel.runtime.evaluation import EvalConfig, Evaluation, run_eval
from flywheel.runtime.natsserver import NatsServer
from flywheel.sdk import models
from flywheel.sdk.environment import EnvironmentOverrides
from flywheel.sdk.tracegraph import branches
from flywheel_sandbox.backends import LocalBackend, LocalConfig, python_path
from flywheel_trainer.join import sequences_of
from tests.helpers import until, worker_pool
from tests.integration.conftest import ENVS
from tests.integration.services import Served
from tests.integration.test_inference_worker import count_is, create_run, publish_weights, stored
from tests.sandbox_service import backend_named, serving
from tests.scripted_openai import ScriptedOpenAI, tool_call


async def test_ctf_rollouts_in_training_plant_their_flag_and_leave_no_sandbox(
        bus: Bus, long_tiny_model: Path, server: Served, request: pytest.FixtureRequest) -> None:
    async with backend_named("local", request) as backend, serving(bus, backend, warm_pool=1) as sandbox:
        await create_run(bus, long_tiny_model, env="flywheel/ctf", env_args={"max_turns": 2}, group_size=2,
                         sampling={"max_tokens": 12}, trainer={"batch_size": 2, "max_off_policy_steps": 0})
        base, _ = models.load_model(long_tiny_model)
        await publish_weights(bus, "r1", 0, base)
        row = {"id": "hex-dump", "challenge": "hex_dump", "prompt": "A process dumped memory as hex digits."}
        await bus.publish(events.Task(id="t0", run="r1", env="ctf", data=row, num_rollouts=2))
        await until(lambda: count_is(bus, "ROLLOUTS", 2), timeout_s=180, what="2 rollouts")
        rollouts = await stored(bus, "ROLLOUTS", events.Rollout)
        for r in rollouts:
            assert r.status in ("completed", "truncated"), r.error
            assert len(r.state["flag_sha256"]) == 64 and r.state["submissions"] == []  # planted in its sandbox
        assert rollouts[0].state["flag_sha256"] != rollouts[1].state["flag_sha256"]  # a flag per rollout
        assert not sandbox.manager.sessions and len(sandbox.manager.tombstones) == 2  # both made, both destroyed


async def test_rlm_rollouts_in_training_use_their_sandbox_and_are_training_ready(
        bus: Bus, long_tiny_model: Path, server: Served, request: pytest.FixtureRequest) -> None:
    """long_context in a training run on the tiny model: each rollout gets a sandbox holding its
    table (the tiny model writes no working code, so the harness nudges it until max_turns),
    every turn is recorded, and the rollout gives training sequences."""
    args: dict[str, Any] = {"num_tasks": 2, "num_records": 40, "max_turns": 2}
    (row,) = long_context.load_environment(**args).load_tasks(1)
    async with backend_named("local", request) as backend, serving(bus, backend, warm_pool=0) as sandbox:
        await create_run(bus, long_tiny_model, env="long_context", env_args=args, group_size=2,
                         sampling={"max_tokens": 12}, trainer={"batch_size": 2, "max_off_policy_steps": 0})
        await publish_weights(bus, "r1", 0, models.load_model(long_tiny_model)[0])
        await bus.publish(events.Task(id="t0", run="r1", env="long_context", data=row, num_rollouts=2))
        await until(lambda: count_is(bus, "ROLLOUTS", 2), timeout_s=180, what="2 rollouts")
        rollouts = await stored(bus, "ROLLOUTS", events.Rollout)
        for r in rollouts:
            assert r.status in ("completed", "truncated"), r.error
            assert r.state["turns"] >= 1 and r.metrics["num_calls"] >= 1
            assert row["context"] not in str([n.message.content for n in r.nodes])  # the table stayed in the REPL
            assert sequences_of(r)
        assert not sandbox.manager.sessions and len(sandbox.manager.tombstones) == 2  # one a rollout, both gone


async def test_rlm_sub_calls_in_training_are_sampled_recorded_and_trained(
        bus: Bus, long_tiny_model: Path, server: Served, request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Sub-calls through real inference: the REPL's two llm_query calls leave the sandbox through
    its relay to the rollout's interception URL, where the policy samples them; the rollout's
    trace graph has them as roots of their own with the sampled tokens, and the trainer gets a
    sequence for each, its sampled tokens under the loss."""
    monkeypatch.syspath_prepend(str(ENVS))
    async with backend_named("local", request) as backend, serving(bus, backend, warm_pool=0) as sandbox:
        await create_run(bus, long_tiny_model, env="rlm_subcalls", group_size=1, sampling={"max_tokens": 6},
                         trainer={"batch_size": 1, "max_off_policy_steps": 0})
        await publish_weights(bus, "r1", 0, models.load_model(long_tiny_model)[0])
        await bus.publish(events.Task(id="t0", run="r1", env="rlm_subcalls", data={"question": "How many lines?",
                                                                                  "context": "line\n" * 500}))
        await until(lambda: count_is(bus, "ROLLOUTS", 1), timeout_s=120, what="the rollout")
        (rollout,) = await stored(bus, "ROLLOUTS", events.Rollout)
        assert not sandbox.manager.sessions
    assert rollout.status in ("completed", "truncated"), rollout.error
    assert rollout.state["sub_calls"] == 2 and rollout.metrics["num_calls"] == 3
    roots = sorted(n.message.content for n in rollout.nodes if n.parent_id is None and n.message.role == "user")
    assert roots == ["Say a word.", "Say another word."]
    sequences = sequences_of(rollout)
    assert len(sequences) == 3 and all(sum(s.loss_mask) > 0 for s in sequences)
    assert sum(sum(s.loss_mask) for s in sequences) == rollout.metrics["num_completion_tokens"]


def solve_coding(tasks: list[dict[str, Any]]) -> Any:
    def reply(body: dict[str, Any]) -> str:
        asked = body["messages"][-1]["content"]
        (task,) = [t for t in tasks if t["prompt"] == asked]
        return f"```python\n{task['solution']}```"
    return reply


def submit_found(body: dict[str, Any]) -> dict[str, Any]:
    said = [m["content"] for m in body["messages"] if m["role"] == "tool"][-1]
    return tool_call("submit_flag", flag=said.split("remember: ")[1].split()[0])


async def test_eval_hands_sandboxes_to_harnesses_and_rewards(bus: Bus, nats_server: NatsServer, tmp_path: Path,
                                                             readable: Path, request: pytest.FixtureRequest) -> None:
    # The task file, where the workers see it (setting workers.read_only).
    one_ctf = readable / "ctf.jsonl"
    one_ctf.write_text(json.dumps({"id": "notes", "challenge": "hidden_backup", "prompt": "Find the notes."}) + "\n")
    one_ctf.chmod(0o644)
    rows = coding.load_environment(tools=False).load_tasks(2)  # the rows the eval draws (same number, same seed)
    script = {"coder": [solve_coding(rows)] * 2,
              "player": [tool_call("bash", command="grep -r remember projects"), submit_found]}
    args: dict[str, dict[str, Any]] = {"coding": {"tools": False}, "ctf": {"tasks_file": str(one_ctf)}}
    async with backend_named("local", request) as backend, serving(bus, backend) as sandbox, \
            worker_pool("eval", read_only=(str(readable),)) as workers:
        with ScriptedOpenAI(script) as model:
            for env_id, name, n in (("coding", "coder", 2), ("ctf", "player", 1)):
                env = await runs.load_environment(workers, env_id, EnvironmentOverrides(args=args[env_id]))
                cfg = EvalConfig(env=env.name, model=name, base_url=model.base_url, out=tmp_path / f"{name}.jsonl",
                                 num_tasks=n, concurrency=1)
                summary = await Evaluation(cfg, env, io.StringIO()).run(nats_server.url)
                records = read_results(cfg.out)
                assert summary["num_errors"] == 0 and summary["num_reward_errors"] == 0, \
                    [(r["task_id"], r["error"], r["reward_errors"]) for r in records]
                reward = env.info.rewards[0].name
                assert summary["pass@1"] == 1.0 and all(r["rewards"][reward] == 1.0 for r in records)
        assert not sandbox.manager.sessions and sandbox.manager.tombstones  # one-shot test runs and a session
        cfg = EvalConfig(env="ctf", model="player", base_url="http://127.0.0.1:9/v1", out=tmp_path / "none.jsonl",
                         num_tasks=1, max_retries=0)
        summary = await Evaluation(cfg, env, io.StringIO()).run("nats://127.0.0.1:1")
    (record,) = read_results(cfg.out)
    assert summary["num_errors"] == 1 and "start the sandbox service (flywheel up) or set nats_url" in record["error"]


async def test_eval_runs_a_program_harness_in_its_sandbox_by_runtime(bus: Bus, nats_server: NatsServer,
                                                                    tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``flywheel eval --runtime sandbox``: an openai-SDK program written for a subprocess runs in
    each rollout's sandbox, its calls relayed to the eval's recording proxy, the endpoint itself
    out of its reach."""
    monkeypatch.syspath_prepend(str(ENVS))
    backend = LocalBackend(LocalConfig(python_path=python_path("auto")))
    try:
        async with serving(bus, backend, warm_pool=0) as sandbox:
            with ScriptedOpenAI({"agent": ["one", "two", "three"] * 2}) as model:
                cfg = EvalConfig(env="openai_sdk_agent", model="agent", base_url=model.base_url,
                                 out=tmp_path / "boxed.jsonl", num_tasks=2, concurrency=1, runtime="sandbox",
                                 env_args={"probe_url": f"{model.base_url}/models"})
                summary = await run_eval(cfg, nats_server.url, io.StringIO())
            assert not sandbox.manager.sessions and len(sandbox.manager.tombstones) == 2  # one a rollout, gone
    finally:
        await backend.close()
    records = read_results(cfg.out)
    assert summary["runtime"] == "sandbox" and summary["num_errors"] == 0 and summary["pass@1"] == 1.0, records
    for record in records:
        assert record["state"]["answers"] == ["one", "two", "three"]
        assert record["state"]["probe"].startswith("refused"), record["state"]["probe"]
        assert [m["role"] for m in record["messages"]][-2:] == ["user", "assistant"]


async def test_rlm_sub_calls_are_sub_agent_branches_of_the_recorded_trace(bus: Bus, nats_server: NatsServer,
                                                                          tmp_path: Path,
                                                                          request: pytest.FixtureRequest) -> None:
    """long_context in ``flywheel eval --record``: the REPL's ``llm_query`` leaves the sandbox
    through its relay to the eval's recording proxy, so the published rollout's trace graph has
    the conversation and, beside it, the sub-call as a root of its own, both with tokens, ready
    to train like a training run's."""
    (task,) = long_context.load_environment(num_tasks=2, num_records=40, kinds=["needle"]).load_tasks(1)
    code = ("```repl\nlines = context.splitlines()\n"
            "answer = llm_query('Read this and say the amount: ' + lines[0])\nprint(answer)\n```")
    async with backend_named("local", request) as backend, serving(bus, backend, warm_pool=0) as sandbox:
        with ScriptedOpenAI({"agent": [code, "17", "FINAL_VAR(answer)"]}) as model:
            cfg = EvalConfig(env="long_context", model="agent", base_url=model.base_url, out=tmp_path / "rlm.jsonl",
                             num_tasks=1, concurrency=1, record=True, run_id="rlm-eval",
                             env_args={"num_tasks": 2, "num_records": 40, "kinds": ["needle"]})
            summary = await run_eval(cfg, nats_server.url, io.StringIO())
        assert not sandbox.manager.sessions
    assert summary["num_errors"] == 0, read_results(cfg.out)
    (record,) = read_results(cfg.out)
    assert record["state"]["answer"] == "17" and record["state"]["sub_calls"] == 1 and len(record["calls"]) == 3
    await until(lambda: count_is(bus, "ROLLOUTS", 1), what="the eval's rollout on the bus")
    (rollout,) = await stored(bus, "ROLLOUTS", events.Rollout)
    roots = [n for n in rollout.nodes if n.parent_id is None]
    assert len(roots) == 2, [n.message for n in roots]
    sub = next(b for b in branches(rollout.nodes) if b[0].message.content.startswith("Read this and say"))
    assert [n.message.role for n in sub] == ["user", "assistant"] and sub[1].message.content == "17"
    main = next(b for b in branches(rollout.nodes) if b[0].message.role == "system")
    assert main[-1].message.content == "FINAL_VAR(answer)" and task["context"] not in main[1].message.content


async def test_eval_swaps_in_a_command_line_as_the_harness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``flywheel eval reverse_text --harness CMD``: an agent the environment never heard of, run
    as its harness (in a sandbox of each rollout's own, seeing what the workers see: the agent's
    folder is one of setting workers.read_only); the summary says which."""
    agent = ENVS / "openai_agent.py"
    monkeypatch.setenv("FLYWHEEL_WORKERS__READ_ONLY", json.dumps([str(ENVS)]))
    with ScriptedOpenAI({"agent": ["a", "b", "c"] * 2}) as model:
        cfg = EvalConfig(env="reverse_text", model="agent", base_url=model.base_url, out=tmp_path / "swapped.jsonl",
                         num_tasks=2, concurrency=1, harness=f"{{python}} {agent}")
        summary = await run_eval(cfg, "nats://127.0.0.1:1", io.StringIO())
    assert summary["num_errors"] == 0 and summary["harness"] == f"{{python}} {agent}", read_results(cfg.out)
    assert summary["runtime"] == "subprocess"
    for record in read_results(cfg.out):
        assert record["state"]["answers"] == ["a", "b", "c"] and record["messages"][-1]["content"] == "c"
