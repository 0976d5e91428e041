"""API keys on inference's OpenAI API, against a real nats-server and the tiny model: every route
of its OpenAPI walked with no key, a bad one, another tenant's key and a read-only one is
refused (401 without a good key, 403 without the scope, another tenant's run as a run that does
not exist: 404) and samples nothing of the owner's run; the owner's key and the deployment's
service token are served; an open inference refuses a non-loopback address."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from flywheel.contract import events, keys
from flywheel.contract.bus import Bus
from flywheel.contract.settings import Settings
from flywheel.runtime.natsserver import NatsServer
from flywheel.sdk import models
from flywheel_inference.app import create_app
from tests.helpers import until
from tests.integration.test_inference_worker import create_run, publish_weights

SERVICE_TOKEN = "a-secret-the-deployment-shares"
OPEN_PATHS = {"/healthz"}


@pytest.fixture
async def keyed(nats_server: NatsServer, tmp_path: Path, bus: Bus,
                tiny_model_dir: Path) -> AsyncIterator[tuple[FastAPI, dict[str, str]]]:
    app = create_app(Settings(nats_url=nats_server.url, data_dir=tmp_path / "data", auth="keys",
                              service_token=SERVICE_TOKEN))
    async with app.router.lifespan_context(app):
        app.state.keys.ttl_s = 0.0
        cfg = await create_run(bus, tiny_model_dir, "owned-by-a", tenant="a")
        owned = events.RunState(id=cfg.run, tenant="a", config=cfg.model_dump())
        await (await bus.runs_kv()).put(cfg.run, events.encode(owned))
        await publish_weights(bus, "owned-by-a", 0, models.load_model(tiny_model_dir)[0])
        made = {name: (await keys.create_key(bus, tenant, scopes))[0]
                for name, tenant, scopes in [("a", "a", ["read", "write"]), ("b", "b", ["read", "write"]),
                                             ("a_read", "a", ["read"])]}
        yield app, made


async def call(app: FastAPI, method: str, url: str, body: Any, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as client:
        return await client.request(method, url, json=body, headers=headers)


def body_for(path: str) -> dict[str, Any] | None:
    if path.endswith("/chat/completions"):
        return {"model": "owned-by-a", "messages": [{"role": "user", "content": "abc"}], "max_tokens": 3}
    if path.endswith("/completions"):
        return {"model": "owned-by-a", "prompt": "abc", "max_tokens": 3}
    return None


async def test_every_route_refuses_no_key_and_another_tenants_key(keyed: tuple[FastAPI, dict[str, str]]) -> None:
    app, made = keyed
    paths = app.openapi()["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(paths)
    for path, operations in paths.items():
        if path in OPEN_PATHS:
            continue
        url = re.sub(r"\{\w+\}", "fw-not-a-rollout-key", path)
        for method in operations:
            body = body_for(path)
            for key in (None, "fw_0123456789abcdef_not-a-real-key-at-all", made["b"]):
                response = await call(app, method.upper(), url, body, key)
                if key == made["b"] and path == "/v1/models":
                    assert response.status_code == 200 and response.json()["data"] == [], response.text
                    continue
                expected = 404 if key == made["b"] and not path.startswith("/intercept/") else 401
                assert response.status_code == expected, (method, url, key, response.text)
                assert "choices" not in response.text
            if method == "post" and not path.startswith("/intercept/"):
                read_only = await call(app, "POST", url, body, made["a_read"])
                assert read_only.status_code == 403 and "needs 'write'" in read_only.text, read_only.text
    worker = app.state.worker
    assert "owned-by-a" not in worker.info["runs"]  # nothing was sampled, not even loaded, for them
    health = await call(app, "GET", "/healthz", None, None)
    assert health.status_code == 200 and "runs" not in health.json()

    # The owner, and the deployment's own services, are served (once the run's weights are loaded).
    await worker.hosted("owned-by-a")
    await until(lambda: worker.info["runs"]["owned-by-a"]["policy_version"] == 0, what="version 0 loaded")
    for key in (made["a"], SERVICE_TOKEN):
        answer = await call(app, "POST", "/v1/completions", body_for("/v1/completions"), key)
        assert answer.status_code == 200 and answer.json()["choices"], answer.text
    models_a = await call(app, "GET", "/v1/models", None, made["a"])
    assert [m["id"] for m in models_a.json()["data"]] == ["owned-by-a"]


async def test_an_open_inference_listens_on_loopback_only(nats_server: NatsServer, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"inference: auth = \"open\" .* listening on '0\.0\.0\.0'"):
        create_app(Settings(nats_url=nats_server.url, data_dir=tmp_path, inference_host="0.0.0.0"))
    create_app(Settings(nats_url=nats_server.url, data_dir=tmp_path, inference_host="0.0.0.0", auth="keys"))
