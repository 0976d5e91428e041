"""The same environment and weights evaluated on vLLM's own OpenAI server and on Flywheel's
inference service (vLLM backend) sample alike: `flywheel eval` sends both the same sampling,
seed included (each rollout its own), so the endpoints' own defaults do not decide, and the
comparison is paired rollout by rollout instead of resting on two noisy means."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from flywheel.contract import events, weights
from flywheel.contract.bus import Bus
from flywheel.contract.config import RunConfig
from flywheel.contract.settings import Settings
from flywheel.runtime.evalresults import read_results
from flywheel.runtime.evaluation import EvalConfig, run_eval
from flywheel.runtime.natsserver import NatsServer, free_port
from flywheel.runtime.serving import serve
from flywheel.sdk import models
from tests.helpers import until

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed here: "
                                        "scripts/test.sh --vllm runs this tier in .venv-vllm")]

SAMPLING = {"max_tokens": 12, "temperature": 1.0, "seed": 1234}
# Rollouts that may differ: a batch of other sizes can move a logit in its last bits and
# flip a token drawn at a near tie.
MAX_DIFFERENT = 0.1


def vllm_server(model_dir: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    """vLLM's own OpenAI server on CPU, as docs/environments.md starts it."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
             "--served-model-name", "tiny", "--dtype", "float32", "--enforce-eager",
             "--gpu-memory-utilization", "0.1", "--port", str(port)], stdout=out, stderr=subprocess.STDOUT)


async def evaluate(base_url: str, model: str, out: Path) -> dict:
    cfg = EvalConfig(env="reverse_text", model=model, base_url=base_url, out=out, num_tasks=16, num_rollouts=4,
                     concurrency=16, sampling=dict(SAMPLING))
    return await run_eval(cfg, progress_out=io.StringIO())


async def test_vllms_server_and_flywheels_inference_score_alike(nats_server: NatsServer, bus: Bus,
                                                                 tiny_model_dir: Path, tmp_path: Path) -> None:
    from flywheel_inference.app import create_app

    port = free_port()
    server = vllm_server(tiny_model_dir, port, tmp_path / "vllm.log")
    try:
        run_sampling = {k: v for k, v in SAMPLING.items() if k != "seed"}  # a run's seed is its own
        cfg = RunConfig.parse({"run": "v1", "env": "reverse_text", "model": {"name": str(tiny_model_dir)},
                               "sampling": run_sampling, "inference": {"backend": "vllm"}})
        await (await bus.runs_kv()).put("v1", events.encode(events.RunState(id="v1", config=cfg.model_dump())))
        app = create_app(Settings(nats_url=nats_server.url, data_dir=tmp_path / "data"))
        async with app.router.lifespan_context(app):
            served = await serve(app)
            try:
                # The first request makes the service host the run (building its engine: about 25 s).
                async with httpx.AsyncClient(timeout=180) as client:
                    await client.post(served.url + "/v1/chat/completions",
                                      json={"model": "v1", "messages": [{"role": "user", "content": "abc"}]})
                base, _ = models.load_model(tiny_model_dir)
                uri, sha, size = await weights.put(bus, "v1", 0, models.save_weights(base))
                await bus.publish(events.WeightUpdate(run="v1", version=0, uri=uri, sha256=sha, size_bytes=size))
                await until(lambda: app.state.worker.info["runs"].get("v1", {}).get("policy_version") == 0,
                            timeout_s=180, what="version 0 loaded into Flywheel's vLLM engine")
                ours = await evaluate(served.url + "/v1", "v1", tmp_path / "flywheel.jsonl")
            finally:
                await served.stop()

        async def vllm_is_up() -> bool:
            assert server.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
            try:
                async with httpx.AsyncClient() as client:
                    return (await client.get(f"http://127.0.0.1:{port}/v1/models")).status_code == 200
            except httpx.TransportError:
                return False

        await until(vllm_is_up, timeout_s=180, what="vLLM's OpenAI server")
        theirs = await evaluate(f"http://127.0.0.1:{port}/v1", "tiny", tmp_path / "vllm.jsonl")
    finally:
        server.send_signal(signal.SIGINT)  # it stops on SIGINT, not promptly on SIGTERM
        try:
            await asyncio.to_thread(server.wait, 30)
        except subprocess.TimeoutExpired:
            server.kill()
    for summary in (ours, theirs):
        assert summary["num_errors"] == 0 and summary["sampling"]["max_tokens"] == 12
        assert summary["completion_tokens"] <= 12 * summary["num_rollouts"]
    # Keyed by task and place in the group (task ids name the eval run, which differs).
    results = [{(json.dumps(r["task"], sort_keys=True), r["index"]): r for r in read_results(path)}
               for path in (tmp_path / "flywheel.jsonl", tmp_path / "vllm.jsonl")]
    answers = [{key: r["messages"][-1]["content"] for key, r in rs.items()} for rs in results]
    assert answers[0].keys() == answers[1].keys() and len(answers[0]) == 64
    different = [key for key, text in answers[0].items() if answers[1][key] != text]
    print(f"reward: Flywheel {ours['reward_mean']:.4f} +- {ours['reward_stderr']:.4f}, "
          f"vLLM's server {theirs['reward_mean']:.4f} +- {theirs['reward_stderr']:.4f}; "
          f"{len(different)} of 64 answers differ")
    assert len(different) <= MAX_DIFFERENT * len(answers[0]), [(answers[0][k], answers[1][k]) for k in different]
    assert all(results[0][key]["reward"] == results[1][key]["reward"] for key in answers[0] if key not in different)
