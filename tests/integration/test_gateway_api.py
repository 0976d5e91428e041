"""The gateway's HTTP API in process (httpx + ASGI) against a real nats-server and SQLite.

Reads are checked on rows written straight into the store (the recorder has its own tests:
test_recorder_kill.py); writes are checked on what lands in JetStream and the run-state
KV bucket. Bad input of every kind is refused with the status and the field it deserves,
before anything is published or streamed. Not covered: the uvicorn process itself
(test_recorder_kill.py starts it), generated requests (test_schema_fuzz.py).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from flywheel.contract import events
from flywheel.contract.names import KEY_PATTERN, RUN_ID_PATTERN, is_key, is_run_id, is_token
from flywheel.contract.settings import Settings
from flywheel.runtime.natsserver import NatsServer
from flywheel.runtime.tasks import make_tasks
from flywheel_gateway.app import create_app
from flywheel_gateway.models import TASK_ID_PATTERN, TOKEN_PATTERN, subject_token, task_id
from flywheel_gateway.store import Store
from flywheel_inference.policy import Policy
from tests.unit.test_store import rollout, score, task


async def stored_tasks(app: FastAPI) -> list[events.Task]:
    js = app.state.bus.js
    info = await js.stream_info("TASKS")
    decoder = events.Decoder(events.Task)
    return [decoder.decode((await js.get_msg("TASKS", seq)).data)
            for seq in range(info.state.first_seq, info.state.last_seq + 1)] if info.state.messages else []


async def put_state(app: FastAPI, state: events.RunState) -> None:
    await (await app.state.bus.runs_kv()).put(state.id, events.encode(state))


async def runs_in_bucket(app: FastAPI) -> list[str]:
    kv = await app.state.bus.runs_kv()
    try:
        return sorted(await kv.keys())
    except Exception as exc:
        if type(exc).__name__ == "NoKeysError":
            return []
        raise


async def refused(client: httpx.AsyncClient, status: int, method: str, url: str, **kwargs: Any) -> str:
    response = await client.request(method, url, **kwargs)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    return response.json()["detail"]


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


async def test_a_task_posted_twice_without_an_id_is_stored_once(app: FastAPI, client: httpx.AsyncClient) -> None:
    # Ids are made as the client makes them (flywheel.contract.events.task_id), a task's position
    # being its index in the request, from 1: a POST retried without ids stores nothing new.
    rows = [{"text": "abc"}, {"text": "abc"}, {"id": "q-17", "text": "own"}]
    body = [{"run": "r1", "env": "echo", "data": row} for row in rows]
    first = await client.post("/v1/tasks", json=body)
    assert first.status_code == 202, first.text
    ids = first.json()["ids"]
    assert ids == [t.id for t in make_tasks("r1", "echo", enumerate(rows, 1))]
    assert ids[2] == "q-17" and len(set(ids)) == 3  # the same row at two positions is two tasks
    again = await client.post("/v1/tasks", json=body)
    assert again.status_code == 202 and again.json()["ids"] == ids
    one = await client.post("/v1/tasks", json=body[0])  # one task is the first of a list of one
    assert one.status_code == 202 and one.json()["ids"] == ids[:1]
    assert sorted(t.id for t in await stored_tasks(app)) == sorted(ids)
    assert (await app.state.bus.js.stream_info("TASKS")).state.messages == 3


async def test_the_gateway_accepts_exactly_the_sampling_inference_runs(app: FastAPI,
                                                                      client: httpx.AsyncClient) -> None:
    # What inference checks before it rolls a task out (Policy.check, on a model of any length):
    # a task the gateway accepts must not be dead-lettered for its sampling.
    class AnyLength:
        max_positions = None

    policy = Policy("r1", AnyLength(), None, 1)  # type: ignore[arg-type]  # a stand-in model: check reads its length
    cases: list[dict[str, Any]] = [
        {"temperature": 0}, {"temperature": -0.5}, {"temperature": 1e-3}, {"temperature": 2.0},
        {"top_p": 0}, {"top_p": 1e-6}, {"top_p": 1}, {"top_p": 1.01}, {"max_tokens": 0}, {"max_tokens": 1},
        {"stop": [""]}, {"stop": ["\n", "</s>"]}, {"seed": 0}, {"seed": 2**31 - 1}, {}]
    for i, sampling in enumerate(cases):
        response = await client.post("/v1/tasks", json={"run": "r1", "env": "e", "data": {"i": i},
                                                        "sampling": sampling})
        try:
            policy.check([[1]], events.Sampling(**sampling))
        except ValueError:
            assert response.status_code == 422, (sampling, response.text)
            (field,) = sampling
            assert response.json()["errors"][0]["field"].startswith(f"task.sampling.{field}"), response.text
        else:
            assert response.status_code == 202, (sampling, response.text)


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
    assert "tasks[1].env: must be a NATS subject token (no '.', '*', '>', spaces or control characters), got " \
           "'a.b'" in detail
    assert "tasks[2].run: a run id is 1 to 128 letters, digits" in detail
    for bad in ("*", ">", "a b", "", "\x00", "a\x7fb"):  # the NATS server drops a client for some control characters
        assert "task.env: must be a NATS subject token" in await unprocessable(
            client, "POST", "/v1/tasks", json={**ok, "env": bad})
    for bad in ("a\nb", "  ", "\r"):  # the id is the Nats-Msg-Id header
        assert "task.id: must be on one line and not blank" in await unprocessable(
            client, "POST", "/v1/tasks", json={**ok, "id": bad})
    detail = await unprocessable(client, "POST", "/v1/tasks", content=b'{"run": "r1", "env": "e", "data": {"x": [1, '
                                 b'NaN]}}', headers={"Content-Type": "application/json"})
    assert detail == "task.data: data['x'][1] is nan, which JSON cannot carry; send a finite number or a string"
    detail = await unprocessable(client, "POST", "/v1/tasks", json={**ok, "data": {"n": 2**64}})
    assert detail == f"task.data: data['n'] is an integer beyond 64 bits ({2**64}); send it as a string"
    detail = await unprocessable(client, "POST", "/v1/tasks",
                                 json={**ok, "sampling": {"max_tokens": 2**70, "seed": -1}})
    assert "task.sampling.max_tokens: input should be less than or equal to 2147483647" in detail
    assert "task.sampling.seed: input should be greater than or equal to 0" in detail
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


async def test_bodies_above_the_limit_are_refused_naming_it(nats_server: NatsServer, tmp_path: Path) -> None:
    application = create_app(Settings(nats_url=nats_server.url, data_dir=tmp_path / "data",
                                      gateway_max_body_bytes=2048))
    body = json.dumps([{"run": "r1", "env": "e", "data": {"text": "x" * 100}}] * 20).encode()
    assert len(body) > 2048

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted as it is read
        for i in range(0, len(body), 500):
            yield body[i:i + 500]

    async with application.router.lifespan_context(application), \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://gateway") as http:
        limit = "the request body is larger than the gateway's limit of 2048 bytes (setting gateway_max_body_bytes)"
        declared = await refused(http, 413, "POST", "/v1/tasks", content=body,
                                 headers={"Content-Type": "application/json"})
        assert declared.startswith(limit)
        counted = await refused(http, 413, "POST", "/v1/tasks", content=chunked(),
                                headers={"Content-Type": "application/json"})
        assert counted.startswith(limit)
        small = await http.post("/v1/tasks", json={"run": "r1", "env": "e", "data": {}})
        assert small.status_code == 202, small.text
        assert len(await stored_tasks(application)) == 1  # only the small one


async def test_a_task_larger_than_the_bus_takes_is_refused_for_good(app: FastAPI, client: httpx.AsyncClient) -> None:
    bus = app.state.bus
    max_payload = bus.nc.max_payload

    def sized(target: int, **fields: Any) -> dict[str, Any]:
        """A task body whose published size (payload and headers) is ``target`` bytes."""
        body = {"run": "big", "env": "e", "data": {"text": ""}, **fields}
        size = bus.published_size(events.Task(**{**body, "data": {"text": ""}}))
        return {**body, "data": {"text": "x" * (target - size)}}

    # The payload alone is below the max payload; with its headers it is not: the server would
    # drop the gateway's connection, and the old answer was a 503 "retry later".
    over = sized(max_payload + 1, id="over")
    assert len(events.encode(events.Task(**over))) < max_payload
    detail = await refused(client, 413, "POST", "/v1/tasks", json=[{"run": "big", "env": "e", "data": {}}, over])
    assert detail.startswith(f"tasks[1] is {max_payload + 1} bytes as published (payload and headers), above the "
                             f"bus's max payload of {max_payload} bytes; make the task data smaller")
    assert await stored_tasks(app) == [] and await runs_in_bucket(app) == []  # nothing of it published or created
    assert (await refused(client, 413, "POST", "/v1/tasks", json=over)).startswith("task is ")
    exact = await client.post("/v1/tasks", json=sized(max_payload, id="exact"))
    assert exact.status_code == 202, exact.text
    assert [t.id for t in await stored_tasks(app)] == ["exact"]


async def test_tasks_for_a_run_that_has_ended_are_refused(app: FastAPI, client: httpx.AsyncClient) -> None:
    now = events.utc_now()
    ended = {
        "done": events.RunState(id="done", status="finished", ended_at=now),
        "broken": events.RunState(id="broken", status="failed", reason="the trainer ran out of memory"),
        "halted": events.RunState(id="halted", status="stopped", reason="stopped by the user"),
        "orphan": events.RunState(id="orphan", status="running", owner="flywheel-run pid 7 on box",
                                  lease_expires_at=now - timedelta(minutes=1)),
    }
    for state in ended.values():
        await put_state(app, state)
    await put_state(app, events.RunState(id="alive", status="running", lease_expires_at=now + timedelta(minutes=1)))
    for run, says in (("done", "run 'done' finished at"), ("broken", "failed at"), ("broken", "(the trainer ran out"),
                      ("halted", "(stopped by the user)"),
                      ("orphan", "is abandoned: flywheel-run pid 7 on box stopped")):
        # With a task for a new run and one for a live run before it: nothing of the request goes out.
        body = [{"run": "new", "env": "e", "data": {}}, {"run": "alive", "env": "e", "data": {}},
                {"run": run, "env": "e", "data": {}}]
        detail = await refused(client, 409, "POST", "/v1/tasks", json=body)
        assert says in detail and detail.endswith("; it takes no more tasks: publish them to a new run (another run "
                                                  "id), which `flywheel run` or the first task naming it registers")
    assert await stored_tasks(app) == [] and "new" not in await runs_in_bucket(app)
    ok = await client.post("/v1/tasks", json={"run": "alive", "env": "e", "data": {}})
    assert ok.status_code == 202, ok.text
    # The end is read live: a run that ends after its first tasks takes no more.
    await put_state(app, events.RunState(id="alive", status="stopped", reason="stopped by the user"))
    assert "run 'alive' stopped at" in await refused(client, 409, "POST", "/v1/tasks",
                                                     json={"run": "alive", "env": "e", "data": {}})
    assert len(await stored_tasks(app)) == 1


async def test_a_run_state_that_does_not_decode_is_a_conflict_not_a_crash(app: FastAPI, client: httpx.AsyncClient,
                                                                         store: Store) -> None:
    await (await app.state.bus.runs_kv()).put("odd", b"written by something else")
    await store.record([task(1, run="odd")])
    for method, url, kwargs in (("POST", "/v1/tasks", {"json": {"run": "odd", "env": "e", "data": {}}}),
                                ("GET", "/v1/runs/odd", {})):
        detail = await refused(client, 409, method, url, **kwargs)
        assert detail.startswith("run 'odd': its entry in the flywheel-runs KV bucket is not a run state (")
        assert detail.endswith("delete or rewrite the key")
    assert (await client.get("/v1/runs/odd/metrics")).json() == {"run": "odd", "items": []}
    assert await stored_tasks(app) == []


async def test_integers_and_times_are_bounded_to_what_the_store_holds(client: httpx.AsyncClient,
                                                                     store: Store) -> None:
    await store.record([rollout("ro1")])
    for url in ("/v1/rollouts", "/v1/rollouts/export"):
        for name in ("policy_version", "min_policy_version", "max_policy_version"):
            for value, says in ((2**64, "less than or equal to 2147483647"), (-1, "greater than or equal to 0")):
                detail = await unprocessable(client, "GET", url, params={name: value})
                assert detail == f"{name}: input should be {says}"
        detail = await unprocessable(client, "GET", url, params={"created_after": "0001-01-01T00:00:00+01:00"})
        assert detail == ("created_after: is out of range once converted to UTC (0001-01-01T00:00:00+01:00); give a "
                          "time between 0001-01-01 and 9999-12-31 UTC")
        assert (await unprocessable(client, "GET", url, params={"created_before": "63"})).startswith(
            "created_before: give an RFC 3339 time with an offset")
    for value in (2**64, -2):
        assert (await unprocessable(client, "GET", "/v1/runs/r1/metrics", params={"since_step": value})).startswith(
            "since_step: input should be")
    assert (await client.get("/v1/runs/r1/metrics", params={"since_step": -1})).status_code == 200
    assert (await unprocessable(client, "GET", "/v1/tasks/" + "x" * 1025)).startswith("task_id: string should have")
    assert (await unprocessable(client, "GET", "/v1/runs", params={"tenant": "a b"})).startswith("tenant: must be")
    assert (await unprocessable(client, "GET", "/v1/tasks", params={"env": "\x00"})).startswith("env: must be")


async def test_a_body_that_is_not_utf8_is_invalid_json(client: httpx.AsyncClient) -> None:
    detail = await unprocessable(client, "POST", "/v1/tasks", content=b'{"run": "\xff"}',
                                 headers={"Content-Type": "application/json"})
    assert detail == "body: not valid JSON (not UTF-8 text: invalid start byte) at character 9"


def test_the_schemas_patterns_are_the_checks() -> None:
    """The patterns the OpenAPI schema states accept exactly what the validators accept, on
    every character (a name is one character here; the rules are per character)."""
    checks = {
        TOKEN_PATTERN: lambda v: _accepts(subject_token, v),
        RUN_ID_PATTERN: is_run_id,
        KEY_PATTERN: is_key,
        TASK_ID_PATTERN: lambda v: _accepts(task_id, v),
    }
    for pattern, accepts in checks.items():
        compiled = re.compile(pattern)
        differ = [hex(c) for c in range(sys.maxunicode + 1)
                  if not 0xD800 <= c < 0xE000 and (compiled.fullmatch(chr(c)) is not None) != accepts(chr(c))]
        assert differ == [], f"{pattern} and its check disagree on {differ[:10]}"
    # The gateway's check is the one every producer uses (flywheel.contract.names.is_token): no control characters.
    assert not is_token("\x00") and not _accepts(subject_token, "\x00")


def _accepts(check: Any, value: str) -> bool:
    try:
        check(value)
    except ValueError:
        return False
    return True


# --- reading what the recorder stored -----------------------------------------------------


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
    assert [(s["scorer"], s["value"], s["weight"]) for s in high["scores"]] == [("exact", 0.9, 1.0),
                                                                               ("length", 1.0, 0.5)]
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
                                                 "loss_mask": [True] * 4, "policy_version": 3, "texts": []}
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


async def test_the_schema_states_what_the_server_enforces(client: httpx.AsyncClient) -> None:
    spec = (await client.get("/openapi.json")).json()

    def parameter(path: str, name: str, method: str = "get") -> dict[str, Any]:
        (found,) = [p for p in spec["paths"][path][method]["parameters"] if p["name"] == name]
        schema = found["schema"]
        return next((s for s in schema.get("anyOf", []) if s.get("type") != "null"), schema)

    task_create = spec["components"]["schemas"]["TaskCreate"]["properties"]
    assert (task_create["run"]["pattern"], task_create["run"]["maxLength"]) == (RUN_ID_PATTERN, 128)
    assert (task_create["env"]["pattern"], task_create["env"]["maxLength"]) == (TOKEN_PATTERN, 128)
    assert task_create["id"]["anyOf"][0]["pattern"] == TASK_ID_PATTERN
    assert (task_create["num_rollouts"]["minimum"], task_create["num_rollouts"]["maximum"]) == (1, 4096)
    sampling = spec["components"]["schemas"]["Sampling"]["properties"]
    assert sampling["max_tokens"]["maximum"] == sampling["seed"]["anyOf"][0]["maximum"] == 2**31 - 1
    (_, many) = spec["paths"]["/v1/tasks"]["post"]["requestBody"]["content"]["application/json"]["schema"]["oneOf"]
    assert (many["minItems"], many["maxItems"]) == (1, 10_000)
    (tenant,) = [p for p in spec["paths"]["/v1/tasks"]["post"]["parameters"] if p["name"] == "Flywheel-Tenant"]
    assert tenant["schema"]["pattern"] == KEY_PATTERN
    assert set(spec["paths"]["/v1/tasks"]["post"]["responses"]) >= {"202", "409", "413", "422", "503"}
    for name in ("policy_version", "min_policy_version", "max_policy_version"):
        for path in ("/v1/rollouts", "/v1/rollouts/export"):
            assert (parameter(path, name)["minimum"], parameter(path, name)["maximum"]) == (0, 2**31 - 1)
    assert parameter("/v1/rollouts", "run")["pattern"] == TOKEN_PATTERN
    since = parameter("/v1/runs/{run_id}/metrics", "since_step")
    assert (since["minimum"], since["maximum"]) == (-1, 2**31 - 1)
    assert parameter("/v1/runs/{run_id}", "run_id")["pattern"] == RUN_ID_PATTERN
    assert parameter("/v1/traces/{rollout_id}/stream", "rollout_id")["pattern"] == TOKEN_PATTERN
    assert parameter("/v1/traces/{rollout_id}", "rollout_id")["maxLength"] == 1024
    assert "409" in spec["paths"]["/v1/runs/{run_id}"]["get"]["responses"]
    status = spec["components"]["schemas"]["RunDetail"]["properties"]["status"]["anyOf"][0]["enum"]
    assert {"stopped", "abandoned"} <= set(status)
