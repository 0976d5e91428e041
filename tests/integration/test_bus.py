"""The bus layer against a real nats-server: dedup, retries, dead letters, shutdown, restarts."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import msgspec
import nats.js.errors
import pytest
from nats.aio.msg import Msg

from flywheel.contract import events
from flywheel.contract.bus import (
    Bus,
    BusConfig,
    Consumer,
    Delivery,
    PayloadTooLarge,
    Reject,
    delivery_counts,
    read_stream,
    watch,
)
from flywheel.runtime.natsserver import NatsServer
from tests.helpers import until


def task(i: int, run: str = "r1") -> events.Task:
    return events.Task(id=f"t{i}", run=run, env="echo", data={"i": i})


async def dead_letters(bus: Bus, n: int, timeout_s: float = 10.0) -> list[events.DeadLetter]:
    sub = await bus.js.subscribe("dead.>", ordered_consumer=True)
    decoder = events.Decoder(events.DeadLetter)
    out = []
    try:
        for _ in range(n):
            msg = await sub.next_msg(timeout=timeout_s)
            out.append(decoder.decode(msg.data))
    finally:
        await sub.unsubscribe()
    return out


async def running(consumer: Consumer) -> asyncio.Task[None]:
    t = asyncio.ensure_future(consumer.run())
    return t


async def test_ensure_is_idempotent(nats_server: NatsServer) -> None:
    a = await Bus.connect(nats_server.url, "a")
    b = await Bus.connect(nats_server.url, "b")  # ensures again over existing streams
    names = {s.config.name for s in await a.js.streams_info()}
    assert {"TASKS", "ROLLOUTS", "TRACES", "SCORES", "SIGNALS", "WEIGHTS", "USAGE", "DEAD"} <= names
    info = await a.js.stream_info("TASKS")
    assert info.config.storage == "file"
    await (await b.runs_kv()).put("r1", b"{}")
    assert (await (await a.runs_kv()).get("r1")).value == b"{}"
    await a.close()
    await b.close()


async def test_publish_is_deduplicated_by_event_id(bus: Bus) -> None:
    t = task(1)
    first = await bus.publish(t)
    again = await bus.publish(t)
    assert again.duplicate and not first.duplicate
    await bus.publish_many([t, task(2), task(2)])
    assert (await bus.js.stream_info("TASKS")).state.messages == 2


async def test_consumer_acks_and_decodes_msgpack(bus: Bus) -> None:
    await bus.publish(task(1))  # JSON: no Content-Type, the contract's default
    await bus.publish(task(2), content_type=events.MSGPACK)
    seen: list[Delivery] = []

    async def handle(d: Delivery) -> None:
        seen.append(d)

    c = Consumer(bus, stream="TASKS", durable="c1", handler=handle, event_type=events.Task)
    t = await running(c)
    await until(lambda: c.stats.acked == 2, what="two acks")
    c.stop()
    await t
    assert sorted((d.event.id, d.stream_seq, d.num_delivered) for d in seen) == [("t1", 1, 1), ("t2", 2, 1)]
    assert [d.headers.get("Content-Type") for d in sorted(seen, key=lambda d: d.stream_seq)] == [None, events.MSGPACK]
    info = await bus.js.consumer_info("TASKS", "c1")
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_transient_failure_is_retried_with_backoff(bus: Bus) -> None:
    await bus.publish(task(1))
    deliveries: list[float] = []

    async def flaky(d: Delivery) -> None:
        deliveries.append(time.monotonic())
        if d.num_delivered < 3:
            raise RuntimeError("database briefly away")

    c = Consumer(bus, stream="TASKS", durable="c1", handler=flaky, backoff_s=(0.3, 0.6))
    t = await running(c)
    await until(lambda: c.stats.acked == 1, what="success on the third delivery")
    c.stop()
    await t
    assert len(deliveries) == 3 and c.stats.naked == 2 and c.stats.dead_lettered == 0
    assert deliveries[1] - deliveries[0] >= 0.25
    assert deliveries[2] - deliveries[1] >= 0.5


async def test_last_failed_delivery_goes_to_dead_letters_and_consumer_goes_on(bus: Bus) -> None:
    await bus.publish(task(1))
    await bus.publish(task(2))
    ok: list[str] = []

    async def handle(d: Delivery) -> None:
        if d.event.id == "t1":
            raise ValueError("cannot parse prompt")
        ok.append(d.event.id)

    c = Consumer(bus, stream="TASKS", durable="c1", handler=handle, max_deliver=3, backoff_s=(0.05,))
    t = await running(c)
    [letter] = await dead_letters(bus, 1)
    c.stop()
    await t
    assert ok == ["t2"]
    assert letter.stream == "TASKS" and letter.original_subject == "tasks.r1.echo"
    assert letter.num_delivered == 3 and "ValueError: cannot parse prompt" in letter.reason
    assert events.Decoder(events.Task).decode(letter.payload).id == "t1"


async def test_undecodable_payload_and_reject_are_dead_lettered_at_once(bus: Bus) -> None:
    await bus.publish_raw("tasks.r1.echo", b"\x00not json", {"Nats-Msg-Id": "junk"})
    await bus.publish_raw("tasks.r1.echo", b'{"type":"task","id":"x","run":"r1"}', {"Nats-Msg-Id": "missing"})
    await bus.publish(task(1))
    await bus.publish(task(2))
    handled: list[str] = []

    async def handle(d: Delivery) -> None:
        if d.event.id == "t1":
            raise Reject("task names an unknown environment")
        handled.append(d.event.id)

    c = Consumer(bus, stream="TASKS", durable="c1", handler=handle, event_type=events.Task)
    t = await running(c)
    letters = await dead_letters(bus, 3)
    await until(lambda: handled == ["t2"], what="the good task")
    c.stop()
    await t
    reasons = sorted(letter.reason for letter in letters)
    assert all(letter.num_delivered == 1 for letter in letters)
    assert any("does not decode" in r and "missing required field `env`" in r for r in reasons), reasons
    assert any("does not decode" in r and "JSON" in r for r in reasons), reasons
    assert any(r == "rejected: task names an unknown environment" for r in reasons), reasons


async def test_batch_with_a_poison_message_isolates_it(bus: Bus) -> None:
    await bus.publish_many([task(i) for i in range(20)])
    stored: Counter[str] = Counter()

    async def handle_batch(ds: list[Delivery]) -> None:
        if any(d.event.id == "t7" for d in ds):
            raise RuntimeError("constraint violated")
        for d in ds:
            stored[d.event.id] += 1

    c = Consumer(bus, stream="TASKS", durable="rec", batch_handler=handle_batch, batch_size=20,
                 max_in_flight=20, max_deliver=2, backoff_s=(0.05,))
    t = await running(c)
    [letter] = await dead_letters(bus, 1)
    await until(lambda: len(stored) == 19, what="19 good tasks")
    c.stop()
    await t
    assert "t7" not in stored and all(v == 1 for v in stored.values())
    assert "constraint violated" in letter.reason


async def test_in_flight_is_bounded(bus: Bus) -> None:
    await bus.publish_many([task(i) for i in range(40)])
    now = 0
    peak = 0
    release = asyncio.Event()

    async def slow(d: Delivery) -> None:
        nonlocal now, peak
        now += 1
        peak = max(peak, now)
        await release.wait()
        now -= 1

    c = Consumer(bus, stream="TASKS", durable="c1", handler=slow, max_in_flight=5)
    t = await running(c)
    await until(lambda: now == 5, what="five in flight")
    info = await bus.js.consumer_info("TASKS", "c1")
    assert info.num_ack_pending <= 5
    release.set()
    await until(lambda: c.stats.acked == 40, what="all acked")
    assert len(c._workers) == 5  # one per slot, reused: not a task per message
    c.stop()
    await t
    assert peak == 5


async def test_long_work_sends_in_progress_instead_of_being_redelivered(bus: Bus) -> None:
    await bus.publish(task(1))
    deliveries: list[int] = []

    async def slow(d: Delivery) -> None:
        deliveries.append(d.num_delivered)
        await asyncio.sleep(2.5)  # noqa: sleep - the work itself: longer than ack_wait_s

    c = Consumer(bus, stream="TASKS", durable="c1", handler=slow, ack_wait_s=1.0)
    t = await running(c)
    await until(lambda: c.stats.acked == 1, what="the slow task to finish")
    c.stop()
    await t
    assert deliveries == [1]


async def test_stop_finishes_in_flight_work_and_hands_back_the_rest(bus: Bus) -> None:
    await bus.publish_many([task(i) for i in range(4)])
    started = asyncio.Event()
    finished: list[str] = []

    async def handle(d: Delivery) -> None:
        started.set()
        if d.event.id in ("t0", "t1"):
            await asyncio.sleep(0.2)  # noqa: sleep - work that finishes within the grace period
            finished.append(d.event.id)
        else:
            await asyncio.sleep(60)  # noqa: sleep - work that cannot finish in time: handed back

    c = Consumer(bus, stream="TASKS", durable="c1", handler=handle, max_in_flight=4, grace_s=1.0)
    t = await running(c)
    await started.wait()
    await until(lambda: c._in_flight == 4, what="four in flight")
    c.stop()
    await asyncio.wait_for(t, 5)
    assert sorted(finished) == ["t0", "t1"]
    assert c.stats.handed_back == 2
    # A replacement consumer on the same durable gets exactly the two handed back at once.
    again: list[str] = []

    async def quick(d: Delivery) -> None:
        again.append(d.event.id)

    c2 = Consumer(bus, stream="TASKS", durable="c1", handler=quick, max_in_flight=4)
    t2 = await running(c2)
    await until(lambda: len(again) == 2, timeout_s=5, what="handed-back tasks")
    c2.stop()
    await t2
    assert sorted(again) == ["t2", "t3"]


async def test_server_restart_mid_stream_loses_nothing(nats_server: NatsServer) -> None:
    producer = await Bus.connect(nats_server.url, "producer", BusConfig(publish_timeout_s=30))
    consumer_bus = await Bus.connect(nats_server.url, "consumer")
    seen: Counter[str] = Counter()

    async def handle(d: Delivery) -> None:
        seen[d.event.id] += 1

    c = Consumer(consumer_bus, stream="TASKS", durable="c1", handler=handle, max_in_flight=32)
    t = await running(c)

    async def produce() -> None:
        for i in range(600):
            await producer.publish(task(i))

    p = asyncio.ensure_future(produce())
    await until(lambda: len(seen) >= 150, what="some consumed before the restart")
    await asyncio.to_thread(nats_server.restart)
    await asyncio.wait_for(p, 60)
    await until(lambda: len(seen) == 600, timeout_s=60, what="every task after the restart")
    c.stop()
    await t
    assert (await producer.js.stream_info("TASKS")).state.messages == 600
    await producer.close()
    await consumer_bus.close()


async def test_a_watch_from_a_start_time_goes_on_after_a_server_restart(nats_server: NatsServer) -> None:
    """What `flywheel run` watches the run's dead letters with: the client recreates the watch's
    consumer after a restart, which must not carry the start time along (the server refuses it)."""
    bus = await Bus.connect(nats_server.url, "watcher")
    await bus.publish(task(0))
    since = events.utc_now()
    await bus.publish(task(1))
    stopping = asyncio.Event()
    seen: list[str] = []

    async def collect() -> None:
        async for event in watch(bus, "tasks.>", events.Task, stopping, watcher="test-watch", start_time=since):
            seen.append(event.id)

    watching = asyncio.ensure_future(collect())
    try:
        await until(lambda: seen == [task(1).id], what="the task published after the start time")
        await asyncio.to_thread(nats_server.restart)
        await bus.publish(task(2))
        await until(lambda: task(2).id in seen, timeout_s=30, what="a task published after the restart")
        assert seen == [task(1).id, task(2).id]
    finally:
        stopping.set()
        await watching
        await bus.close()


@pytest.mark.long
async def test_publish_many_survives_a_server_restart_mid_batch(nats_server: NatsServer) -> None:
    bus = await Bus.connect(nats_server.url, "producer", BusConfig(publish_timeout_s=30, request_timeout_s=2))
    for attempt in range(3):  # the restart must land while acks are outstanding; try a few timings
        await bus.js.purge_stream("TASKS")
        publishing = asyncio.ensure_future(bus.publish_many(
            [events.Task(id=f"a{attempt}-{i}", run="r1", env="echo", data={"i": i}) for i in range(3000)],
            events.MSGPACK))
        await asyncio.sleep(0.05 * attempt)  # noqa: sleep - lets some of the batch go out before the stop
        await asyncio.to_thread(nats_server.restart)
        # An ack lost with the connection is waited for at most request_timeout_s, then retried.
        acks = await asyncio.wait_for(publishing, 40)
        assert len(acks) == 3000
        assert (await bus.js.stream_info("TASKS")).state.messages == 3000
    await bus.close()


async def test_close_after_the_server_is_gone_does_not_raise(nats_server: NatsServer) -> None:
    bus = await Bus.connect(nats_server.url, "leaving")
    await asyncio.to_thread(nats_server.stop)
    await until(lambda: not bus.nc.is_connected, what="the client to notice")
    await asyncio.wait_for(bus.close(), 15)
    assert bus.nc.is_closed


async def test_trace_context_travels_in_headers(nats_server: NatsServer) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    producer = await Bus.connect(nats_server.url, "gateway", tracer_provider=provider)
    worker = await Bus.connect(nats_server.url, "inference", tracer_provider=provider)
    with tracer.start_as_current_span("user request") as root:
        await producer.publish(task(1))
    got: list[Delivery] = []

    async def handle(d: Delivery) -> None:
        got.append(d)

    c = Consumer(worker, stream="TASKS", durable="c1", handler=handle)
    t = await running(c)
    await until(lambda: c.stats.acked == 1)
    c.stop()
    await t
    await producer.close()
    await worker.close()
    assert "traceparent" in got[0].headers
    spans = {s.name: s for s in exporter.get_finished_spans()}
    process = spans["process tasks.r1.echo"]
    assert process.context.trace_id == root.get_span_context().trace_id
    parent = spans["publish tasks.r1.echo"].parent
    assert parent is not None and parent.span_id == root.get_span_context().span_id


async def test_no_trace_headers_without_a_tracer_provider_and_content_type_only_for_msgpack(bus: Bus) -> None:
    assert bus.tracer is None
    assert bus.headers_for(task(1), events.JSON) == {"Nats-Msg-Id": "t1"}
    assert bus.headers_for(task(1), events.MSGPACK) == {"Nats-Msg-Id": "t1", "Content-Type": events.MSGPACK}


@pytest.mark.parametrize("reply", [
    "$JS.ACK.TASKS.c1.3.41.40.1700000000000000000.7",  # stream, consumer, delivered, stream seq, ...
    "$JS.ACK.hub.ACCHASH.TASKS.c1.3.41.40.1700000000000000000.7.t0k3n",  # with domain and account hash
    "$JS.ACK._.ACCHASH.TASKS.c1.3.41.40.1700000000000000000.7",  # the same without the final token
])
def test_delivery_counts_read_the_ack_subject_as_nats_py_does(reply: str) -> None:
    md = Msg(_client=None, reply=reply).metadata  # type: ignore[arg-type]  # no client: only the subject is read
    assert delivery_counts(reply) == (md.num_delivered, md.sequence.stream) == (3, 41)


async def test_publish_many_publishes_again_what_was_not_acknowledged_in_time(nats_server: NatsServer,
                                                                               monkeypatch) -> None:
    bus = await Bus.connect(nats_server.url, "producer", BusConfig(request_timeout_s=0.5))
    publish_async = bus.js.publish_async

    async def ack_of_t1_lost(subject: str, payload: bytes, headers: dict[str, str]) -> asyncio.Future:
        stored = await publish_async(subject, payload, headers=headers)
        return asyncio.get_running_loop().create_future() if headers["Nats-Msg-Id"] == "t1" else stored

    monkeypatch.setattr(bus.js, "publish_async", ack_of_t1_lost)
    acks = await asyncio.wait_for(bus.publish_many([task(0), task(1), task(2)]), 10)
    # t1 was stored, its ack never came: published again after request_timeout_s, kept once.
    assert [a.seq for a in acks] == [1, 2, 3] and [a.duplicate for a in acks] == [None, True, None]
    assert (await bus.js.stream_info("TASKS")).state.messages == 3
    await bus.close()


async def test_an_internal_error_is_logged_and_frees_its_slot(bus: Bus, monkeypatch, caplog) -> None:
    await bus.publish(task(1))
    handled: list[str] = []

    async def handle(d: Delivery) -> None:
        handled.append(d.event.id)

    c = Consumer(bus, stream="TASKS", durable="c1", handler=handle)
    ack = c._ack

    async def first_ack_fails(m: Msg) -> None:
        if handled == ["t1"]:
            raise ConnectionResetError("connection lost while acking")
        await ack(m)

    monkeypatch.setattr(c, "_ack", first_ack_fails)
    t = await running(c)
    await until(lambda: "internal error" in caplog.text, what="the failed ack logged")
    assert c._in_flight == 0  # its slot is free again
    await bus.publish(task(2))
    await until(lambda: c.stats.acked == 1, what="the next task")
    c.stop()
    await t
    assert handled == ["t1", "t2"]
    assert c.stats.handed_back == 1  # t1, never acked, handed back on stop


@pytest.mark.parametrize("bad", [{"handler": None, "batch_handler": None}, {"stream": "NOPE"}, {"max_deliver": 0}])
async def test_consumer_config_errors_name_the_field(bus: Bus, bad: dict) -> None:
    async def h(d: Delivery) -> None: ...

    kwargs = {"stream": "TASKS", "durable": "x", "handler": h} | bad
    with pytest.raises(ValueError) as err:
        Consumer(bus, **kwargs)
    assert any(k in str(err.value) for k in ("handler", "stream", "max_deliver"))


async def test_every_publish_refuses_what_the_server_would_drop_the_connection_for(bus: Bus) -> None:
    # Over max_payload (headers included) the server closes the publisher's connection; the bus
    # says so first, naming the event, and sends nothing of a batch holding one.
    limit = bus.nc.max_payload
    big = msgspec.structs.replace(task(2), data={"text": "x" * limit})
    with pytest.raises(PayloadTooLarge, match=r"event 't2' on tasks\.r1\.echo is \d+ bytes as published") as refused:
        await bus.publish(big)
    assert refused.value.size > refused.value.limit == limit
    with pytest.raises(PayloadTooLarge):
        await bus.publish_many([task(1), big, task(3)])
    with pytest.raises(PayloadTooLarge):
        await bus.publish_raw("tasks.r1.echo", b"x" * (limit - 10), {"Nats-Msg-Id": "raw" * 10})
    with pytest.raises(PayloadTooLarge):
        bus.check_fits(big)
    assert bus.nc.is_connected
    await bus.publish(task(4))  # the connection is the same one, and nothing of the refused batch was stored
    assert [t.id for t in await read_stream(bus, "TASKS", events.Task)] == ["t4"]


async def test_a_near_limit_payload_is_dead_lettered_bounded_and_the_consumer_goes_on(bus: Bus) -> None:
    # Just under the server's max payload: a dead letter carrying it whole could not be published.
    limit = bus.nc.max_payload
    await bus.publish_raw("tasks.r1.echo", b"\xff" * (limit - 4096), {"Nats-Msg-Id": "huge"})
    await bus.publish(task(1))
    handled: list[str] = []

    async def handle(d: Delivery) -> None:
        handled.append(d.event.id)

    c = Consumer(bus, stream="TASKS", durable="c1", handler=handle, event_type=events.Task)
    t = await running(c)
    [letter] = await dead_letters(bus, 1)
    await until(lambda: handled == ["t1"], what="the good task after the huge one")
    c.stop()
    await t
    assert letter.stream_seq == 1 and letter.payload_size_bytes == limit - 4096
    assert 0 < len(letter.payload) <= 16 * 1024 and len(events.encode(letter)) < 64 * 1024
    info = await bus.js.consumer_info("TASKS", "c1")
    assert info.num_ack_pending == 0 and info.num_pending == 0  # terminated, not left unacked


async def test_an_event_on_another_subject_or_of_another_type_is_dead_lettered(bus: Bus) -> None:
    # A valid task for run r2 published on run r1's subject, and a score on the tasks subject.
    await bus.publish_raw("tasks.r1.echo", events.encode(task(1, run="r2")), {"Nats-Msg-Id": "moved"})
    score = events.Score(run="r1", env="echo", rollout_id="x", group_id="g", scorer="s", value=1.0)
    await bus.publish_raw("tasks.r1.echo", events.encode(score), {"Nats-Msg-Id": "score"})
    await bus.publish(task(2))
    handled: list[str] = []

    async def handle(d: Delivery) -> None:
        handled.append(d.event.id)

    c = Consumer(bus, stream="TASKS", durable="c1", handler=handle, event_type=events.Task)
    t = await running(c)
    letters = await dead_letters(bus, 2)
    await until(lambda: handled == ["t2"], what="the good task")
    c.stop()
    await t
    reasons = sorted(letter.reason for letter in letters)
    assert "'tasks.r2.echo' was published on 'tasks.r1.echo'" in reasons[0], reasons
    assert "does not decode as Task" in reasons[1], reasons


async def test_a_dead_letter_that_cannot_be_published_still_frees_the_message(bus: Bus, monkeypatch) -> None:
    import nats.errors

    from flywheel.contract import bus as bus_module

    await bus.publish_raw("tasks.r1.echo", b"junk", {"Nats-Msg-Id": "junk"})
    original = bus.publish

    async def refuse_dead_letters(event: events.Event, content_type: str = events.JSON):
        if isinstance(event, events.DeadLetter):
            raise nats.errors.MaxPayloadError()
        return await original(event, content_type)

    monkeypatch.setattr(bus, "publish", refuse_dead_letters)

    async def handle(d: Delivery) -> None: ...

    c = Consumer(bus, stream="TASKS", durable="c1", handler=handle, event_type=events.Task)
    t = await running(c)
    await until(lambda: c.stats.dead_lettered == 1, what="the junk message terminated")
    c.stop()
    await t
    info = await bus.js.consumer_info("TASKS", "c1")
    assert info.num_ack_pending == 0 and info.num_pending == 0
    assert bus_module.DEAD_LETTER_EXCERPT_BYTES < bus.nc.max_payload


async def test_watch_skips_and_dead_letters_what_does_not_decode(bus: Bus) -> None:
    from flywheel.contract.bus import watch

    update = events.WeightUpdate(run="r1", version=1, uri="nats-os://b/x", sha256="0" * 64, size_bytes=1)
    await bus.publish_raw("weights.r1", b"\x00garbage", {"Nats-Msg-Id": "g1"})
    await bus.publish_raw("weights.r1", events.encode(task(1)), {"Nats-Msg-Id": "g2"})  # another type
    await bus.publish(update)
    stopping = asyncio.Event()
    seen = []
    for _ in range(2):  # a second watcher (a replica, a restart) dead-letters under the same ids
        async for event in watch(bus, "weights.>", events.WeightUpdate, stopping, watcher="test-watch"):
            seen.append(event)
            break
    assert [e.version for e in seen] == [1, 1]
    letters = await dead_letters(bus, 2)
    assert {letter.id for letter in letters} == {"WEIGHTS.1.test-watch", "WEIGHTS.2.test-watch"}
    assert (await bus.js.stream_info("DEAD")).state.messages == 2


async def test_update_run_keeps_concurrent_writers_fields(bus: Bus) -> None:
    from flywheel.contract.runs import register_run, update_run

    await register_run(bus, "r1")

    async def steps() -> None:
        for step in range(1, 21):
            await update_run(bus, "r1", trainer_step=step)

    async def leases() -> None:
        for i in range(20):
            await update_run(bus, "r1", owner=f"owner-{i}")

    await asyncio.gather(steps(), leases())
    from flywheel.contract.runs import get_run

    state = await get_run(bus, "r1")
    assert state is not None and state.trainer_step == 20 and state.owner == "owner-19"


async def test_watch_runs_and_heartbeats_skip_entries_that_do_not_decode(bus: Bus) -> None:
    from flywheel.contract.runs import BadRunState, get_run, register_run, watch_runs
    from flywheel.contract.service import read_heartbeats

    await (await bus.runs_kv()).put("broken", b"not a run state")
    await register_run(bus, "good")
    await (await bus.services_kv()).put("x.y", b"[1, 2]")
    seen: list[str] = []
    stopping = asyncio.Event()

    async def on_state(state: events.RunState) -> None:
        seen.append(state.id)
        stopping.set()

    await asyncio.wait_for(watch_runs(bus, stopping, on_state), 10)
    assert seen == ["good"]
    assert await read_heartbeats(bus) == []
    with pytest.raises(BadRunState, match="'broken'"):
        await get_run(bus, "broken")


async def test_a_run_state_that_does_not_decode_is_said_once_however_often_the_runs_are_listed(
        bus: Bus, caplog: pytest.LogCaptureFixture) -> None:
    from flywheel.contract.runs import list_runs, register_run

    await (await bus.runs_kv()).put("garbled", b"not a run state")
    await register_run(bus, "fine")
    with caplog.at_level("WARNING", logger="flywheel.contract.runs"):
        for _ in range(5):  # as the orchestrator lists them, every second
            assert [s.id for s in await list_runs(bus)] == ["fine"]
    said = [r for r in caplog.records if "'garbled'" in r.getMessage()]
    assert len(said) == 1 and "said once" in said[0].getMessage()


async def test_listing_runs_and_heartbeats_misses_none_while_one_is_rewritten(bus: Bus) -> None:
    # nats-py's KeyValue.keys() ends its walk early while a key is rewritten (it returned no
    # keys at all here); runs and heartbeats are rewritten every few seconds.
    from flywheel.contract.runs import list_runs, register_run, update_run
    from flywheel.contract.service import read_heartbeats

    for run in ("a", "b", "c"):
        await register_run(bus, run)
    services = await bus.services_kv()
    beat = events.ServiceHeartbeat(service="scorer", instance="1", pid=1, host="h", status="ok",
                                   started_at=events.utc_now())
    for instance in ("1", "2", "3"):
        await services.put(f"scorer.{instance}", events.encode(msgspec.structs.replace(beat, instance=instance)))
    await services.put("scorer.gone", events.encode(beat))
    await services.delete("scorer.gone")
    stopping = asyncio.Event()

    async def rewrite() -> None:
        step = 0
        while not stopping.is_set():
            step += 1
            await update_run(bus, "b", trainer_step=step)
            await services.put("scorer.2", events.encode(msgspec.structs.replace(beat, instance="2")))

    writer = asyncio.ensure_future(rewrite())
    try:
        for _ in range(50):
            assert sorted(s.id for s in await list_runs(bus)) == ["a", "b", "c"]
            assert [b.instance for b in await read_heartbeats(bus)] == ["1", "2", "3"]
    finally:
        stopping.set()
        await writer
    assert await bus.kv_keys("flywheel-services") == ["scorer.1", "scorer.2", "scorer.3", "scorer.gone"]
    with pytest.raises(nats.js.errors.BucketNotFoundError):
        await bus.kv_keys("no-such-bucket")


async def test_a_subject_the_server_refuses_fails_at_once_naming_it_and_the_user(tmp_path) -> None:
    """A user whose permissions lack a subject: its publish there is refused by the server (which
    only says so on the side, the ack never comes); the bus raises PermissionDenied after the
    first wait for the ack instead of retrying until publish_timeout_s, and what it may publish
    still goes through."""
    from flywheel.contract.bus import PermissionDenied

    config = """authorization {
      users = [
        {user: admin, password: admin-secret}
        {user: scorer, password: scorer-secret,
         permissions: {publish: {allow: [">"], deny: ["weights.>", "tasks.denied.>"]}, subscribe: {allow: [">"]}}}
      ]
    }"""
    server = NatsServer(tmp_path / "nats", config=config).start()
    try:
        admin = await Bus.connect(f"nats://admin:admin-secret@{server.host}:{server.port}", "admin")
        scorer = await Bus.connect(f"nats://scorer:scorer-secret@{server.host}:{server.port}", "scorer",
                                   BusConfig(publish_timeout_s=30, request_timeout_s=1), ensure=False)
        try:
            started = time.monotonic()
            with pytest.raises(PermissionDenied, match=r"user 'scorer' the publish to 'weights\.r1'"):
                await scorer.publish_raw("weights.r1", b"{}", {"Nats-Msg-Id": "w1"})
            with pytest.raises(PermissionDenied, match=r"user 'scorer' the publish to 'tasks\.denied\."):
                await scorer.publish_many([task(i, run="denied") for i in range(3)])
            assert time.monotonic() - started < 10  # not publish_timeout_s of retries each
            assert len(await scorer.publish_many([task(i) for i in range(3)])) == 3
            assert (await admin.js.stream_info("TASKS")).state.messages == 3
            assert (await admin.js.stream_info("WEIGHTS")).state.messages == 0
        finally:
            await scorer.close()
            await admin.close()
    finally:
        server.stop()


async def test_a_durable_deleted_under_its_consumer_is_made_again_and_nothing_is_lost(bus: Bus) -> None:
    seen: list[str] = []

    async def handle(d: Delivery) -> None:
        seen.append(d.event.id)

    await bus.publish(task(1))
    c = Consumer(bus, stream="TASKS", durable="gone", handler=handle, event_type=events.Task)
    t = await running(c)
    await until(lambda: seen == ["t1"], what="the first task")
    await bus.js.delete_consumer("TASKS", "gone")  # by hand, as `nats consumer rm` does
    await bus.publish(task(2))
    await until(lambda: "t2" in seen, timeout_s=10, what="a task published after the durable was deleted")
    assert c.stats.recreated == 1
    assert (await bus.js.consumer_info("TASKS", "gone")).config.durable_name == "gone"
    # Made again from the stream's first message, as first made: t1 comes again (at least once).
    assert seen.count("t2") == 1 and set(seen) == {"t1", "t2"}
    # One that takes only new messages goes on from when it was last seen alive: nothing skipped.
    fresh: list[str] = []

    async def handle_new(d: Delivery) -> None:
        fresh.append(d.event.id)

    n = Consumer(bus, stream="TASKS", durable="new-only", handler=handle_new, event_type=events.Task,
                 deliver_new_only=True)
    tn = await running(n)
    await until(lambda: n.created is not None, what="the second durable")
    await bus.publish(task(3))
    await until(lambda: fresh == ["t3"], what="a new task")
    await bus.js.delete_consumer("TASKS", "new-only")
    await bus.publish(task(4))
    await until(lambda: "t4" in fresh, timeout_s=10, what="the task published while it was gone")
    assert "t1" not in fresh and n.stats.recreated == 1
    for consumer, running_task in ((c, t), (n, tn)):
        consumer.stop()
        await running_task


async def test_a_consumer_started_while_the_bus_is_away_waits_for_it_and_says_so(
        nats_server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    """A service that starts while the bus does not answer (a loaded machine, a server
    restarting) waits past its retry budget for its consumer, saying so once: it never exits."""
    caplog.set_level(logging.INFO, logger="flywheel.contract.bus")
    bus = await Bus.connect(nats_server.url, "late", BusConfig(publish_timeout_s=0.5))
    seen: list[str] = []

    async def handle(d: Delivery) -> None:
        seen.append(d.event.id)

    await asyncio.to_thread(nats_server.stop)
    c = Consumer(bus, stream="TASKS", durable="late", handler=handle)
    t = asyncio.ensure_future(c.run())
    await until(lambda: "the bus does not answer yet" in caplog.text, timeout_s=20, what="the wait said")
    assert not t.done()  # past publish_timeout_s, still waiting
    await asyncio.to_thread(nats_server.start)
    await until(lambda: "the bus answers; consuming" in caplog.text, timeout_s=30, what="the consumer made")
    await bus.publish(task(1))
    await until(lambda: len(seen) == 1, timeout_s=30, what="the task consumed")
    c.stop()
    await t
    await bus.close()
