"""``/v1/runs`` in process (httpx + ASGI) against a real nats-server and SQLite.

As in test_gateway_api.py, reads are checked on rows written straight into the store and on
run states put into the run-state bucket; one test runs the recorder's WEIGHTS consumer to
show that the trainer's weight updates become the run's metrics.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import httpx
import msgspec
import pytest
from fastapi import FastAPI

from flywheel.contract import events, runs
from flywheel.contract.config import RunConfig
from flywheel.contract.settings import RecorderSettings
from flywheel.ops.client import server_sent_events
from flywheel_gateway import api_runs, recorder
from flywheel_gateway.store import Store
from tests.helpers import until
from tests.integration.test_gateway_api import unprocessable
from tests.unit.test_store import rollout, score, task, weight_update


async def put_state(app: FastAPI, state: events.RunState) -> None:
    await (await app.state.bus.runs_kv()).put(state.id, events.encode(state))


async def get(client: httpx.AsyncClient, url: str, **params: Any) -> Any:
    response = await client.get(url, params=params)
    assert response.status_code == 200, response.text
    return response.json()


async def test_run_detail_joins_the_store_and_the_run_state(app: FastAPI, client: httpx.AsyncClient,
                                                            store: Store) -> None:
    response = await client.post("/v1/tasks", json={"run": "r1", "env": "math", "data": {}},
                                 headers={"Flywheel-Tenant": "acme"})
    assert response.status_code == 202, response.text
    await store.record([task(1), task(2), rollout("ro1"), rollout("ro2"), score("s1", "ro1", 1.0),
                        weight_update("r1", 0, {"reward_mean": 0.5}), weight_update("r1", 1, {"reward_mean": 0.75})])
    created = (await get(client, "/v1/runs/r1"))
    assert created["tenant"] == "acme" and created["status"] == "created" and created["config"] == {}
    config = RunConfig(run="r1", env="math", tenant="acme").model_dump()
    await put_state(app, events.RunState(id="r1", tenant="acme", status="running", config=config))
    detail = await get(client, "/v1/runs/r1")
    assert detail == {**created, "status": "running", "config": config}
    assert {k: detail[k] for k in ("id", "kind", "latest_step", "latest_version", "reward_mean", "num_tasks",
                                   "num_rollouts", "num_scored_rollouts")} == {
        "id": "r1", "kind": "train", "latest_step": 1, "latest_version": 2, "reward_mean": 0.75, "num_tasks": 2,
        "num_rollouts": 2, "num_scored_rollouts": 1}
    # Recorded before its run state was written (an event first): the bucket's tenant wins.
    await store.record([task(3, run="r2")])
    await put_state(app, events.RunState(id="r2", tenant="beta", kind="eval"))
    assert {k: v for k, v in (await get(client, "/v1/runs/r2")).items() if k in ("tenant", "kind", "num_tasks")} == {
        "tenant": "beta", "kind": "eval", "num_tasks": 1}


async def test_run_detail_shows_how_a_run_ended(app: FastAPI, client: httpx.AsyncClient) -> None:
    now = events.utc_now()
    lease = now + timedelta(seconds=60)
    await put_state(app, events.RunState(id="live", status="running", owner="flywheel-run pid 7 on box",
                                         lease_expires_at=lease))
    live = await get(client, "/v1/runs/live")
    assert {k: live[k] for k in ("status", "ended_at", "reason", "owner", "lease_expires_at")} == {
        "status": "running", "ended_at": None, "reason": None, "owner": "flywheel-run pid 7 on box",
        "lease_expires_at": lease.isoformat().replace("+00:00", "Z")}
    # Its owner was killed: the lease ran out while the bucket still says running.
    expired = now - timedelta(seconds=5)
    await put_state(app, events.RunState(id="live", status="running", owner="flywheel-run pid 7 on box",
                                         lease_expires_at=expired))
    abandoned = await get(client, "/v1/runs/live")
    assert abandoned["status"] == "abandoned" and abandoned["ended_at"] == expired.isoformat().replace("+00:00", "Z")
    assert abandoned["reason"].startswith("run 'live' is abandoned: flywheel-run pid 7 on box stopped renewing its "
                                          "lease")
    await put_state(app, events.RunState(id="halted", status="stopped", ended_at=now, reason="stopped by the user"))
    halted = await get(client, "/v1/runs/halted")
    assert (halted["status"], halted["ended_at"], halted["reason"]) == (
        "stopped", now.isoformat().replace("+00:00", "Z"),
        f"run 'halted' stopped at {now.isoformat()} (stopped by the user)")


async def test_a_run_is_stopped_over_http_by_its_tenant_only(app: FastAPI, client: httpx.AsyncClient) -> None:
    await put_state(app, events.RunState(id="team/long", tenant="acme", status="running", trainer_step=7,
                                         owner="flywheel-run pid 7 on box",
                                         lease_expires_at=events.utc_now() + timedelta(seconds=60)))
    other = await client.post("/v1/runs/team/long/stop", headers={"Flywheel-Tenant": "beta"})
    assert other.status_code == 409 and "belongs to tenant 'acme', not 'beta'" in other.json()["detail"]
    assert (await get(client, "/v1/runs/team/long"))["status"] == "running"  # untouched
    stopped = await client.post("/v1/runs/team/long/stop", headers={"Flywheel-Tenant": "acme"})
    assert stopped.status_code == 200, stopped.text
    detail = stopped.json()
    assert detail["status"] == "stopped" and detail["ended_at"] is not None
    assert "stopped by the gateway's API (tenant 'acme') at step 7" in detail["reason"]
    again = await client.post("/v1/runs/team/long/stop", headers={"Flywheel-Tenant": "acme"})
    assert again.status_code == 200 and again.json()["reason"] == detail["reason"]  # ended already: left as it is
    missing = await client.post("/v1/runs/nope/stop")
    assert missing.status_code == 404 and missing.json()["detail"].startswith("run 'nope' not found")


async def test_a_stopped_run_is_resumed_over_http(app: FastAPI, client: httpx.AsyncClient) -> None:
    config = RunConfig(run="halted", env="reverse_text", tenant="acme").model_dump()
    await put_state(app, events.RunState(id="halted", tenant="acme", status="stopped", trainer_step=3, config=config,
                                         ended_at=events.utc_now(), reason="stopped by the user at step 3"))
    other = await client.post("/v1/runs/halted/resume", headers={"Flywheel-Tenant": "beta"})
    assert other.status_code == 409 and "belongs to tenant 'acme'" in other.json()["detail"]
    resumed = await client.post("/v1/runs/halted/resume", headers={"Flywheel-Tenant": "acme"})
    assert resumed.status_code == 200, resumed.text
    detail = resumed.json()
    assert (detail["status"], detail["ended_at"], detail["reason"], detail["owner"]) == ("running", None, None, None)
    # Claimable now (an orchestrator takes it); a second resume finds it running.
    again = await client.post("/v1/runs/halted/resume", headers={"Flywheel-Tenant": "acme"})
    assert again.status_code == 409 and "is still running" in again.json()["detail"]
    await put_state(app, events.RunState(id="done", status="finished", config=config))
    finished = await client.post("/v1/runs/done/resume")
    assert finished.status_code == 409 and "finished already" in finished.json()["detail"]
    missing = await client.post("/v1/runs/nope/resume")
    assert missing.status_code == 404


async def test_runs_known_to_one_source_only_and_unknown_runs(app: FastAPI, client: httpx.AsyncClient,
                                                              store: Store) -> None:
    await put_state(app, events.RunState(id="fresh", tenant="acme"))
    fresh = await get(client, "/v1/runs/fresh")
    assert (fresh["tenant"], fresh["status"], fresh["num_rollouts"], fresh["latest_step"]) == (
        "acme", "created", 0, None)
    assert (await get(client, "/v1/runs/fresh/metrics")) == {"run": "fresh", "items": []}
    await store.record([rollout("ro1", run="recorded")])  # published straight to the bus: no run state
    recorded = await get(client, "/v1/runs/recorded")
    assert (recorded["status"], recorded["config"], recorded["num_rollouts"]) == (None, None, 1)
    for url in ("/v1/runs/nope", "/v1/runs/nope/metrics"):
        missing = await client.get(url)
        assert missing.status_code == 404 and missing.json()["detail"].startswith("run 'nope' not found")
    refused = await unprocessable(client, "GET", "/v1/runs/a b")
    assert refused.startswith("run_id: a run id is 1 to 128 letters, digits")


async def test_run_listing(client: httpx.AsyncClient, store: Store) -> None:
    await store.record([task(1, run="r1"), task(2, run="r2"), task(3, run="r3")])
    first = await get(client, "/v1/runs", limit=2)
    rest = await get(client, "/v1/runs", limit=2, cursor=first["next_cursor"])
    # A run recorded from its events is created at its first event's time.
    assert [r["id"] for r in first["items"] + rest["items"]] == ["r3", "r2", "r1"] and rest["next_cursor"] is None
    assert first["items"][0] == {"id": "r3", "tenant": "default", "kind": "train", "created_at": "2026-11-01T12:00:03Z",
                                 "env": None}
    assert (await get(client, "/v1/runs", tenant="acme"))["items"] == []
    assert (await unprocessable(client, "GET", "/v1/runs", params={"cursor": "zz"})).startswith("cursor: cursor 'zz'")


async def test_metrics_are_polled_by_step_and_ids_may_hold_slashes(client: httpx.AsyncClient, store: Store) -> None:
    await store.record([weight_update("team/a", i, {"loss": 1.0 - i / 10}) for i in range(5)])
    all_steps = await get(client, "/v1/runs/team/a/metrics")
    assert all_steps["run"] == "team/a" and [s["step"] for s in all_steps["items"]] == [0, 1, 2, 3, 4]
    assert all_steps["items"][1] == {"step": 1, "version": 2, "metrics": {"loss": 0.9},
                                     "created_at": "2026-11-01T12:01:00Z"}
    polled = await get(client, "/v1/runs/team/a/metrics", since_step=2, limit=1)
    assert [s["step"] for s in polled["items"]] == [3]
    assert (await get(client, "/v1/runs/team/a/metrics", since_step=4))["items"] == []
    assert (await get(client, "/v1/runs/team/a"))["latest_step"] == 4
    detail = await unprocessable(client, "GET", "/v1/runs/team/a/metrics", params={"limit": 0})
    assert detail.startswith("limit: input should be greater than or equal to 1")


async def test_the_recorder_turns_weight_updates_into_metrics(app: FastAPI, client: httpx.AsyncClient,
                                                              store: Store) -> None:
    bus = app.state.bus
    (consumer,) = recorder.build(bus, store, RecorderSettings(), streams=("WEIGHTS",))
    running = asyncio.ensure_future(consumer.run())
    try:
        updates = [weight_update("r1", i, {"reward_mean": i / 4, "loss": 2.0}) for i in range(3)]
        await bus.publish_many(updates + updates[:1])

        async def recorded() -> bool:
            response = await client.get("/v1/runs/r1/metrics")  # 404 until the first one is recorded
            return response.status_code == 200 and len(response.json()["items"]) == 3

        await until(recorded, what="three steps of metrics")
    finally:
        consumer.stop()
        await running
    assert (await get(client, "/v1/runs/r1"))["reward_mean"] == 0.5


async def test_runs_are_documented(client: httpx.AsyncClient) -> None:
    spec = await get(client, "/openapi.json")
    assert {"/v1/runs", "/v1/runs/{run_id}", "/v1/runs/{run_id}/metrics", "/v1/runs/{run_id}/stop",
            "/v1/runs/{run_id}/resume"} <= set(
        spec["paths"])


async def test_the_recorder_mirrors_runs_registered_anywhere(app: FastAPI, client: httpx.AsyncClient,
                                                             store: Store) -> None:
    from flywheel_gateway.recorder import mirror_runs

    await put_state(app, events.RunState(id="by-cli", tenant="acme", kind="eval"))
    stopping = asyncio.Event()
    mirroring = asyncio.ensure_future(mirror_runs(app.state.bus, store, stopping))
    try:
        await put_state(app, events.RunState(id="by-flywheel-run", tenant="beta"))

        async def listed() -> bool:
            page = await get(client, "/v1/runs")
            return {(r["id"], r["tenant"]) for r in page["items"]} >= {("by-cli", "acme"), ("by-flywheel-run", "beta")}

        await until(listed, what="both runs in the store with their tenants")
    finally:
        stopping.set()
        await mirroring
    assert [r["id"] for r in (await get(client, "/v1/runs", tenant="acme"))["items"]] == ["by-cli"]


async def test_a_run_is_paused_and_resumed_over_http(app: FastAPI, client: httpx.AsyncClient) -> None:
    config = RunConfig(run="held", env="reverse_text", tenant="acme").model_dump()
    await put_state(app, events.RunState(id="held", tenant="acme", status="running", trainer_step=4, config=config,
                                         owner="orchestrator 1",
                                         lease_expires_at=events.utc_now() + timedelta(seconds=60)))
    other = await client.post("/v1/runs/held/pause", headers={"Flywheel-Tenant": "beta"})
    assert other.status_code == 409 and "belongs to tenant 'acme'" in other.json()["detail"]
    paused = await client.post("/v1/runs/held/pause", headers={"Flywheel-Tenant": "acme"})
    assert paused.status_code == 200, paused.text
    assert (paused.json()["status"], paused.json()["owner"]) == ("paused", "orchestrator 1")
    assert "paused by the gateway's API (tenant 'acme') at step 4" in paused.json()["reason"]
    resumed = await client.post("/v1/runs/held/resume", headers={"Flywheel-Tenant": "acme"})
    assert resumed.status_code == 200, resumed.text
    assert (resumed.json()["status"], resumed.json()["owner"]) == ("running", "orchestrator 1")  # with its owner
    await put_state(app, events.RunState(id="done", status="finished", config=config))
    ended = await client.post("/v1/runs/done/pause")
    assert ended.status_code == 409 and "only a run that goes on can be paused" in ended.json()["detail"]
    assert (await client.post("/v1/runs/nope/pause")).status_code == 404


async def test_a_runs_stream_sends_its_steps_as_they_are_recorded_then_its_end(
        app: FastAPI, gateway_url: str, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api_runs, "STREAM_POLL_S", 0.05)
    state = events.RunState(id="team/r1", tenant="acme", status="running")
    await put_state(app, state)
    await store.record([weight_update("team/r1", i, {"reward_mean": i / 10}) for i in range(3)])
    async with httpx.AsyncClient(base_url=gateway_url, timeout=10) as http:
        async with http.stream("GET", "/v1/runs/team/r1/stream") as response:
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
            received = server_sent_events(response)
            assert await anext(received) == ("status", {"status": "running", "reason": None})
            name, first = await anext(received)
            assert (name, first["run"], [s["step"] for s in first["items"]]) == ("steps", "team/r1", [0, 1, 2])
            assert first["items"][1] == {"step": 1, "version": 2, "metrics": {"reward_mean": 0.1},
                                         "created_at": "2026-11-01T12:01:00Z"}
            await store.record([weight_update("team/r1", 3, {"reward_mean": 0.3})])  # the trainer goes on
            name, more = await anext(received)
            assert (name, [s["step"] for s in more["items"]]) == ("steps", [3])
            await put_state(app, msgspec.structs.replace(state, status="paused", reason="by a person"))
            assert await anext(received) == ("status", {"status": "paused", "reason": "by a person"})
            await store.record([weight_update("team/r1", 4, {"reward_mean": 0.4})])
            await put_state(app, msgspec.structs.replace(state, status="finished"))
            rest = [item async for item in received]  # the stream ends with the run
        assert sorted(name for name, _ in rest) == ["end", "status", "steps"] and rest[-1][0] == "end"
        assert [s["step"] for name, data in rest if name == "steps" for s in data["items"]] == [4]
        assert rest[-1][1] == {"status": "finished", "reason": rest[-1][1]["reason"]} and rest[-1][1]["reason"]
        # Resuming after a step; a run the bucket does not know (published straight to the bus) ends at once.
        async with http.stream("GET", "/v1/runs/team/r1/stream", params={"since_step": 3}) as response:
            again = [(name, data) async for name, data in server_sent_events(response)]
        assert [name for name, _ in again] == ["status", "steps", "end"]
        assert [s["step"] for s in again[1][1]["items"]] == [4]
        await store.record([weight_update("bus-only", 0, {"reward_mean": 0.5})])
        async with http.stream("GET", "/v1/runs/bus-only/stream") as response:
            alone = [(name, data) async for name, data in server_sent_events(response)]
        assert alone[0] == ("status", {"status": None, "reason": None}) and alone[-1][0] == "end"
        # A stream closes after STREAM_MAX_S without an end: the client asks again with since_step.
        monkeypatch.setattr(api_runs, "STREAM_MAX_S", 0.2)
        await put_state(app, events.RunState(id="created", tenant="acme"))  # made by POST /v1/tasks, never run
        async with http.stream("GET", "/v1/runs/created/stream") as response:
            assert [name async for name, _ in server_sent_events(response)] == ["status"]
        missing = await http.get("/v1/runs/nobody/stream")
        assert missing.status_code == 404 and "run 'nobody' not found" in missing.json()["detail"]
        for params, said in (({"since_step": -2}, "since_step: "), ({"since_step": "x"}, "since_step: ")):
            bad = await http.get("/v1/runs/team/r1/stream", params=params)
            assert bad.status_code == 422 and bad.json()["detail"].startswith(said), bad.text


async def test_the_evals_a_runs_owner_ran_are_in_the_run_and_its_stream(
        app: FastAPI, gateway_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api_runs, "STREAM_POLL_S", 0.05)
    bus = app.state.bus
    await put_state(app, events.RunState(id="team/ev", tenant="acme", status="running"))
    first = events.EvalPoint(eval="held_out", step=5, run="team/ev-eval-held_out-5", reward_mean=0.25,
                             reward_stderr=0.02, num_rollouts=16, num_errors=1)
    await runs.add_eval_point(bus, "team/ev", first)
    await runs.add_eval_point(bus, "team/ev", msgspec.structs.replace(first, reward_mean=0.3))  # the same eval again
    async with httpx.AsyncClient(base_url=gateway_url, timeout=10) as http:
        detail = await get(http, "/v1/runs/team/ev")
        assert detail["evals"] == [{"eval": "held_out", "step": 5, "run": "team/ev-eval-held_out-5",
                                    "reward_mean": 0.3, "reward_stderr": 0.02, "num_rollouts": 16, "num_errors": 1}]
        async with http.stream("GET", "/v1/runs/team/ev/stream") as response:
            received = server_sent_events(response)
            assert (await anext(received))[0] == "status"
            name, shown = await anext(received)
            assert (name, [(p["eval"], p["step"]) for p in shown["items"]]) == ("evals", [("held_out", 5)])
            await runs.add_eval_point(bus, "team/ev", msgspec.structs.replace(first, step=10, reward_mean=0.5))
            name, more = await anext(received)
            assert (name, [(p["step"], p["reward_mean"]) for p in more["items"]]) == ("evals", [(5, 0.3), (10, 0.5)])
    assert [p.step for p in (await runs.get_run(bus, "team/ev")).evals] == [5, 10]  # type: ignore[union-attr]
