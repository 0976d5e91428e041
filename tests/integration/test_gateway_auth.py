"""API keys on the gateway, against a real nats-server and the store: every route of its OpenAPI
is walked with no key, a malformed one, another tenant's key and a read-only key, and none
reads or writes the owner's data (401 without a good key, 403 without the scope; another
tenant's things are 404s, as tests/security/test_fail_closed_not_found.py checks in detail;
listings show the caller's own alone); a revoked key is refused; an open gateway refuses a
non-loopback address."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from flywheel.contract import events, keys
from flywheel.contract.bus import Bus
from flywheel.contract.runs import get_run
from flywheel.contract.settings import Settings
from flywheel.runtime.natsserver import NatsServer
from flywheel_gateway.app import create_app
from flywheel_gateway.hub import inspect_package
from flywheel_gateway.store import Store
from tests.unit.test_hub import wheel
from tests.unit.test_store import rollout

RUN = "owned-by-a"
ROLLOUT = "rollout-of-a"
TASK = "task-of-a"
OPEN_PATHS = {"/healthz"}  # a probe's: no tenant's data
HUB_ENV = "a/quiz"
HUB_WHEEL = "a_quiz-0.1.0-py3-none-any.whl"



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
    # A private environment of a's on the hub.
    package = inspect_package(HUB_ENV, "0.1.0", dict([wheel("a_quiz", "0.1.0", HUB_ENV)]), 1 << 20)
    await store.hub_push(package, "a", private=True, pushed_by=None)
    made = {name: (await keys.create_key(bus, tenant, scopes))[0]
            for name, tenant, scopes in [("a", "a", ["read", "write"]), ("b", "b", ["read", "write", "admin"]),
                                         ("a_read", "a", ["read"]), ("a_admin", "a", ["admin"])]}
    return {"keys": made, "node": rollout(ROLLOUT).nodes[-1].id,
            "key_ids": {name: key.split("_")[1] for name, key in made.items()}}


def requests(app: FastAPI, node: str, key_id: str) -> list[tuple[str, str, Any]]:
    """(method, url, json body) for every operation of the OpenAPI, its path parameters naming a's things."""
    values = {"run_id": RUN, "rollout_id": ROLLOUT, "task_id": TASK, "node_id": node, "key_id": key_id,
              "owner": "a", "name": "quiz", "project": "a-quiz", "filename": HUB_WHEEL}
    bodies = {("post", "/v1/tasks"): [{"run": RUN, "env": "math", "data": {"q": "3+3"}}],
              ("post", "/v1/keys"): {"scopes": ["read"], "tenant": "a"},
              ("post", "/v1/runs"): {"run": RUN, "env": "math"}}
    out = []
    for path, operations in app.openapi()["paths"].items():
        url = re.sub(r"\{(\w+)(:path)?\}", lambda m: values[m.group(1)], path)
        for method in operations:
            out.append((method.upper(), url, bodies.get((method, path))))
    return out


async def call(app: FastAPI, method: str, url: str, body: Any, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        return await client.request(method, url, json=body, headers=headers)


async def test_every_route_refuses_no_key_and_another_tenants_key(keyed_app: FastAPI, owned: dict[str, Any]) -> None:
    bus: Bus = keyed_app.state.bus
    walked = requests(keyed_app, owned["node"], owned["key_ids"]["a"])
    a_key_ids = [key_id for name, key_id in owned["key_ids"].items() if name != "b"]
    assert {url for _, url, _ in walked} >= {f"/v1/runs/{RUN}", f"/v1/runs/{RUN}/stream", "/v1/usage/over-time",
                                            f"/v1/traces/{ROLLOUT}/stream", "/v1/tasks"}
    tasks_before = (await bus.js.stream_info("TASKS")).state.messages
    for method, url, body in walked:
        if url in OPEN_PATHS:
            continue
        for key in (None, "fw_0123456789abcdef_not-a-real-key-at-all", "not a key"):
            response = await call(keyed_app, method, url, body, key)
            assert response.status_code == 401, (method, url, key, response.text)
            challenge = 'Basic realm="flywheel hub"' if url.startswith("/hub/") else "Bearer"  # pip's index
            assert response.headers["www-authenticate"] == challenge
        other = await call(keyed_app, method, url, body, owned["keys"]["b"])
        if method == "GET" and url in ("/v1/runs", "/v1/tasks", "/v1/rollouts", "/v1/rollouts/export", "/v1/usage",
                                       "/v1/usage/over-time",
                                       "/v1/keys", "/v1/hub/environments", "/hub/simple/"):
            assert other.status_code == 200, (url, other.text)  # the caller's own: nothing of a's
            assert RUN not in other.text and ROLLOUT not in other.text and TASK not in other.text, (url, other.text)
            assert HUB_ENV not in other.text and "a-quiz" not in other.text, (url, other.text)
            assert not any(key_id in other.text for key_id in a_key_ids), (url, other.text)
        elif (method, url) in (("POST", "/v1/tasks"), ("POST", "/v1/runs")):  # it would create the run: its id is taken
            assert other.status_code == 409 and "taken" in other.json()["detail"], other.text
            assert "'a'" not in other.text, other.text  # the owner goes unnamed
        elif (method, url) in (("PATCH", f"/v1/hub/environments/{HUB_ENV}"),
                               ("POST", f"/v1/hub/environments/{HUB_ENV}/versions")):
            assert other.status_code == 403 and "is not API key" in other.json()["detail"], other.text
        elif method == "POST" and url == "/v1/keys":  # a key of another tenant
            assert other.status_code == 403 and "makes keys of 'b' alone" in other.json()["detail"], other.text
        else:
            assert other.status_code == 404, (method, url, other.text)
        needs = "admin" if url.startswith("/v1/keys") else "write" if method != "GET" else None
        if needs is not None:
            read_only = await call(keyed_app, method, url, body, owned["keys"]["a_read"])
            assert read_only.status_code == 403 and f"needs '{needs}'" in read_only.json()["detail"], read_only.text
    # Nothing was written: no task published, the run as it was.
    assert (await bus.js.stream_info("TASKS")).state.messages == tasks_before
    state = await get_run(bus, RUN)
    assert state is not None and state.status == "running" and state.tenant == "a"

    # The owner reads its own, and a listing names only the caller's tenant.
    for url in (f"/v1/runs/{RUN}", f"/v1/rollouts/{ROLLOUT}", f"/v1/traces/{ROLLOUT}", f"/v1/tasks/{TASK}",
                f"/v1/hub/environments/{HUB_ENV}", f"/hub/files/{HUB_WHEEL}"):
        response = await call(keyed_app, "GET", url, None, owned["keys"]["a"])
        assert response.status_code == 200, (url, response.text)
    runs = await call(keyed_app, "GET", "/v1/runs", None, owned["keys"]["a"])
    assert [r["id"] for r in runs.json()["items"]] == [RUN]
    asked = await call(keyed_app, "GET", "/v1/runs?tenant=a", None, owned["keys"]["b"])
    assert asked.status_code == 403 and "lists its own tenant's alone" in asked.json()["detail"], asked.text
    usage = await call(keyed_app, "GET", "/v1/usage", None, owned["keys"]["a"])
    assert [(u["run"], u["trained_tokens"]) for u in usage.json()["items"]] == [(RUN, 4)]
    asked = await call(keyed_app, "GET", f"/v1/usage?run={RUN}", None, owned["keys"]["b"])
    assert asked.status_code == 404 and "not found" in asked.json()["detail"], asked.text
    asked = await call(keyed_app, "GET", "/v1/usage?tenant=a", None, owned["keys"]["b"])
    assert asked.status_code == 403 and "lists its own tenant's alone" in asked.json()["detail"], asked.text
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


async def test_an_admin_key_makes_lists_and_revokes_its_tenants_keys(keyed_app: FastAPI, owned: dict[str, Any]) -> None:
    admin = owned["keys"]["a_admin"]
    made = await call(keyed_app, "POST", "/v1/keys", {"scopes": ["read"], "name": "ci"}, admin)
    assert made.status_code == 201, made.text
    new = made.json()
    assert (new["tenant"], new["scopes"], new["name"], new["revoked_at"]) == ("a", ["read"], "ci", None)
    assert (await call(keyed_app, "GET", f"/v1/runs/{RUN}", None, new["key"])).status_code == 200
    assert (await call(keyed_app, "GET", f"/v1/runs/{RUN}", None, admin)).status_code == 403  # admin is not read
    listed = (await call(keyed_app, "GET", "/v1/keys", None, admin)).json()["items"]
    assert {k["id"] for k in listed} == {owned["key_ids"][name] for name in ("a", "a_read", "a_admin")} | {new["id"]}
    assert all("key" not in k and "sha256" not in k for k in listed)  # no secret, not even its hash
    revoked = await call(keyed_app, "DELETE", f"/v1/keys/{new['id']}", None, admin)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    refused = await call(keyed_app, "GET", f"/v1/runs/{RUN}", None, new["key"])
    assert refused.status_code == 401 and "revoked" in refused.json()["detail"]
    unknown = await call(keyed_app, "DELETE", "/v1/keys/0123456789abcdef", None, admin)
    assert unknown.status_code == 404 and "0123456789abcdef" in unknown.json()["detail"]
    bad = await call(keyed_app, "POST", "/v1/keys", {"scopes": ["root"]}, admin)
    assert bad.status_code == 422 and "scopes" in bad.text
