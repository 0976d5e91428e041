"""The trace API against a real nats-server: filters, export, the branch view, and the live stream.

The live stream (server-sent events) is read with httpx from a real uvicorn server in this
process, while the test publishes trace nodes and rollouts on the bus as inference does;
that a client leaving ends its consumers is checked on the server and in the gateway's
connection. Other reads go through the ASGI transport, on rows written straight into the
store (SQLite), and once on what the recorder's consumers record from the bus. A nats-server
restart under a live stream is in the slow tier; the gateway process stopping with a stream
open is checked as ``flywheel up`` runs it. Not covered: the store's PostgreSQL side
(tests/unit/test_store.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import sqlalchemy as sa
from fastapi import FastAPI

from flywheel.contract import events
from flywheel.contract.bus import Bus
from flywheel.contract.settings import RecorderSettings
from flywheel.ops.client import ExportCut, GatewayError, TraceAPI, server_sent_events
from flywheel.runtime.natsserver import NatsServer, free_port
from flywheel_gateway import recorder, sse
from flywheel_gateway.store import Store
from tests.helpers import until
from tests.integration.test_gateway_api import unprocessable
from tests.unit.test_store import T0, attempts, conversation, live_nodes, node, rollout, score

# --- filters and pagination ---------------------------------------------------------------


async def ids(client: httpx.AsyncClient, **params: Any) -> list[str]:
    response = await client.get("/v1/rollouts", params=params)
    assert response.status_code == 200, response.text
    return [r["id"] for r in response.json()["items"]]


async def test_error_and_time_filters(client: httpx.AsyncClient, store: Store) -> None:
    def at(rid: str, minutes: int, **kw: Any) -> events.Rollout:
        return msgspec.structs.replace(rollout(rid, **kw), created_at=T0 + timedelta(minutes=minutes))

    failed_score = events.Score(id="s-bad", run="r1", env="math", rollout_id="scorer-failed", group_id="g1",
                                scorer="judge", value=0.0, error="judge timed out", created_at=T0)
    await store.record([at("ok", 0), at("broken", 1, status="error"), at("scorer-failed", 2), failed_score,
                        at("late", 3), score("s1", "ok", 1.0)])
    assert await ids(client, error="true") == ["scorer-failed", "broken"]
    assert await ids(client, error="false") == ["late", "ok"]
    assert await ids(client, created_after="2026-11-01T12:01:00Z", created_before="2026-11-01T12:03:00Z") == [
        "scorer-failed", "broken"]
    assert await ids(client, created_after="2026-11-01T13:02:00+01:00") == ["late", "scorer-failed"]
    assert await ids(client, min_reward=0.0) == ["ok"]  # the failed scorer's 0.0 is no reward
    # A score that arrives after the rollout moves it into a reward range.
    await store.record([score("s2", "late", 0.25)])
    assert await ids(client, min_reward=0.0, max_reward=0.5) == ["late"]


async def test_a_rollout_the_error_filter_keeps_says_why_and_no_other_does(client: httpx.AsyncClient,
                                                                          store: Store) -> None:
    """``error=true`` keeps a rollout inference failed (with a message or without) and one a
    scorer failed on; each of them, and none of the others, has an ``error`` saying why: in
    the listing, the export and the rollout itself."""
    failed_score = events.Score(id="s-bad", run="r1", env="math", rollout_id="scorer-failed", group_id="g1",
                                scorer="judge", value=0.0, error="judge timed out", created_at=T0)
    await store.record([
        rollout("ok"), rollout("broken", status="error"), rollout("scorer-failed"), failed_score,
        msgspec.structs.replace(rollout("message", status="truncated"), error="sandbox lost"),
        score("s1", "ok", 1.0), score("s2", "scorer-failed", 1.0)])

    async def errors(**params: Any) -> dict[str, str | None]:
        listed = (await client.get("/v1/rollouts", params=params)).json()["items"]
        exported = [json.loads(line) for line in (await client.get("/v1/rollouts/export", params=params)).text
                    .splitlines()[:-1]]
        each = {r["id"]: (await client.get(f"/v1/rollouts/{r['id']}")).json()["error"] for r in listed}
        assert {r["id"]: r["error"] for r in listed} == {r["id"]: r["error"] for r in exported} == each
        return each

    assert await errors(error="false") == {"ok": None}
    shown = await errors(error="true")
    assert shown.keys() == {"broken", "scorer-failed", "message"} and all(shown.values()), shown
    assert shown["message"] == "sandbox lost"
    assert "judge" in str(shown["scorer-failed"]) and "judge timed out" in str(shown["scorer-failed"])


async def test_an_environment_is_found_by_its_hub_id_or_its_module_name(client: httpx.AsyncClient,
                                                                       store: Store) -> None:
    """``flywheel/reverse-text`` is the module ``reverse_text`` (its package's entry point): a
    filter by either finds the rollouts of runs configured with either, alone or among several."""
    await store.upsert_runs([
        events.RunState(id="by-module", config={"run": "by-module", "env": "reverse_text"}, created_at=T0),
        events.RunState(id="by-id", config={"run": "by-id", "env": "flywheel/reverse-text"}, created_at=T0),
        events.RunState(id="two", config={"run": "two", "envs": [{"id": "reverse_text"}, {"id": "arithmetic"}]},
                        env_ids={"reverse_text": "reverse_text", "arithmetic": "arithmetic"}, created_at=T0),
        events.RunState(id="other", config={"run": "other", "env": "flywheel/arithmetic@0.1.0"}, created_at=T0)])
    await store.record([rollout("m", run="by-module", env="reverse_text"),
                        rollout("i", run="by-id", env="reverse_text"), rollout("t1", run="two", env="reverse_text"),
                        rollout("t2", run="two", env="arithmetic"), rollout("o", run="other", env="arithmetic")])
    for env in ("flywheel/reverse-text", "reverse_text"):
        assert sorted(await ids(client, env=env)) == ["i", "m", "t1"], env
        exported = (await client.get("/v1/rollouts/export", params={"env": env})).text.splitlines()[:-1]
        assert sorted(json.loads(line)["id"] for line in exported) == ["i", "m", "t1"], env
    assert sorted(await ids(client, env="flywheel/arithmetic")) == ["o", "t2"]
    assert sorted(await ids(client, env="arithmetic")) == ["o", "t2"]
    assert await ids(client, env="flywheel/arithmetic@0.1.0") == ["o"]  # a version: the runs that name it
    # Tasks are recorded under their subject's name (the module): the package's id finds them too.
    await store.record([events.Task(id="task-m", run="by-module", env="reverse_text", data={"text": "ab"})])
    for env in ("flywheel/reverse-text", "reverse_text"):
        tasks = (await client.get("/v1/tasks", params={"env": env})).json()["items"]
        assert [t["id"] for t in tasks] == ["task-m"], env
    assert (await client.get("/v1/tasks", params={"env": "flywheel/arithmetic"})).json()["items"] == []


async def test_bad_parameters_are_refused_naming_them(client: httpx.AsyncClient) -> None:
    async def detail(**params: Any) -> str:
        return await unprocessable(client, "GET", "/v1/rollouts", params=params)

    assert await detail(min_rewrd=0.5) == "min_rewrd: unknown field (check its spelling)"
    assert (await detail(created_after="2026-01-01T00:00:00")).startswith("created_after: input should have timezone")
    assert (await detail(min_reward="nan")).startswith("min_reward: ")
    assert (await detail(error="maybe")).startswith("error: input should be a valid boolean")
    assert await detail(created_after="2026-01-02T00:00:00Z", created_before="2026-01-01T00:00:00Z") == (
        "created_after: is greater than created_before (2026-01-02 00:00:00+00:00 > 2026-01-01 00:00:00+00:00)")
    assert (await detail(limit=5000)).startswith("limit: ")
    assert (await unprocessable(client, "GET", "/v1/rollouts/export", params={"tokens": "yes please"})).startswith(
        "tokens: ")


async def test_pages_under_filters_and_concurrent_inserts(client: httpx.AsyncClient, store: Store) -> None:
    await store.record([rollout(f"ro{i:02}", policy_version=i % 3) for i in range(30)])
    seen: list[str] = []
    params: dict[str, Any] = {"policy_version": 1, "limit": 3}
    while True:
        page = (await client.get("/v1/rollouts", params=params)).json()
        seen += [r["id"] for r in page["items"]]
        if page["next_cursor"] is None:
            break
        params["cursor"] = page["next_cursor"]
        # New rollouts, some matching, recorded between pages: they never shift a page.
        await store.record([rollout(f"new{len(seen)}", policy_version=1)])
    assert seen == [f"ro{i:02}" for i in range(28, -1, -3)]
    other = await unprocessable(client, "GET", "/v1/rollouts", params={"policy_version": 2,
                                                                         "cursor": params["cursor"]})
    assert other.startswith("cursor: cursor ") and "other filters" in other


# --- export -------------------------------------------------------------------------------


async def test_export_streams_jsonl_with_the_same_filters(client: httpx.AsyncClient, store: Store) -> None:
    await store.record([rollout(f"ro{i}", answer=str(i)) for i in range(5)]
                       + [score(f"s{i}", f"ro{i}", i / 4) for i in range(5)])
    response = await client.get("/v1/rollouts/export", params={"min_reward": 0.5, "tokens": "true"})
    assert response.status_code == 200 and response.headers["content-type"] == "application/jsonl"
    *lines, end = [json.loads(line) for line in response.text.splitlines()]
    assert [r["id"] for r in lines] == ["ro4", "ro3", "ro2"] and end == {"end": {"num_rollouts": 3}}
    assert lines[0]["reward"] == 1.0 and lines[0]["scores"] == [
        {"scorer": "exact", "value": 1.0, "weight": 1.0, "components": {}, "error": None}]
    assert lines[0]["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                                    {"role": "assistant", "content": "4"}]
    assert lines[0]["tokens"] == {"token_ids": list(range(1, 10)), "logprobs": [-0.5] * 9,
                                  "loss_mask": [False] * 5 + [True] * 4}
    assert lines[0]["task_data"] == {"q": "2+2"} and lines[0]["metrics"] == {"num_turns": 1.0}
    plain = (await client.get("/v1/rollouts/export", params={"run": "r1"})).text.splitlines()
    assert len(plain) == 6 and "tokens" not in json.loads(plain[0]) and json.loads(plain[-1]) == {
        "end": {"num_rollouts": 5}}
    # Nothing to export is still a complete export: its one line says so.
    assert (await client.get("/v1/rollouts/export", params={"run": "nobody"})).text == '{"end":{"num_rollouts":0}}\n'


@pytest.fixture
def failing_pages(store: Store) -> Iterator[list[int]]:
    """Makes the store's export fail from the page whose number (0 first) is put in the list."""
    fail_from: list[int] = []
    num_pages = 0

    def before_cursor_execute(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        nonlocal num_pages
        if statement.lstrip().startswith("SELECT rollouts.seq"):  # a page of the export
            num_pages += 1
            if fail_from and num_pages > fail_from[0]:
                raise sa.exc.OperationalError(statement, None, OSError("disk I/O error"))

    sa.event.listen(store.engine.sync_engine, "before_cursor_execute", before_cursor_execute)
    try:
        yield fail_from
    finally:
        sa.event.remove(store.engine.sync_engine, "before_cursor_execute", before_cursor_execute)


async def test_an_export_cut_by_the_database_says_so(client: httpx.AsyncClient, store: Store,
                                                     failing_pages: list[int]) -> None:
    await store.record([rollout(f"ro{i:03}") for i in range(150)])  # two pages of 100
    failing_pages.append(1)
    response = await client.get("/v1/rollouts/export")
    assert response.status_code == 200
    *lines, last = [json.loads(line) for line in response.text.splitlines()]
    assert [line["id"] for line in lines] == [f"ro{i:03}" for i in range(149, 49, -1)]
    assert last == {"error": "export cut after 100 rollouts: OSError: disk I/O error; the lines above are complete "
                             "rollouts, the rest is missing: export again"}
    failing_pages[0] = 0  # before the first byte: a proper error status
    down = await client.get("/v1/rollouts/export")
    assert down.status_code == 503 and down.json() == {
        "detail": "the trace store is unavailable (OSError: disk I/O error); retry later"}


async def test_the_python_client_raises_on_a_cut_export(client: httpx.AsyncClient, store: Store,
                                                         failing_pages: list[int], tmp_path: Path) -> None:
    await store.record([rollout(f"ro{i:03}") for i in range(150)])
    failing_pages.append(1)
    api = TraceAPI("http://gateway")
    api.http = client  # the test's app, in process
    with pytest.raises(ExportCut, match=r"cut\.jsonl: the export was cut after 100 rollouts \(the gateway: export "
                                        r"cut after 100 rollouts: OSError: disk I/O error;"):
        await api.export(tmp_path / "cut.jsonl")
    assert len((tmp_path / "cut.jsonl").read_text().splitlines()) == 100  # no end line: the file says it is cut
    failing_pages.clear()
    assert await api.export(tmp_path / "whole.jsonl") == 150
    *lines, end = (tmp_path / "whole.jsonl").read_text().splitlines()  # the end line kept: the file says it is whole
    assert len(lines) == 150 and json.loads(end) == {"end": {"num_rollouts": 150}}
    assert await api.export(tmp_path / "none.jsonl", run="nobody") == 0
    assert (tmp_path / "none.jsonl").read_text() == '{"end":{"num_rollouts":0}}\n'


# --- the branch view ----------------------------------------------------------------------


def branching() -> events.Rollout:
    """system -> user -> assistant (tool call) -> tool -> assistant, and a retry of the
    first answer branching off the user node."""
    system, user, first = conversation("let me check")
    tool = node(first, "tool", "4", [20, 21])
    final = node(tool, "assistant", "4", [22, 23], policy_version=3)
    retry = node(user, "assistant", "four", [30, 31, 32], policy_version=3)
    return msgspec.structs.replace(rollout("ro-branch"), nodes=[system, user, first, tool, final, retry])


async def test_graph_leaves_and_a_branch_with_both_layers(client: httpx.AsyncClient, store: Store) -> None:
    r = branching()
    system, user, first, tool, final, retry = r.nodes
    await store.record([r])
    graph = (await client.get("/v1/traces/ro-branch")).json()
    assert graph["finished"] is True and graph["leaves"] == [final.id, retry.id] and graph["final_leaf"] == retry.id
    branch = (await client.get(f"/v1/traces/ro-branch/branches/{final.id}", params={"tokens": "true"})).json()
    assert branch["complete"] is True
    assert [n["id"] for n in branch["nodes"]] == [system.id, user.id, first.id, tool.id, final.id]
    assert branch["nodes"][3]["tokens"]["token_ids"] == [20, 21]
    assert branch["tokens"]["token_ids"] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 20, 21, 22, 23]
    other = (await client.get(f"/v1/traces/ro-branch/branches/{retry.id}")).json()
    assert [n["message"]["content"] for n in other["nodes"]] == ["be brief", "2+2?", "four"]
    assert other["tokens"] is None and other["nodes"][2]["tokens"] is None
    missing = await client.get("/v1/traces/ro-branch/branches/nope")
    assert missing.status_code == 404 and "node 'nope' is not in the trace" in missing.json()["detail"]
    # Live nodes whose parent has not arrived: an incomplete branch, and the rollout not finished.
    await store.record([events.TraceNode(run="r1", rollout_id="ro-live", node=tool)])
    live = (await client.get(f"/v1/traces/ro-live/branches/{tool.id}")).json()
    assert live["complete"] is False and [n["id"] for n in live["nodes"]] == [tool.id]
    assert {k: v for k, v in (await client.get("/v1/traces/ro-live")).json().items() if k in ("finished", "final_leaf")
            } == {"finished": False, "final_leaf": None}


async def test_each_token_comes_with_its_text(client: httpx.AsyncClient, store: Store) -> None:
    """The token layer the trace page draws carries each token's text as inference decoded it,
    aligned with the ids; model output is data here, whatever it looks like."""
    texts = [["<|im_start|>", "user", "\n"], ["<img src=x onerror=alert(1)>", " 2+2?"], ["4", "<|im_end|>"]]
    nodes: list[events.Node] = []
    for (role, content), pieces in zip([("system", "be brief"), ("user", "2+2?"), ("assistant", "4")], texts,
                                       strict=True):
        message = events.Message(role=role, content=content)  # type: ignore[arg-type]  # the roles above
        ids = list(range(10 * len(nodes), 10 * len(nodes) + len(pieces)))
        tokens = events.TokenSpan(token_ids=ids, logprobs=[-0.5] * len(ids), loss_mask=[role == "assistant"] * len(ids),
                                  texts=pieces)
        parent = nodes[-1].id if nodes else None
        nodes.append(events.Node(id=events.node_id(parent, message, tokens), parent_id=parent, message=message,
                                 tokens=tokens))
    await store.record([msgspec.structs.replace(rollout("ro-texts"), nodes=nodes)])
    branch = (await client.get(f"/v1/traces/ro-texts/branches/{nodes[-1].id}", params={"tokens": "true"})).json()
    assert [n["tokens"]["texts"] for n in branch["nodes"]] == texts
    assert [len(n["tokens"]["token_ids"]) for n in branch["nodes"]] == [3, 2, 2]
    graph = (await client.get("/v1/traces/ro-texts", params={"tokens": "true"})).json()
    assert [n["tokens"]["texts"] for n in graph["nodes"]] == texts
    assert all(n["tokens"] is None for n in (await client.get("/v1/traces/ro-texts")).json()["nodes"])


# --- the live stream ----------------------------------------------------------------------


def message(role: str, content: str) -> dict[str, Any]:
    return {"role": role, "content": content, "tool_calls": [], "tool_call_id": None, "name": None}


def span(token_ids: list[int], loss: bool, policy_version: int | None = None) -> dict[str, Any]:
    return {"token_ids": token_ids, "logprobs": [-0.5] * len(token_ids), "loss_mask": [loss] * len(token_ids),
            "policy_version": policy_version, "texts": []}


def live(rid: str, n: events.Node, run: str = "r1") -> events.TraceNode:
    return events.TraceNode(run=run, rollout_id=rid, node=n)


async def test_stream_replays_then_follows_then_ends_with_the_rollout(app: FastAPI, gateway_url: str) -> None:
    bus: Bus = app.state.bus
    system, user, answer = conversation("4")
    await bus.publish_many([live("ro1", system), live("ro1", user), live("ro-other", system)], events.MSGPACK)
    async with httpx.AsyncClient(base_url=gateway_url, timeout=10) as http, \
            http.stream("GET", "/v1/traces/ro1/stream", params={"tokens": "true"}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        received = server_sent_events(response)
        assert [await anext(received) for _ in range(2)] == [
            ("node", {"id": system.id, "parent_id": None, "position": 0, "message": message("system", "be brief"),
                      "tokens": span([1, 2], False)}),
            ("node", {"id": user.id, "parent_id": system.id, "position": 1, "message": message("user", "2+2?"),
                      "tokens": span([3, 4, 5], False)}),
        ]
        await bus.publish(live("ro1", answer), events.MSGPACK)
        name, data = await anext(received)
        assert (name, data["id"], data["position"], data["tokens"]["policy_version"]) == ("node", answer.id, 2, 3)
        # Another rollout of the run landing does not end this stream; this one's does.
        await bus.publish(rollout("ro-other", answer="5"), events.MSGPACK)
        await bus.publish(rollout("ro1", status="truncated"), events.MSGPACK)
        rest = [item async for item in received]
    assert [name for name, _ in rest] == ["rollout"]
    assert {k: rest[0][1][k] for k in ("id", "status", "num_tokens", "reward")} == {
        "id": "ro1", "status": "truncated", "num_tokens": 9, "reward": None}


async def test_a_message_that_does_not_decode_is_skipped(app: FastAPI, gateway_url: str) -> None:
    bus: Bus = app.state.bus
    system, user, answer = conversation("4")
    await bus.publish(live("ro1", system))
    await bus.publish_raw("traces.r1.ro1", b"\x00 not an event", {"Nats-Msg-Id": "garbage"})
    stray = live("ro-other", user)  # another rollout's node, published on this rollout's subject
    await bus.publish_raw("traces.r1.ro1", events.encode(stray), {"Nats-Msg-Id": "stray"})
    async with httpx.AsyncClient(base_url=gateway_url, timeout=10) as http, \
            http.stream("GET", "/v1/traces/ro1/stream") as response:
        received = server_sent_events(response)
        assert (await anext(received))[1]["id"] == system.id
        await bus.publish_many([live("ro1", user), live("ro1", answer)])
        await bus.publish(rollout("ro1"))
        rest = [(name, data["id"]) async for name, data in received]
    assert rest == [("node", user.id), ("node", answer.id), ("rollout", "ro1")]


async def test_a_rollout_that_landed_before_the_client_came(app: FastAPI, gateway_url: str) -> None:
    """On the bus but not recorded yet (the recorder lags): the stream still ends."""
    bus: Bus = app.state.bus
    nodes = conversation("4")
    await bus.publish_many([live("ro1", n) for n in nodes[:2]])  # the answer never went out live
    await bus.publish(rollout("ro1"))
    async with httpx.AsyncClient(base_url=gateway_url, timeout=10) as http, \
            http.stream("GET", "/v1/traces/ro1/stream") as response:
        received = [item async for item in server_sent_events(response)]
    assert [(name, data["id"]) for name, data in received] == [
        ("node", nodes[0].id), ("node", nodes[1].id), ("node", nodes[2].id), ("rollout", "ro1")]
    assert received[2][1]["tokens"] is None  # the token layer only on request


async def test_a_recorded_rollout_is_replayed_from_the_store(app: FastAPI, gateway_url: str, store: Store) -> None:
    await store.record([rollout("ro1"), score("s1", "ro1", 0.75)])  # nothing of it on the bus
    async with httpx.AsyncClient(base_url=gateway_url, timeout=10) as http, \
            http.stream("GET", "/v1/traces/ro1/stream", params={"tokens": "true"}) as response:
        received = [item async for item in server_sent_events(response)]
    assert [name for name, _ in received] == ["node", "node", "node", "rollout"]
    assert received[2][1]["tokens"] == span([6, 7, 8, 9], True, policy_version=3)
    assert received[3][1]["reward"] == 0.75


async def test_unknown_and_bad_rollout_ids(client: httpx.AsyncClient) -> None:
    missing = await client.get("/v1/traces/nope/stream")
    assert missing.status_code == 404 and "no trace of rollout 'nope'" in missing.json()["detail"]
    assert (await unprocessable(client, "GET", "/v1/traces/a*b/stream")).startswith("rollout_id: ")


@pytest.mark.long
async def test_a_client_that_leaves_ends_its_consumers(app: FastAPI, gateway_url: str) -> None:
    bus: Bus = app.state.bus
    system, user, _ = conversation("4")
    await bus.publish_many([live("ro1", system), live("ro1", user)])
    baseline = len(bus.nc._subs)

    async def num_consumers() -> int:
        return len(await bus.js.consumers_info("TRACES")) + len(await bus.js.consumers_info("ROLLOUTS"))

    async with httpx.AsyncClient(base_url=gateway_url, timeout=10) as http:
        for _ in range(2):  # twice: what the first left would show in the second
            async with http.stream("GET", "/v1/traces/ro1/stream") as response:
                received = server_sent_events(response)
                assert (await anext(received))[0] == "node"
                assert await num_consumers() == 2 and len(bus.nc._subs) == baseline + 2
            # Leaving mid-stream (the rollout never lands) closes the connection.

            async def released() -> bool:
                return await num_consumers() == 0 and len(bus.nc._subs) == baseline

            await until(released, timeout_s=10, what="the stream's consumers to be deleted")


# --- the Python client --------------------------------------------------------------------


async def test_client_reads_filters_exports_and_follows(app: FastAPI, gateway_url: str, store: Store,
                                                       tmp_path: Path) -> None:
    await store.record([rollout(f"ro{i}", answer=str(i)) for i in range(7)] + [score("s1", "ro3", 1.0)])
    async with TraceAPI(gateway_url) as api:
        assert [r["id"] async for r in api.rollouts(page_size=2)] == [f"ro{i}" for i in range(6, -1, -1)]
        assert [r["id"] async for r in api.rollouts(min_reward=0.5, error=False)] == ["ro3"]
        assert [r["id"] async for r in api.rollouts(created_after=T0, created_before=T0)] == []
        with pytest.raises(ValueError, match="give a time zone"):
            await anext(api.rollouts(created_after=datetime(2026, 1, 1)))
        with pytest.raises(GatewayError, match="min_rewrd: unknown field"):
            await anext(api.rollouts(min_rewrd=1))
        assert await api.export(tmp_path / "sft.jsonl", tokens=True, min_reward=1) == 1
        (line, end) = (tmp_path / "sft.jsonl").read_text().splitlines()
        assert json.loads(line)["messages"][-1] == {"role": "assistant", "content": "3"}
        assert json.loads(end) == {"end": {"num_rollouts": 1}}
        trace = await api.trace("ro3")
        branch = await api.branch("ro3", trace["leaves"][0], tokens=True)
        assert len(branch["tokens"]["token_ids"]) == 9
        with pytest.raises(GatewayError, match="404: no trace recorded for rollout 'nope'"):
            await api.trace("nope")
        followed = [(event, data["id"]) async for event, data in api.follow("ro3")]
        assert followed == [("node", n["id"]) for n in trace["nodes"]] + [("rollout", "ro3")]


async def test_a_quiet_stream_sends_keepalives(app: FastAPI, gateway_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sse, "KEEPALIVE_S", 0.05)
    await app.state.bus.publish(live("ro1", conversation("4")[0]))
    async with httpx.AsyncClient(base_url=gateway_url, timeout=10) as http, \
            http.stream("GET", "/v1/traces/ro1/stream") as response:
        lines = response.aiter_lines()
        assert (await anext(lines)).startswith("event: node")
        assert [await anext(lines) for _ in range(4)][2:] == [": keepalive", ""]


@pytest.mark.slow
async def test_the_stream_survives_a_nats_server_restart(app: FastAPI, gateway_url: str,
                                                         nats_server: NatsServer) -> None:
    """The ordered consumers are recreated where they left off (after two missed heartbeats)."""
    bus: Bus = app.state.bus
    system, user, answer = conversation("4")
    await bus.publish(live("ro1", system))
    async with httpx.AsyncClient(base_url=gateway_url, timeout=60) as http, \
            http.stream("GET", "/v1/traces/ro1/stream") as response:
        received = server_sent_events(response)
        assert (await anext(received))[1]["id"] == system.id
        nats_server.stop()
        nats_server.start()
        # One at a time: publish waits out the reconnection (publish_many issued during one does not return).
        for event in (live("ro1", user), live("ro1", answer), rollout("ro1")):
            await bus.publish(event)
        rest = [(name, data["id"]) async for name, data in received]
    assert rest == [("node", user.id), ("node", answer.id), ("rollout", "ro1")]


# --- through the recorder -----------------------------------------------------------------


async def test_filters_follow_what_the_recorder_records(app: FastAPI, client: httpx.AsyncClient, store: Store) -> None:
    """Events on the bus, recorded by the recorder's consumers: a late score moves a rollout
    into a reward range, a failed one moves it out and into the errors."""
    bus: Bus = app.state.bus
    consumers = recorder.build(bus, store, RecorderSettings(), streams=("ROLLOUTS", "TRACES", "SCORES"))
    running = [asyncio.ensure_future(c.run()) for c in consumers]
    try:
        async def listed(**params: Any) -> list[str]:
            return await ids(client, **params)

        async def until_listed(expected: list[str], **params: Any) -> None:
            async def matches() -> bool:
                return await listed(**params) == expected
            await until(matches, what=f"/v1/rollouts?{params} to list {expected}")

        system, user, _answer = conversation("4")
        await bus.publish_many([live("ro1", system), live("ro1", user)], events.MSGPACK)

        async def two_live_nodes() -> bool:
            trace = await client.get("/v1/traces/ro1")
            return trace.status_code == 200 and len(trace.json()["nodes"]) == 2

        await until(two_live_nodes, what="the live nodes to be recorded")
        assert (await client.get("/v1/traces/ro1")).json()["finished"] is False
        await bus.publish(rollout("ro1"), events.MSGPACK)
        await until_listed(["ro1"], error="false")
        assert await listed(min_reward=0.5) == []
        await bus.publish(score("s1", "ro1", 0.75))
        await until_listed(["ro1"], min_reward=0.5, max_reward=0.75)
        failed = events.Score(id="s2", run="r1", env="math", rollout_id="ro1", group_id="g1", scorer="judge",
                              value=0.0, error="judge timed out")
        await bus.publish(failed)
        await until_listed(["ro1"], error="true")
        assert await listed(min_reward=0.5) == [] and await listed(max_reward=0.5) == []
        (line, _end) = (await client.get("/v1/rollouts/export", params={"run": "r1"})).text.splitlines()
        assert json.loads(line)["reward"] is None and len(json.loads(line)["scores"]) == 2
    finally:
        for c in consumers:
            c.stop()
        await asyncio.gather(*running)


async def test_a_teachers_signal_on_the_bus_shows_beside_the_token_layer(app: FastAPI, client: httpx.AsyncClient,
                                                                           store: Store) -> None:
    """A signal on SIGNALS, recorded by the recorder's consumer: ``?tokens=true`` gives the
    teacher's values by node beside the token layer; without tokens there are none."""
    bus: Bus = app.state.bus
    r = rollout("ro1")
    answer = r.nodes[-1]
    assert answer.tokens is not None
    signal = events.Signal(id="ro1.expert", run=r.run, env=r.env, rollout_id="ro1", group_id=r.group_id,
                           source="expert", values={answer.id: [-0.5] * len(answer.tokens.token_ids)},
                           temperature=1.0, model="teacher-model")
    consumers = recorder.build(bus, store, RecorderSettings(), streams=("ROLLOUTS", "SIGNALS"))
    running = [asyncio.ensure_future(c.run()) for c in consumers]
    try:
        await bus.publish_many([signal, r], events.MSGPACK)

        async def recorded() -> bool:
            trace = await client.get("/v1/traces/ro1", params={"tokens": "true"})
            return trace.status_code == 200 and bool(trace.json()["signals"])

        await until(recorded, what="the rollout and its signal to be recorded")
    finally:
        for c in consumers:
            c.stop()
        await asyncio.gather(*running)
    trace = (await client.get("/v1/traces/ro1", params={"tokens": "true"})).json()
    assert trace["signals"] == [{"source": "expert", "model": "teacher-model", "temperature": 1.0,
                                 "values": {answer.id: [-0.5] * len(answer.tokens.token_ids)}, "error": None}]
    assert (await client.get("/v1/traces/ro1")).json()["signals"] is None


async def test_a_rollout_rolled_out_again_shows_only_its_published_attempt(app: FastAPI, client: httpx.AsyncClient,
                                                                          store: Store) -> None:
    """Inference killed mid-rollout: the redelivered task's second attempt publishes the
    rollout; the first attempt's live nodes were recorded (or arrive late) and must not
    show once the rollout is recorded."""
    bus: Bus = app.state.bus
    abandoned, published = attempts()
    answer = published[-1]
    consumers = {c.stream: c for c in recorder.build(bus, store, RecorderSettings(), streams=("ROLLOUTS", "TRACES"))}
    running = [asyncio.ensure_future(c.run()) for c in consumers.values()]
    try:
        # ro1: everything live first, then the rollout; ro2: the rollout first, its phantoms late.
        await bus.publish_many(live_nodes("ro1", abandoned + published))

        async def both_attempts_live() -> bool:
            return len((await client.get("/v1/traces/ro1")).json().get("nodes", [])) == 5

        await until(both_attempts_live, what="both attempts' live nodes to be recorded")
        before = (await client.get("/v1/traces/ro1")).json()
        assert before["finished"] is False and before["final_leaf"] is None and len(before["leaves"]) == 2
        await bus.publish(rollout("ro1"))
        await store.record([rollout("ro2")])
        await bus.publish_many(live_nodes("ro2", abandoned + published))

        async def recorded() -> bool:
            infos = [await bus.js.consumer_info(c.stream, c.durable) for c in consumers.values()]
            return (await client.get("/v1/traces/ro1")).json()["finished"] and all(
                i.num_pending == 0 and i.num_ack_pending == 0 for i in infos)

        await until(recorded, what="the recorder to take in everything")
    finally:
        for c in consumers.values():
            c.stop()
        await asyncio.gather(*running)
    for rollout_id in ("ro1", "ro2"):
        trace = (await client.get(f"/v1/traces/{rollout_id}")).json()
        assert [n["id"] for n in trace["nodes"]] == [n.id for n in published]
        assert trace["final_leaf"] == answer.id and trace["leaves"] == [answer.id] and trace["finished"] is True
        phantom = abandoned[-1].id
        assert (await client.get(f"/v1/traces/{rollout_id}/branches/{phantom}")).status_code == 404
    (line, *_) = (await client.get("/v1/rollouts/export")).text.splitlines()
    assert json.loads(line)["messages"][-1] == {"role": "assistant", "content": "4"}


# --- the gateway process ------------------------------------------------------------------


@pytest.mark.long
async def test_an_open_stream_does_not_hold_up_the_gateways_shutdown(nats_server: NatsServer, bus: Bus,
                                                                     tmp_path: Path) -> None:
    """``python -m flywheel_gateway api`` as ``flywheel up`` runs it: SIGTERM with a live stream open."""
    from flywheel.contract.settings import Settings
    from flywheel.ops.stack import SERVICES
    from flywheel.runtime.supervise import ServiceProcess, child_env
    from flywheel_gateway.__main__ import GRACEFUL_SHUTDOWN_S

    settings = Settings(nats_url=nats_server.url, data_dir=tmp_path / "data", gateway_port=free_port())
    api = ServiceProcess("gateway", SERVICES["gateway"], child_env(settings), tmp_path / "gateway.log")
    await api.launch()
    try:
        await bus.publish(live("ro1", conversation("4")[0]))
        async with httpx.AsyncClient(base_url=settings.resolved_gateway_url, timeout=30) as http:
            async def healthy() -> bool:
                try:
                    return (await http.get("/healthz")).status_code == 200
                except httpx.TransportError:
                    return False

            await until(healthy, timeout_s=60, what="the API to answer /healthz")
            async with http.stream("GET", "/v1/traces/ro1/stream") as response:
                received = server_sent_events(response)  # held: the stream stays open while the gateway stops
                assert (await anext(received))[0] == "node"
                os.kill(api.pid, signal.SIGTERM)
                assert api.popen is not None
                returncode = await asyncio.to_thread(api.popen.wait, GRACEFUL_SHUTDOWN_S + 10)
                assert "graceful shutdown exceeded" in api.log_path.read_text(), api.log_tail()
        assert returncode in (0, -signal.SIGTERM), api.log_tail()
    finally:
        await api.stop(10)


class _KillAfterFirstChunk(httpx.AsyncByteStream):
    """An answer's body that runs ``kill`` once its first chunk has been handed on: the gateway
    dies mid-stream (as under the OOM killer) while the client is between two reads."""

    def __init__(self, stream: httpx.AsyncByteStream, kill: Callable[[], Awaitable[None]]) -> None:
        self.stream, self.kill = stream, kill

    async def __aiter__(self) -> AsyncIterator[bytes]:
        killed = False
        async for chunk in self.stream:
            yield chunk
            if not killed:
                killed = True
                await self.kill()

    async def aclose(self) -> None:
        await self.stream.aclose()


async def test_an_export_cut_by_a_killed_gateway_is_reported_as_cut(nats_server: NatsServer, tmp_path: Path) -> None:
    """``python -m flywheel_gateway api`` SIGKILLed after the export's first chunk: no error line
    is written, and the client still reports the export as cut (its end line never came).

    Each rollout's answer is long (3 pages of 100 rollouts, about 6 MB) and the client's socket
    buffer small, so the gateway is still writing when it dies, not done with everything in the
    kernel's buffers (what it had written there still arrives)."""
    from flywheel.contract.settings import Settings
    from flywheel.ops.stack import SERVICES
    from flywheel.runtime.supervise import ServiceProcess, child_env
    from flywheel_gateway.migrate import migrate

    settings = Settings(nats_url=nats_server.url, data_dir=tmp_path / "data", gateway_port=free_port())
    await migrate(settings.resolved_database_url)
    store = Store.open(settings.resolved_database_url)
    try:
        await store.record([rollout(f"ro{i:03}", answer="x" * 20_000) for i in range(300)])
    finally:
        await store.close()
    api = ServiceProcess("gateway", SERVICES["gateway"], child_env(settings), tmp_path / "gateway.log")
    await api.launch()

    async def kill() -> None:
        os.kill(api.pid, signal.SIGKILL)
        assert api.popen is not None
        await asyncio.to_thread(api.popen.wait, 10)

    class Transport(httpx.AsyncHTTPTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            response = await super().handle_async_request(request)
            if request.url.path != "/v1/rollouts/export":
                return response
            assert isinstance(response.stream, httpx.AsyncByteStream)
            return httpx.Response(response.status_code, headers=response.headers,
                                  stream=_KillAfterFirstChunk(response.stream, kill), extensions=response.extensions)

    try:
        async with TraceAPI(settings.resolved_gateway_url) as trace_api:
            await trace_api.http.aclose()
            trace_api.http = httpx.AsyncClient(base_url=settings.resolved_gateway_url, timeout=30, transport=Transport(
                socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)]))

            async def healthy() -> bool:
                try:
                    return (await trace_api.http.get("/healthz")).status_code == 200
                except httpx.TransportError:
                    return False

            await until(healthy, timeout_s=60, what="the API to answer /healthz")
            with pytest.raises(ExportCut, match=r"cut\.jsonl: the export was cut after \d+ rollouts \(the answer broke "
                                                r"off without the end line") as cut:
                await trace_api.export(tmp_path / "cut.jsonl")
        assert api.returncode() == -signal.SIGKILL
        lines = (tmp_path / "cut.jsonl").read_text().splitlines()
        assert 0 < cut.value.num_rollouts == len(lines) < 300
        assert all("id" in json.loads(line) for line in lines)  # no end line: the file itself says it is cut
    finally:
        await api.stop(10)
