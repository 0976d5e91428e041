"""The gateway's HTTP API in process (httpx + ASGI) against a real nats-server and SQLite.

Reads are checked on rows written straight into the store (the recorder has its own tests:
test_recorder_kill.py); writes are checked on what lands in JetStream and the run-state
KV bucket. Not covered: the uvicorn process itself (test_recorder_kill.py starts it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from flywheel import events
from flywheel.natsserver import NatsServer
from flywheel.settings import Settings
from flywheel_gateway.app import create_app
from flywheel_gateway.store import Store
from tests.unit.test_store import rollout, score, task


@pytest.fixture
async def app(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[FastAPI]:
    application = create_app(Settings(nats_url=nats_server.url, data_dir=tmp_path / "data"))
    async with application.router.lifespan_context(application):
        yield application


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as c:
        yield c


async def stored_tasks(app: FastAPI) -> list[events.Task]:
    js = app.state.bus.js
    info = await js.stream_info("TASKS")
    decoder = events.Decoder(events.Task)
    return [decoder.decode((await js.get_msg("TASKS", seq)).data)
            for seq in range(info.state.first_seq, info.state.last_seq + 1)] if info.state.messages else []


async def unprocessable(client: httpx.AsyncClient, method: str, url: str, **kwargs: Any) -> str:
    response = await client.request(method, url, **kwargs)
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["detail"] == "; ".join(f"{e['field']}: {e['message']}" for e in body["errors"])
    return body["detail"]


# --- publishing tasks ---------------------------------------------------------------------


async def test_post_one_task_publishes_it_and_creates_the_run(app: FastAPI, client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/tasks", json={"run": "r1", "env": "math", "data": {"q": "2+2"},
                                                    "num_rollouts": 4, "sampling": {"temperature": 0.7}},
                                 headers={"Flywheel-Tenant": "acme"})
    assert response.status_code == 202, response.text
    (task_id,) = response.json()["ids"]
    (published,) = await stored_tasks(app)
    assert published.id == task_id and published.run == "r1" and published.env == "math"
    assert published.num_rollouts == 4 and published.sampling == events.Sampling(temperature=0.7)
    state = events.Decoder(events.RunState).decode((await (await app.state.bus.runs_kv()).get("r1")).value)
    assert state.tenant == "acme" and state.status == "created"


async def test_post_a_list_is_deduplicated_by_id(app: FastAPI, client: httpx.AsyncClient) -> None:
    body = [{"id": f"t{i}", "run": "r1", "env": "code", "data": {"i": i}} for i in range(3)]
    for _ in range(2):  # a client retrying the whole request
        response = await client.post("/v1/tasks", json=body)
        assert response.status_code == 202 and response.json() == {"ids": ["t0", "t1", "t2"]}
    assert sorted(t.id for t in await stored_tasks(app)) == ["t0", "t1", "t2"]


async def test_a_run_belongs_to_its_first_tenant(client: httpx.AsyncClient) -> None:
    one = {"run": "r1", "env": "e", "data": {}}
    assert (await client.post("/v1/tasks", json=one, headers={"Flywheel-Tenant": "acme"})).status_code == 202
    refused = await client.post("/v1/tasks", json=one)  # the default tenant
    assert refused.status_code == 409
    assert "run 'r1' belongs to tenant 'acme', not 'default'" in refused.json()["detail"]


async def test_bad_tasks_are_refused_naming_the_field(app: FastAPI, client: httpx.AsyncClient) -> None:
    ok = {"run": "r1", "env": "math", "data": {}}
    detail = await unprocessable(client, "POST", "/v1/tasks", json=[ok, ok, {"env": "math", "data": {}}])
    assert detail == "tasks[2].run: field required"
    detail = await unprocessable(client, "POST", "/v1/tasks", json=[ok, {**ok, "env": "a.b"}, {**ok, "run": "x y"}])
    assert "tasks[1].env: must be a NATS subject token (no '.', spaces, '*' or '>'), got 'a.b'" in detail
    assert "tasks[2].run: must be letters, digits" in detail
    for bad in ("*", ">", "a b", ""):
        assert "task.env: must be a NATS subject token" in await unprocessable(
            client, "POST", "/v1/tasks", json={**ok, "env": bad})
    detail = await unprocessable(client, "POST", "/v1/tasks", json={**ok, "num_rolouts": 2})
    assert detail == "task.num_rolouts: unknown field (check its spelling)"
    detail = await unprocessable(client, "POST", "/v1/tasks", json={**ok, "sampling": {"top_p": 0}})
    assert detail == "task.sampling.top_p: input should be greater than 0"
    detail = await unprocessable(client, "POST", "/v1/tasks", json=[{**ok, "id": "a"}, {**ok, "id": "a"}])
    assert detail == "tasks[1].id: repeats tasks[0].id ('a'); task ids must be unique"
    assert (await unprocessable(client, "POST", "/v1/tasks", json=[])).startswith("tasks: list should have at least 1")
    assert (await unprocessable(client, "POST", "/v1/tasks", json="run=r1")).startswith("task: input should be")
    assert (await unprocessable(client, "POST", "/v1/tasks", content=b"{not json",
                                headers={"Content-Type": "application/json"})).startswith("body: not valid JSON (")
    assert "Flywheel-Tenant: must be" in await unprocessable(client, "POST", "/v1/tasks", json=ok,
                                                             headers={"Flywheel-Tenant": "a b"})
    assert await stored_tasks(app) == []  # nothing of a refused request is published


# --- reading what the recorder stored -----------------------------------------------------


@pytest.fixture
async def store(app: FastAPI) -> Store:
    return app.state.store


async def test_task_listing_and_detail(client: httpx.AsyncClient, store: Store) -> None:
    await store.record([task(i, env="math" if i % 2 else "code") for i in range(7)])
    first = (await client.get("/v1/tasks", params={"limit": 4})).json()
    assert [t["id"] for t in first["items"]] == ["t6", "t5", "t4", "t3"]
    rest = (await client.get("/v1/tasks", params={"limit": 4, "cursor": first["next_cursor"]})).json()
    assert [t["id"] for t in rest["items"]] == ["t2", "t1", "t0"] and rest["next_cursor"] is None
    math = (await client.get("/v1/tasks", params={"run": "r1", "env": "math"})).json()
    assert [t["id"] for t in math["items"]] == ["t5", "t3", "t1"]
    one = (await client.get("/v1/tasks/t3")).json()
    assert one["data"] == {"q": "3+3"} and one["sampling"]["temperature"] == 0.5
    assert one["created_at"] == "2026-11-01T12:00:03Z"
    missing = await client.get("/v1/tasks/nope")
    assert missing.status_code == 404 and missing.json()["detail"].startswith("task 'nope' not found")
    assert (await unprocessable(client, "GET", "/v1/tasks", params={"limit": 0})).startswith("limit: input should be")
    assert (await unprocessable(client, "GET", "/v1/tasks", params={"cursor": "zz"})).startswith("cursor: cursor 'zz'")


async def test_rollout_listing_filters_and_detail(client: httpx.AsyncClient, store: Store) -> None:
    await store.record([rollout("low", policy_version=1), rollout("high", policy_version=2),
                        rollout("broken", status="error"), score("s1", "low", 0.2), score("s2", "high", 0.9),
                        score("s3", "high", 1.0, weight=0.5, scorer="length")])

    async def ids(**params: Any) -> list[str]:
        response = await client.get("/v1/rollouts", params=params)
        assert response.status_code == 200, response.text
        return [r["id"] for r in response.json()["items"]]

    assert await ids() == ["broken", "high", "low"]
    assert await ids(min_reward=0.5) == ["high"]
    assert await ids(max_reward=0.5, run="r1", env="math") == ["low"]
    assert await ids(policy_version=1) == ["low"]
    assert await ids(min_policy_version=2) == ["broken", "high"]
    assert await ids(min_policy_version=2, max_policy_version=2) == ["high"]
    assert await ids(status="error") == ["broken"]
    page = (await client.get("/v1/rollouts", params={"limit": 2})).json()
    assert await ids(cursor=page["next_cursor"], limit=2) == ["low"]
    detail = await unprocessable(client, "GET", "/v1/rollouts", params={"min_reward": 1, "max_reward": 0})
    assert detail == "min_reward: is greater than max_reward (1.0 > 0.0)"
    assert (await unprocessable(client, "GET", "/v1/rollouts", params={"status": "done"})).startswith("status: ")

    high = (await client.get("/v1/rollouts/high")).json()
    assert high["reward"] == pytest.approx(1.4) and high["num_tokens"] == 9 and high["policy_version"] == 2
    assert [(s["scorer"], s["value"], s["weight"]) for s in high["scores"]] == [("exact", 0.9, 1.0), ("length", 1.0, 0.5)]
    assert high["metrics"] == {"num_turns": 1.0}
    assert (await client.get("/v1/rollouts/broken")).json()["reward"] is None
    missing = await client.get("/v1/rollouts/nope")
    assert missing.status_code == 404 and "rollout 'nope' not found" in missing.json()["detail"]


async def test_trace_graph_with_and_without_tokens(client: httpx.AsyncClient, store: Store) -> None:
    await store.record([rollout("ro1", answer="4")])
    trace = (await client.get("/v1/traces/ro1")).json()
    assert trace["rollout_id"] == "ro1"
    assert [(n["message"]["role"], n["message"]["content"]) for n in trace["nodes"]] == [
        ("system", "be brief"), ("user", "2+2?"), ("assistant", "4")]
    assert trace["nodes"][1]["parent_id"] == trace["nodes"][0]["id"] and trace["nodes"][0]["parent_id"] is None
    assert all(n["tokens"] is None for n in trace["nodes"])
    with_tokens = (await client.get("/v1/traces/ro1", params={"tokens": "true"})).json()
    assert with_tokens["nodes"][2]["tokens"] == {"token_ids": [6, 7, 8, 9], "logprobs": [-0.5] * 4,
                                                 "loss_mask": [True] * 4, "policy_version": 3}
    missing = await client.get("/v1/traces/nope")
    assert missing.status_code == 404 and missing.json() == {"detail": "no trace recorded for rollout 'nope'"}


# --- health and docs ----------------------------------------------------------------------


async def test_healthz_reports_nats_going_away_and_coming_back(client: httpx.AsyncClient,
                                                               nats_server: NatsServer) -> None:
    ok = await client.get("/healthz")
    assert ok.status_code == 200 and ok.json() == {"status": "ok", "checks": {"database": "ok", "nats": "ok"}}
    nats_server.stop()
    down = await client.get("/healthz")
    assert down.status_code == 503
    assert down.json()["checks"]["database"] == "ok" and down.json()["checks"]["nats"].startswith("down: ")
    nats_server.start()
    from tests.helpers import until

    async def healthy() -> bool:
        return (await client.get("/healthz")).status_code == 200

    await until(healthy, what="/healthz to recover after nats-server restarts")


async def test_docs_are_served(client: httpx.AsyncClient) -> None:
    assert (await client.get("/docs")).status_code == 200
    spec = (await client.get("/openapi.json")).json()
    assert {"/v1/tasks", "/v1/tasks/{task_id}", "/v1/rollouts", "/v1/rollouts/{rollout_id}", "/v1/rollouts/export",
            "/v1/traces/{rollout_id}", "/v1/traces/{rollout_id}/branches/{node_id}", "/v1/traces/{rollout_id}/stream",
            "/healthz"} <= set(spec["paths"])
    assert {p["name"] for p in spec["paths"]["/v1/rollouts"]["get"]["parameters"]} >= {
        "error", "created_after", "created_before", "min_reward", "cursor"}
