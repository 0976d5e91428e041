"""Batch messages (several events of one subject in one message) against a real nats-server:
how they are published, delivered one event at a time, and settled as one message."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from flywheel.contract import events
from flywheel.contract.bus import (
    HEADER_MSG_ID,
    Bus,
    Consumer,
    Delivery,
    EventCount,
    HandBack,
    Reject,
    read_stream,
    watch,
)
from tests.helpers import until
from tests.integration.test_bus import dead_letters, running, task


async def messages(bus: Bus, stream: str) -> int:
    return (await bus.js.stream_info(stream)).state.messages


async def test_events_of_one_subject_travel_together_and_again_are_stored_once(bus: Bus) -> None:
    group = [task(i) for i in range(4)] + [task(9, run="r2")]
    acks = await bus.publish_many(group, events.MSGPACK, together=True)
    assert await messages(bus, "TASKS") == 2  # r1's four in one message, r2's alone
    assert [a.seq for a in acks] == [1, 1, 1, 1, 2] and not any(a.duplicate for a in acks)
    first = await bus.js.get_msg("TASKS", 1)
    assert first.headers is not None and first.headers[events.BATCH_HEADER] == "4"
    assert first.headers[HEADER_MSG_ID] == events.batch_msg_id(group[:4])
    assert events.Decoder(events.Task).decode_many(first.data or b"", events.MSGPACK) == group[:4]
    lone = await bus.js.get_msg("TASKS", 2)
    assert lone.headers is not None and events.BATCH_HEADER not in lone.headers  # one event: a plain message
    again = await bus.publish_many(group, events.MSGPACK, together=True)
    assert all(a.duplicate for a in again) and await messages(bus, "TASKS") == 2
    assert await read_stream(bus, "TASKS", events.Task) == group


async def test_a_batch_over_the_max_payload_goes_one_event_a_message(bus: Bus) -> None:
    size = bus.nc.max_payload // 3
    big = [events.Task(id=f"big{i}", run="r1", env="echo", data={"pad": "x" * size}) for i in range(4)]
    acks = await bus.publish_many(big, together=True)
    assert await messages(bus, "TASKS") == 4 and [a.seq for a in acks] == [1, 2, 3, 4]
    assert [t.id for t in await read_stream(bus, "TASKS", events.Task)] == [t.id for t in big]


@pytest.mark.parametrize("mode", ["handler", "batch_handler"])
async def test_each_event_of_a_batch_is_delivered_and_the_message_acked_once(bus: Bus, mode: str) -> None:
    await bus.publish_many([task(i) for i in range(5)], together=True)
    seen: list[Delivery] = []

    async def one(d: Delivery) -> None:
        seen.append(d)

    async def many(ds: list[Delivery]) -> None:
        seen.extend(ds)

    c = Consumer(bus, stream="TASKS", durable="c1", event_type=events.Task,
                 **({"handler": one} if mode == "handler" else {"batch_handler": many}))
    t = await running(c)
    await until(lambda: c.stats.acked == 1, what="the batch message acked")
    c.stop()
    await t
    assert sorted((d.event.id, d.batch_index, d.stream_seq) for d in seen) == [(f"t{i}", i, 1) for i in range(5)]
    info = await bus.js.consumer_info("TASKS", "c1")
    assert info.num_ack_pending == 0 and info.num_pending == 0 and info.num_redelivered == 0


async def test_a_rejected_event_is_dead_lettered_alone_and_the_rest_handled_once(bus: Bus) -> None:
    await bus.publish_many([task(i) for i in range(4)], events.MSGPACK, together=True)
    handled: list[str] = []

    async def handle(d: Delivery) -> None:
        if d.event.id == "t2":
            raise Reject("t2 can never work")
        handled.append(d.event.id)

    c = Consumer(bus, stream="TASKS", durable="c1", handler=handle, event_type=events.Task)
    t = await running(c)
    (letter,) = await dead_letters(bus, 1)
    await until(lambda: c.stats.acked == 1, what="the rest of the batch acked")
    c.stop()
    await t
    assert sorted(handled) == ["t0", "t1", "t3"]
    assert letter.batch_index == 2 and letter.id == "TASKS.1.c1.2" and "t2 can never work" in letter.reason
    # The letter holds the event alone, as it would travel alone: it can be published again as it is.
    alone = events.Decoder(events.Task).decode(letter.payload, letter.headers.get("Content-Type"))
    assert (alone.id, alone.data) == ("t2", {"i": 2}) and letter.headers[HEADER_MSG_ID] == "t2"
    assert events.BATCH_HEADER not in letter.headers
    assert (await bus.js.consumer_info("TASKS", "c1")).num_redelivered == 0


async def test_a_failing_event_brings_its_batch_again_until_only_it_is_dead_lettered(bus: Bus) -> None:
    await bus.publish_many([task(i) for i in range(3)], together=True)
    handled: list[tuple[str, int]] = []

    async def handle(d: Delivery) -> None:
        handled.append((d.event.id, d.num_delivered))
        if d.event.id == "t1":
            raise RuntimeError("the database is down")

    c = Consumer(bus, stream="TASKS", durable="c1", handler=handle, event_type=events.Task, max_deliver=2,
                 backoff_s=(0.05,))
    t = await running(c)
    (letter,) = await dead_letters(bus, 1)
    await until(lambda: c.stats.acked == 1, what="the batch acked after its second delivery")
    c.stop()
    await t
    # Every event of the batch came twice (handlers are idempotent); only the failing one is a dead letter.
    assert sorted(handled) == [(f"t{i}", n) for i in range(3) for n in (1, 2)]
    assert letter.batch_index == 1 and "failed on delivery 2 of 2: RuntimeError: the database is down" in letter.reason
    assert c.stats.naked == 1


async def test_a_batch_handler_failing_on_one_event_settles_the_others(bus: Bus) -> None:
    await bus.publish_many([task(i) for i in range(3)], together=True)
    await bus.publish(task(7))
    calls: list[list[str]] = []

    async def handle(ds: list[Delivery]) -> None:
        calls.append([d.event.id for d in ds])
        if any(d.event.id == "t0" for d in ds):
            raise Reject("t0 is poison")

    c = Consumer(bus, stream="TASKS", durable="c1", batch_handler=handle, event_type=events.Task)
    t = await running(c)
    await dead_letters(bus, 1)
    await until(lambda: c.stats.acked == 2, what="both messages acked")
    c.stop()
    await t
    assert ["t1"] in calls and ["t2"] in calls and ["t7"] in calls  # isolated one by one after the failure


async def test_a_handed_back_event_hands_back_its_whole_batch(bus: Bus) -> None:
    await bus.publish_many([task(i) for i in range(2)], together=True)
    first = True
    handled: list[tuple[str, int]] = []

    async def handle(d: Delivery) -> None:
        nonlocal first
        handled.append((d.event.id, d.num_delivered))
        if d.event.id == "t1" and first:
            first = False
            raise HandBack("not mine now")

    c = Consumer(bus, stream="TASKS", durable="c1", handler=handle, event_type=events.Task)
    t = await running(c)
    await until(lambda: c.stats.acked == 1, what="the batch acked on its second delivery")
    c.stop()
    await t
    assert c.stats.handed_back == 1 and sorted(handled) == [("t0", 1), ("t0", 2), ("t1", 1), ("t1", 2)]


@pytest.mark.parametrize(("header", "payload", "why"), [
    ("3", msgspec.json.encode([task(0), task(1)]), "a batch of 2 events whose Flywheel-Batch header says '3'"),
    ("1", msgspec.json.encode([task(0, run="elsewhere")]), "event 0 of the batch: a Task whose fields give"),
    ("2", b"[{\"not\": \"an event\"}, 3]", "batch payload does not decode as an array of Task"),
    ("0", b"[]", "a batch of 0 events"),
])
async def test_a_batch_that_does_not_hold_up_is_dead_lettered_whole(bus: Bus, header: str, payload: bytes,
                                                                   why: str) -> None:
    await bus.publish_raw("tasks.r1.echo", payload, {events.BATCH_HEADER: header, HEADER_MSG_ID: "bad-batch"})
    await bus.publish(task(5))
    seen: list[str] = []

    async def handle(d: Delivery) -> None:
        seen.append(d.event.id)

    c = Consumer(bus, stream="TASKS", durable="c1", handler=handle, event_type=events.Task)
    t = await running(c)
    (letter,) = await dead_letters(bus, 1)
    await until(lambda: c.stats.acked == 1, what="the good message acked")
    c.stop()
    await t
    assert seen == ["t5"] and why in letter.reason and letter.batch_index is None and letter.payload == payload


async def test_a_watch_yields_each_event_of_a_batch(bus: Bus) -> None:
    await bus.publish_many([task(i) for i in range(3)], together=True)
    stopping = asyncio.Event()
    seen = []
    async for t in watch(bus, "tasks.>", events.Task, stopping, watcher="w"):
        seen.append(t.id)
        if len(seen) == 3:
            stopping.set()
    assert seen == ["t0", "t1", "t2"]


async def test_an_event_count_counts_a_batch_by_its_events_and_reads_only_what_is_new(bus: Bus) -> None:
    count = EventCount(bus, "TASKS", "tasks.r1.>")
    assert await count.now() == 0
    await bus.publish_many([task(i) for i in range(5)], together=True)
    await bus.publish(task(9, run="r2"))  # another run's: not counted
    await bus.publish(task(7))
    assert await count.now() == 6 and count.num_messages == 2
    await bus.publish_many([task(i) for i in range(10, 13)], together=True)
    assert await count.now() == 9 and count.num_messages == 3 and count.last_seq == 4
    assert await EventCount(bus, "TASKS", "tasks.r1.>").now() == 9  # a new count reads them all
