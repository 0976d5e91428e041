"""The recorder's group commit: batches that arrive together share one write, and one batch's
bad event fails that batch alone. The store is a stand-in that records its calls; the real
store behind the recorder is exercised by the integration tests (test_recorder_kill.py,
test_gateway_traces.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from flywheel.contract import events
from flywheel_gateway.recorder import GroupCommit
from flywheel_gateway.store import UnrecordableEvent
from tests.helpers import until


class Store:
    """Records each write's event ids; refuses a write that holds the id ``bad`` as the real
    store refuses an unrecordable event (before writing), and fails every write while ``down``."""

    def __init__(self) -> None:
        self.writes: list[list[str]] = []
        self.down = False

    async def record(self, batch: list[Any]) -> None:
        ids = [e.id for e in batch]
        if "bad" in ids:
            raise UnrecordableEvent("event 'bad' cannot be recorded")
        if self.down:
            raise OSError("database is locked")
        self.writes.append(ids)


def task(event_id: str) -> events.Task:
    return events.Task(id=event_id, run="r1", env="e", data={}, num_rollouts=1)


async def test_batches_arriving_within_the_linger_share_one_write() -> None:
    store = Store()
    writer = GroupCommit(store, linger_s=0.05, max_events=100)  # type: ignore[arg-type]  # the stand-in
    await asyncio.gather(writer.record([task("a"), task("b")]), writer.record([task("c")]),
                         writer.record([task("d")]))
    assert store.writes == [["a", "b", "c", "d"]]
    await writer.record([task("e")])  # after the write: the next one
    assert store.writes == [["a", "b", "c", "d"], ["e"]]


async def test_a_batch_returns_only_once_its_write_is_done() -> None:
    store = Store()
    writer = GroupCommit(store, linger_s=0.5, max_events=100)  # type: ignore[arg-type]  # the stand-in
    first = asyncio.ensure_future(writer.record([task("a")]))
    await until(lambda: len(writer._waiting) == 1, what="the batch waiting for its write")
    assert not first.done() and store.writes == []  # lingering: nothing written, nothing acknowledged
    await first
    assert store.writes == [["a"]]


async def test_enough_waiting_events_write_before_the_linger_ends() -> None:
    store = Store()
    writer = GroupCommit(store, linger_s=30.0, max_events=3)  # type: ignore[arg-type]  # the stand-in
    started = time.monotonic()
    await asyncio.wait_for(asyncio.gather(writer.record([task("a"), task("b")]), writer.record([task("c")])), 5)
    assert time.monotonic() - started < 5
    assert store.writes == [["a", "b", "c"]]


async def test_an_unrecordable_event_fails_its_own_batch_only() -> None:
    store = Store()
    writer = GroupCommit(store, linger_s=0.05, max_events=100)  # type: ignore[arg-type]  # the stand-in
    outcomes = await asyncio.gather(writer.record([task("a")]), writer.record([task("x"), task("bad")]),
                                    writer.record([task("c")]), return_exceptions=True)
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], UnrecordableEvent)
    assert store.writes == [["a"], ["c"]]  # each by itself once the shared write was refused


async def test_a_database_error_fails_every_batch_of_the_write() -> None:
    store = Store()
    store.down = True
    writer = GroupCommit(store, linger_s=0.05, max_events=100)  # type: ignore[arg-type]  # the stand-in
    outcomes = await asyncio.gather(writer.record([task("a")]), writer.record([task("b")]), return_exceptions=True)
    assert all(isinstance(o, OSError) for o in outcomes)
    store.down = False
    await writer.record([task("a")])  # its caller retries: written then
    assert store.writes == [["a"]]


async def test_a_caller_that_stops_waiting_leaves_the_others_written() -> None:
    store = Store()
    writer = GroupCommit(store, linger_s=0.5, max_events=100)  # type: ignore[arg-type]  # the stand-in
    gone = asyncio.ensure_future(writer.record([task("a")]))
    kept = asyncio.ensure_future(writer.record([task("b")]))
    await until(lambda: len(writer._waiting) == 2, what="both batches waiting for their write")
    gone.cancel()
    await kept
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert store.writes == [["a", "b"]]  # recording is idempotent: a redelivery of "a" changes nothing


async def test_no_linger_writes_each_batch_at_once() -> None:
    store = Store()
    writer = GroupCommit(store, linger_s=0.0, max_events=100)  # type: ignore[arg-type]  # the stand-in
    await asyncio.gather(writer.record([task("a")]), writer.record([task("b")]))
    assert store.writes == [["a"], ["b"]]
