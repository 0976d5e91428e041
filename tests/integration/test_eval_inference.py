"""``flywheel eval reverse_text`` as a user runs it, against the real inference service (its
OpenAI-compatible API served by uvicorn, the worker on a real nats-server, the tiny model):
4 tasks of 2 rollouts, results and summary, ``--record`` onto the bus as an eval run, then
``--resume`` runs nothing new.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from flywheel.contract import events
from flywheel.contract.bus import Bus
from flywheel.contract.runs import get_run
from flywheel.contract.settings import Settings
from flywheel.runtime.evalresults import read_results
from flywheel.runtime.natsserver import NatsServer
from flywheel.runtime.serving import serve
from flywheel.sdk import models
from flywheel_inference.app import create_app
from tests.helpers import until
from tests.integration.test_inference_worker import create_run, publish_weights, stored


class Counting:
    """The inference app behind a counter of chat completion requests."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.num_chats = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].endswith("/chat/completions"):
            self.num_chats += 1
        await self.app(scope, receive, send)


async def flywheel_eval(*args: str, nats_url: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "flywheel.ops.cli", "eval", "reverse_text", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "FLYWHEEL_NATS_URL": nats_url})
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_eval_against_the_inference_service_records_and_resumes(nats_server: NatsServer, bus: Bus,
                                                                      tmp_path: Path, tiny_model_dir: Path) -> None:
    app = create_app(Settings(nats_url=nats_server.url, data_dir=tmp_path / "data"))
    async with app.router.lifespan_context(app):
        counting = Counting(app)
        served = await serve(counting)
        try:
            await create_run(bus, tiny_model_dir)
            async with httpx.AsyncClient() as client:  # the first request makes the service host the run
                first = await client.post(served.url + "/v1/chat/completions", json={
                    "model": "r1", "messages": [{"role": "user", "content": "abc"}]})
            assert first.status_code == 503, first.text  # no weights yet
            base, _ = models.load_model(tiny_model_dir)
            await publish_weights(bus, "r1", 0, base)
            await until(lambda: app.state.worker.info["runs"].get("r1", {}).get("policy_version") == 0,
                        timeout_s=60, what="version 0 loaded")
            out = tmp_path / "results.jsonl"
            # The tiny model holds 256 positions: fewer tokens than the contract's default 256, sent
            # with every call and recorded.
            args = ("--model", "r1", "--base-url", served.url + "/v1", "-n", "4", "-r", "2", "-c", "4",
                    "--out", str(out), "--max-tokens", "8", "--temperature", "0.9")
            code, stdout, stderr = await flywheel_eval(*args, "--record", "--run-id", "ev1", nats_url=nats_server.url)
            assert code == 0, stderr
            records = read_results(out)
            assert len(records) == 8 and len({r["task_id"] for r in records}) == 4
            for r in records:
                assert r["error"] is None and r["reward_errors"] == {}, r
                assert [m["role"] for m in r["messages"]] == ["system", "user", "assistant"]
                assert r["messages"][1]["content"] == r["task"]["text"]
                assert set(r["rewards"]) == {"similarity", "exact"} and r["reward"] == r["rewards"]["similarity"]
                assert 1 <= r["usage"]["completion_tokens"] <= 8 and r["calls"][0]["logprobs"]
                assert (r["sampling"]["max_tokens"], r["sampling"]["temperature"]) == (8, 0.9)
            summary = json.loads(out.with_suffix(".summary.json").read_text())
            assert (summary["num_tasks"], summary["num_rollouts"], summary["num_errors"]) == (4, 8, 0)
            assert summary["reward_mean"] == sum(r["reward"] for r in records) / 8
            assert summary["completion_tokens"] == sum(r["usage"]["completion_tokens"] for r in records)
            assert {"pass@1", "pass@2"} <= set(summary) and summary["pass_threshold"] == 1.0
            assert "pass@2" in stdout and "8/8 rollouts" in stderr

            state = await get_run(bus, "ev1")
            assert state is not None and (state.kind, state.status) == ("eval", "finished")
            rollouts = [r for r in await stored(bus, "ROLLOUTS", events.Rollout) if r.run == "ev1"]
            scores = [s for s in await stored(bus, "SCORES", events.Score) if s.run == "ev1"]
            assert len(rollouts) == 8
            assert {r.subject().rsplit(".", 1)[0] for r in rollouts} == {"rollouts.ev1.reverse_text"}
            assert all(r.sampling is not None and r.sampling.max_tokens == 8 for r in rollouts)
            assert sorted(s.id for s in scores) == sorted(f"{r.id}.{name}" for r in rollouts
                                                         for name in ("similarity", "exact"))
            assert counting.num_chats == 1 + 8

            code, stdout, stderr = await flywheel_eval(*args, "--resume", nats_url=nats_server.url)
            assert code == 0, stderr
            assert "resume: 4 of 4 tasks done" in stderr and read_results(out) == records
            assert counting.num_chats == 1 + 8  # nothing asked again
        finally:
            await served.stop()
