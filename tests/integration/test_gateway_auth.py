"""API keys on the gateway, against a real nats-server and the store: every route of its OpenAPI
is walked with no key, a malformed one, another tenant's key and a read-only key, and none
reads or writes the owner's data (the right 401 or 403 each time; listings show the caller's
own alone); a revoked key is refused; an open gateway refuses a non-loopback address."""

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
from flywheel.contract.runs import get_run
from flywheel.contract.settings import Settings
from flywheel.ops.natsserver import NatsServer
from flywheel_gateway.app import create_app
from flywheel_gateway.store import Store
from tests.unit.test_store import rollout

RUN = "owned-by-a"
ROLLOUT = "rollout-of-a"
TASK = "task-of-a"
OPEN_PATHS = {"/healthz"}  # a probe's: no tenant's data


@pytest.fixture
async def keyed_app(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[FastAPI]:
    application = create_app(Settings(nats_url=nats_server.url, data_dir=tmp_path / "data", auth="keys"))
    async with application.router.lifespan_context(application):
        application.state.keys.ttl_s = 0.0  # a revocation shows at once here
        yield application


@pytest.fixture
async def owned(keyed_app: FastAPI) -> dict[str, Any]:
    """Tenant a's run, task, rollout and trace, recorded; keys of a, of b, and a read-only one of a."""
    bus: Bus = keyed_app.state.bus
    store: Store = keyed_app.state.store
    state = events.RunState(id=RUN, tenant="a", status="running")
    await (await bus.runs_kv()).put(RUN, events.encode(state))
    await store.upsert_runs([state])
    task = events.Task(id=TASK, run=RUN, env="math", data={"q": "2+2"})
    await store.record([task, rollout(ROLLOUT, task_id=TASK, run=RUN),
                        events.Usage(run=RUN, source="trainer", step=1, trained_tokens=4, rollout_ids=[ROLLOUT])])
    made = {name: (await keys.create_key(bus, tenant, scopes))[0]
            for name, tenant, scopes in [("a", "a", ["read", "write"]), ("b", "b", ["read", "write", "admin"]),
                                         ("a_read", "a", ["read"])]}
    return {"keys": made, "node": rollout(ROLLOUT).nodes[-1].id}


def requests(app: FastAPI, node: str) -> list[tuple[str, str, Any]]:
    """(method, url, json body) for every operation of the OpenAPI, its path parameters naming a's things."""
    values = {"run_id": RUN, "rollout_id": ROLLOUT, "task_id": TASK, "node_id": node}
    out = []
    for path, operations in app.openapi()["paths"].items():
        url = re.sub(r"\{(\w+)(:path)?\}", lambda m: values[m.group(1)], path)
        for method in operations:
            body = [{"run": RUN, "env": "math", "data": {"q": "3+3"}}] if (method, path) == ("post", "/v1/tasks") \
                else None
            out.append((method.upper(), url, body))
    return out


async def call(app: FastAPI, method: str, url: str, body: Any, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        return await client.request(method, url, json=body, headers=headers)


async def test_every_route_refuses_no_key_and_another_tenants_key(keyed_app: FastAPI, owned: dict[str, Any]) -> None:
    bus: Bus = keyed_app.state.bus
    walked = requests(keyed_app, owned["node"])
    assert {url for _, url, _ in walked} >= {f"/v1/runs/{RUN}", f"/v1/traces/{ROLLOUT}/stream", "/v1/tasks"}
    tasks_before = (await bus.js.stream_info("TASKS")).state.messages
    for method, url, body in walked:
        if url in OPEN_PATHS:
            continue
        for key in (None, "fw_0123456789abcdef_not-a-real-key-at-all", "not a key"):
            response = await call(keyed_app, method, url, body, key)
            assert response.status_code == 401, (method, url, key, response.text)
            assert response.headers["www-authenticate"] == "Bearer"
        other = await call(keyed_app, method, url, body, owned["keys"]["b"])
        if method == "GET" and url in ("/v1/runs", "/v1/tasks", "/v1/rollouts", "/v1/rollouts/export", "/v1/usage"):
            assert other.status_code == 200, (url, other.text)  # the caller's own: nothing of a's
            assert RUN not in other.text and ROLLOUT not in other.text and TASK not in other.text, (url, other.text)
        else:
            assert other.status_code == 403, (method, url, other.text)
            assert "another tenant" in other.json()["detail"], other.text
        if method != "GET":
            read_only = await call(keyed_app, method, url, body, owned["keys"]["a_read"])
            assert read_only.status_code == 403 and "needs 'write'" in read_only.json()["detail"], read_only.text
    # Nothing was written: no task published, the run as it was.
    assert (await bus.js.stream_info("TASKS")).state.messages == tasks_before
    state = await get_run(bus, RUN)
    assert state is not None and state.status == "running" and state.tenant == "a"

    # The owner reads its own, and a listing names only the caller's tenant.
    for url in (f"/v1/runs/{RUN}", f"/v1/rollouts/{ROLLOUT}", f"/v1/traces/{ROLLOUT}", f"/v1/tasks/{TASK}"):
        response = await call(keyed_app, "GET", url, None, owned["keys"]["a"])
        assert response.status_code == 200, (url, response.text)
    runs = await call(keyed_app, "GET", "/v1/runs", None, owned["keys"]["a"])
    assert [r["id"] for r in runs.json()["items"]] == [RUN]
    asked = await call(keyed_app, "GET", "/v1/runs?tenant=a", None, owned["keys"]["b"])
    assert asked.status_code == 403, asked.text
    usage = await call(keyed_app, "GET", "/v1/usage", None, owned["keys"]["a"])
    assert [(u["run"], u["trained_tokens"]) for u in usage.json()["items"]] == [(RUN, 4)]
    for asked_url in (f"/v1/usage?run={RUN}", "/v1/usage?tenant=a"):
        asked = await call(keyed_app, "GET", asked_url, None, owned["keys"]["b"])
        assert asked.status_code == 403 and "another tenant" in asked.json()["detail"], asked.text
    headed = await call(keyed_app, "GET", "/v1/runs", None, owned["keys"]["b"])
    assert headed.status_code == 200
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=keyed_app), base_url="http://gateway") as client:
        spoofed = await client.get("/v1/runs", headers={"Authorization": f"Bearer {owned['keys']['b']}",
                                                        "Flywheel-Tenant": "a"})
    assert spoofed.status_code == 403 and "Flywheel-Tenant names 'a'" in spoofed.json()["detail"]
    assert (await call(keyed_app, "GET", "/healthz", None, None)).status_code in (200, 503)


async def test_a_revoked_key_is_refused(keyed_app: FastAPI, owned: dict[str, Any]) -> None:
    bus: Bus = keyed_app.state.bus
    key = owned["keys"]["a"]
    assert (await call(keyed_app, "GET", f"/v1/runs/{RUN}", None, key)).status_code == 200
    (record,) = [r for r in await keys.list_keys(bus, "a") if "write" in r.scopes]
    assert record.sha256 == keys.digest(key) and key not in str(await (await bus.keys_kv()).get(record.id))
    await keys.revoke_key(bus, record.id)
    refused = await call(keyed_app, "GET", f"/v1/runs/{RUN}", None, key)
    assert refused.status_code == 401 and f"API key {record.id} was revoked" in refused.json()["detail"]
    with pytest.raises(LookupError, match="no key with id 'nope'"):
        await keys.revoke_key(bus, "nope")


async def test_an_open_gateway_listens_on_loopback_only(nats_server: NatsServer, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"auth = \"open\" .* listening on '0\.0\.0\.0'.*FLYWHEEL_AUTH=keys"):
        create_app(Settings(nats_url=nats_server.url, data_dir=tmp_path, gateway_host="0.0.0.0"))
    create_app(Settings(nats_url=nats_server.url, data_dir=tmp_path, gateway_host="0.0.0.0", auth="keys"))
    create_app(Settings(nats_url=nats_server.url, data_dir=tmp_path, gateway_host="::1"))
