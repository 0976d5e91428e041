"""The gateway's real processes: tasks posted over HTTP end up in the store exactly once, even
when the recorder is SIGKILLed and restarted in the middle; a payload that does not decode
(or decodes but can never be recorded) goes to ``dead.TASKS``, and is itself recorded,
while the recorder goes on.

Each test starts a nats-server (fixture), ``python -m flywheel_gateway api`` and/or
``recorder`` as subprocesses the way ``flywheel up`` does (:mod:`flywheel.ops.stack`), on free
ports with a temporary data folder, and stops exactly those processes by their handles. Not
covered: PostgreSQL (the store tests cover it).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from flywheel.contract import events
from flywheel.contract.bus import Bus
from flywheel.contract.settings import Settings
from flywheel.ops.stack import SERVICES
from flywheel.runtime.natsserver import NatsServer, free_port
from flywheel.runtime.supervise import ServiceProcess, child_env
from flywheel_gateway import schema
from flywheel_gateway.migrate import migrate
from flywheel_gateway.store import Store
from tests.helpers import until

NUM_TASKS = 1000
TASKS_PER_REQUEST = 50
STOP_TIMEOUT_S = 20.0


@pytest.fixture
def settings(nats_server: NatsServer, tmp_path: Path) -> Settings:
    return Settings(nats_url=nats_server.url, data_dir=tmp_path / "data", gateway_port=free_port())


@pytest.fixture
async def processes(settings: Settings, tmp_path: Path) -> AsyncIterator[dict[str, ServiceProcess]]:
    """The gateway's API and recorder, as ``flywheel up`` runs them (not started yet)."""
    env = child_env(settings)
    made = {name: ServiceProcess(name, SERVICES[name], env, tmp_path / f"{name}.log")
            for name in ("gateway", "recorder")}
    try:
        yield made
    finally:
        for process in made.values():
            if process.popen is not None:
                await process.stop(STOP_TIMEOUT_S)


async def start(process: ServiceProcess) -> ServiceProcess:
    await process.launch()
    return process


def running(process: ServiceProcess) -> bool:
    assert process.returncode() is None, f"{process.name} exited with {process.returncode()}; {process.log_tail()}"
    return True


async def stop(process: ServiceProcess) -> int:
    await process.stop(STOP_TIMEOUT_S)
    returncode = process.returncode()
    assert returncode is not None
    return returncode


@pytest.fixture
async def store(settings: Settings) -> AsyncIterator[Store]:
    await migrate(settings.resolved_database_url)  # so the test can read before the services start
    s = Store.open(settings.resolved_database_url)  # reads while the recorder writes (WAL)
    try:
        yield s
    finally:
        await s.close()


async def task_ids(store: Store) -> list[str]:
    async with store.engine.connect() as conn:
        return list((await conn.scalars(sa.select(schema.tasks.c.id))).all())


@pytest.mark.long
async def test_every_task_is_recorded_once_across_a_recorder_kill(
        processes: dict[str, ServiceProcess], settings: Settings, store: Store) -> None:
    api, recorder = await start(processes["gateway"]), await start(processes["recorder"])
    async with httpx.AsyncClient(base_url=settings.resolved_gateway_url, timeout=30) as client:

        async def healthy() -> bool:
            running(api)
            try:
                return (await client.get("/healthz")).status_code == 200
            except httpx.TransportError:
                return False

        await until(healthy, timeout_s=60, what="the API to answer /healthz")
        posted: list[str] = []
        for i in range(NUM_TASKS // TASKS_PER_REQUEST):
            batch = [{"run": "kill-test", "env": "echo", "data": {"i": i * TASKS_PER_REQUEST + j}}
                     for j in range(TASKS_PER_REQUEST)]
            response = await client.post("/v1/tasks", json=batch)
            assert response.status_code == 202, response.text
            posted += response.json()["ids"]
            if i == 7:
                # Mid-way: once the recorder is recording, kill it without warning.
                async def recording() -> bool:
                    return running(recorder) and len(await task_ids(store)) > 0

                await until(recording, timeout_s=60, what="the recorder to record its first tasks")
                os.kill(recorder.pid, signal.SIGKILL)
                assert recorder.popen is not None
                await asyncio.to_thread(recorder.popen.wait)
            if i == 12:
                await recorder.launch()

    async def all_recorded() -> bool:
        return running(recorder) and len(await task_ids(store)) >= NUM_TASKS

    await until(all_recorded, timeout_s=60, what=f"{NUM_TASKS} tasks in the store")
    recorded = await task_ids(store)
    assert len(recorded) == NUM_TASKS and len(set(recorded)) == NUM_TASKS
    assert set(recorded) == set(posted)
    assert await stop(recorder) == 0, recorder.log_tail()
    # uvicorn shuts down gracefully, then re-raises the signal it caught.
    assert await stop(api) in (0, -signal.SIGTERM), api.log_tail()
    assert "Application shutdown complete" in api.log_path.read_text(), api.log_tail()


async def test_payloads_that_cannot_be_recorded_are_dead_lettered_and_recorded(
        processes: dict[str, ServiceProcess], settings: Settings, store: Store) -> None:
    recorder = await start(processes["recorder"])
    bus = await Bus.connect(settings.resolved_nats_url, name="test")
    try:
        garbage = b"\x00\x01 this is not an event"
        await bus.publish_raw("tasks.x.y", garbage, headers={"Nats-Msg-Id": "garbage-1"})
        # Decodes, but can never be recorded: a time without a zone.
        naive = b'{"type":"task","id":"naive-1","created_at":"2026-01-01T00:00:00","run":"x","env":"y","data":{}}'
        await bus.publish_raw("tasks.x.y", naive, headers={"Nats-Msg-Id": "naive-1"})
        await bus.publish(events.Task(id="after-garbage", run="x", env="y", data={}))

        async def dead_letters() -> list[dict[str, object]]:
            running(recorder)
            async with store.engine.connect() as conn:
                query = sa.select(schema.dead_letters).order_by(schema.dead_letters.c.id)
                return [dict(row) for row in (await conn.execute(query)).mappings()]

        async def both_recorded() -> bool:
            return len(await dead_letters()) == 2

        await until(both_recorded, timeout_s=60, what="both dead letters in the store")
        by_payload = {letter["payload"]: letter for letter in await dead_letters()}
        for payload, reason in ((garbage, "payload does not decode"), (naive, "rejected: Task 'naive-1': created_at")):
            letter = by_payload[payload]
            assert letter["stream"] == "TASKS" and letter["original_subject"] == "tasks.x.y"
            assert letter["consumer"] == "recorder-tasks" and reason in str(letter["reason"])
            assert letter["num_delivered"] == 1

        on_dead = await bus.js.get_last_msg("DEAD", "dead.TASKS")
        assert on_dead.data is not None
        assert events.Decoder(events.DeadLetter).decode(on_dead.data).id in {str(d["id"]) for d in by_payload.values()}

        async def went_on() -> bool:
            return "after-garbage" in await task_ids(store)

        await until(went_on, what="the task published after the garbage to be recorded")
        assert "naive-1" not in await task_ids(store)
    finally:
        await bus.close()
    assert await stop(recorder) == 0, recorder.log_tail()
