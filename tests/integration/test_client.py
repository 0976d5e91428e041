"""Publishing tasks without the gateway, against a real nats-server: ids, dedup, runs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from flywheel.contract import events
from flywheel.contract.bus import Bus
from flywheel.ops import cli
from flywheel.ops.client import Client, publish_tasks
from flywheel.runtime.natsserver import NatsServer

ROWS = [{"text": "abc"}, {"text": "hello"}, {"id": "own-id", "text": "xyz"}]


async def stored_tasks(bus: Bus) -> list[events.Task]:
    """Every task in the TASKS stream, in order."""
    num = (await bus.js.stream_info("TASKS")).state.messages
    decoder = events.Decoder(events.Task)
    tasks = []
    for seq in range(1, num + 1):
        data = (await bus.js.get_msg("TASKS", seq)).data
        assert data is not None, f"TASKS message {seq} has no payload"
        tasks.append(decoder.decode(data))
    return tasks


async def test_publish_then_republish_is_deduplicated(bus: Bus, nats_server: NatsServer) -> None:
    async with await Client.connect(nats_server.url) as fw:
        ids = await fw.publish_tasks(run="r1", env="reverse-text", rows=ROWS, num_rollouts=4)
        assert ids == [events.task_id("r1", "reverse-text", 1, ROWS[0]),
                       events.task_id("r1", "reverse-text", 2, ROWS[1]), "own-id"]
        assert await fw.publish_tasks(run="r1", env="reverse-text", rows=ROWS, num_rollouts=4) == ids
        again = await fw.publish(await stored_tasks(bus))
    assert again.ids == ids and again.num_duplicates == 3 and again.num_new == 0 and again.runs_created == []
    tasks = await stored_tasks(bus)
    assert [t.id for t in tasks] == ids
    assert all(t.subject() == "tasks.r1.reverse-text" and t.num_rollouts == 4 for t in tasks)
    assert [t.data for t in tasks] == ROWS


async def test_run_is_registered_once_and_owned_by_its_tenant(bus: Bus, nats_server: NatsServer) -> None:
    async with await Client.connect(nats_server.url) as fw:
        assert await fw.run_state("r1") is None
        first = await fw.publish(_tasks("r1"), tenant="acme")
        assert first.runs_created == ["r1"]
        state = await fw.run_state("r1")
        assert state is not None and (state.id, state.tenant, state.status) == ("r1", "acme", "created")
        assert (await fw.publish(_tasks("r1", "other"), tenant="acme")).runs_created == []
        with pytest.raises(ValueError, match="run 'r1' belongs to tenant 'acme', not 'default'"):
            await fw.publish(_tasks("r1", "third"))
    assert (await bus.js.stream_info("TASKS")).state.messages == 2  # the refused task was not published


def _tasks(run: str, text: str = "a") -> list[events.Task]:
    return [events.Task(id=f"{run}-{text}", run=run, env="echo", data={"text": text})]


async def test_a_task_over_max_payload_publishes_nothing(bus: Bus, nats_server: NatsServer) -> None:
    async with await Client.connect(nats_server.url) as fw:
        big = {"text": "x" * (fw.bus.nc.max_payload + 1)}
        with pytest.raises(ValueError, match=r"\(number 2\) is \d+ bytes as published \(payload and headers\); "
                                             r"the NATS server accepts at most"):
            await fw.publish_tasks(run="r1", env="echo", rows=[{"text": "small"}, big])
        assert await fw.run_state("r1") is None
    assert (await bus.js.stream_info("TASKS")).state.messages == 0


def test_sync_publish_tasks(nats_server: NatsServer) -> None:
    ids = publish_tasks(nats_server.url, run="r1", env="echo", rows=ROWS[:2])
    assert publish_tasks(nats_server.url, run="r1", env="echo", rows=ROWS[:2]) == ids

    async def count() -> int:
        async with await Client.connect(nats_server.url) as fw:
            return (await fw.bus.js.stream_info("TASKS")).state.messages

    assert asyncio.run(count()) == 2


async def test_cli_publishes_a_file_once(bus: Bus, nats_server: NatsServer, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "abc"}\n{"text": "hello"}\n\n{"id": "own-id", "text": "xyz"}\n')
    argv = ["tasks", "publish", "reverse-text", "--run", "r1", "--file", str(rows), "--num-rollouts", "2",
            "--nats-url", nats_server.url]
    assert await asyncio.to_thread(cli.main, argv) == 0
    assert capsys.readouterr().out == ("published 3 tasks to tasks.r1.reverse-text, 0 duplicates "
                                       "(dropped by the server); registered run r1\n")
    assert await asyncio.to_thread(cli.main, argv) == 0
    assert capsys.readouterr().out == ("published 0 tasks to tasks.r1.reverse-text, 3 duplicates "
                                       "(dropped by the server); run r1 already registered\n")
    tasks = await stored_tasks(bus)
    # The file's line numbers make the ids: the same rows from Python at the same positions agree.
    assert [t.id for t in tasks] == [events.task_id("r1", "reverse-text", 1, ROWS[0]),
                                     events.task_id("r1", "reverse-text", 2, ROWS[1]), "own-id"]
    assert all(t.num_rollouts == 2 for t in tasks)


async def test_cli_bad_line_publishes_nothing_from_the_file(bus: Bus, nats_server: NatsServer, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "abc"}\n{"text": "hello"}\n["not", "an", "object"]\n')
    argv = ["tasks", "publish", "echo", "--run", "r1", "--file", str(rows), "--nats-url", nats_server.url]
    assert await asyncio.to_thread(cli.main, argv) == 1
    assert f"{rows}:3: a task row must be a JSON object, got list" in capsys.readouterr().err
    assert (await bus.js.stream_info("TASKS")).state.messages == 0
    async with await Client.connect(nats_server.url) as fw:
        assert await fw.run_state("r1") is None
