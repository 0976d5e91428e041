"""The recorder: every stream on the bus, written into the trace store.

One durable pull consumer per stream (``recorder-tasks``, ``recorder-rollouts``, ...), in
batch mode. The batches the bus hands over, from every stream, are written together
(:class:`GroupCommit`): a write waits ``linger_s`` for more, then takes everything that came
meanwhile in one :meth:`Store.record` call, so one transaction and one ``executemany`` per
table, however many events and messages it holds; each batch is acknowledged once its write
committed. Recording is idempotent, so a batch redelivered after a crash (the recorder is
killed between the write and the ack) changes nothing. A batch that fails is retried by the
bus layer, message by message; a message that keeps failing, or that can never be recorded
(an event without a time zone), goes to ``dead.<stream>``, which the recorder records too (a
dead letter is never dead-lettered again); it fails its own batch only, not those written
with it. Batch size, in-flight bound, ack wait and linger are the settings' ``recorder``
section (:class:`flywheel.contract.settings.RecorderSettings`).

The runs table mirrors the run-state KV bucket (:func:`mirror_runs`): a run's tenant is
whatever registered it said, not a default. Not covered: retention (the store keeps everything) and live viewers
(``GET /v1/traces/{rollout}/stream`` reads the bus itself, see :mod:`flywheel_gateway.api_traces`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import sqlalchemy as sa

from flywheel.contract import events
from flywheel.contract.bus import STREAMS, Bus, Consumer, Delivery, Reject, wait_at_most
from flywheel.contract.runs import watch_runs
from flywheel.contract.service import Service
from flywheel.contract.settings import RecorderSettings, Settings
from flywheel_gateway.migrate import migrate
from flywheel_gateway.store import Store, UnrecordableEvent

# What the trace store keeps: every stream (a teacher's signals without their top-k lists).
RECORDED_STREAMS = tuple(STREAMS)


@dataclass
class GroupCommit:
    """Batches of events written together: :meth:`record` returns once its batch is committed,
    in a transaction with whatever else came within ``linger_s`` of the first batch waiting (or
    until ``max_events`` wait). A batch that holds an event the store can never record fails
    alone: that write is done again batch by batch, so only its caller sees the error. Any
    other error (the database's) fails every batch of the write; each is retried by its caller."""

    store: Store
    linger_s: float
    max_events: int
    _waiting: list[tuple[list[events.Event], asyncio.Future[None]]] = field(default_factory=list)
    _num_waiting: int = 0
    _full: asyncio.Event = field(default_factory=asyncio.Event)
    _writes: set[asyncio.Task[None]] = field(default_factory=set)  # held: the loop keeps weak references

    async def record(self, batch: list[events.Event]) -> None:
        if self.linger_s <= 0:
            await self.store.record(batch)
            return
        done = asyncio.get_running_loop().create_future()
        if not self._waiting:
            write = asyncio.ensure_future(self._write_soon())
            self._writes.add(write)
            write.add_done_callback(self._writes.discard)
        self._waiting.append((batch, done))
        self._num_waiting += len(batch)
        if self._num_waiting >= self.max_events:
            self._full.set()
        await done

    async def _write_soon(self) -> None:
        await wait_at_most(self._full.wait(), self.linger_s)
        waiting, self._waiting, self._num_waiting = self._waiting, [], 0
        self._full.clear()
        try:
            await self.store.record([e for batch, _ in waiting for e in batch])
        except UnrecordableEvent:
            for batch, done in waiting:  # which one: each by itself (recording is idempotent)
                try:
                    await self.store.record(batch)
                except Exception as exc:
                    _settle(done, exc)
                else:
                    _settle(done, None)
        except Exception as exc:  # the database's: nothing is known written
            for _, done in waiting:
                _settle(done, exc)
        except BaseException:  # stopped mid-write
            for _, done in waiting:
                done.cancel()
            raise
        else:
            for _, done in waiting:
                _settle(done, None)


def _settle(done: asyncio.Future[None], error: Exception | None) -> None:
    if done.done():  # its caller gave up waiting (stopped): the write stands, nobody to tell
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)


def build(bus: Bus, store: Store, config: RecorderSettings,
          streams: Sequence[str] = RECORDED_STREAMS) -> list[Consumer]:
    """One durable batch consumer per stream of ``streams`` (every recorded stream, unless a test
    records fewer), all writing ``store`` through one :class:`GroupCommit`, batched as ``config`` says."""
    unknown = set(streams) - set(STREAMS)
    if unknown:
        raise ValueError(f"streams: {sorted(unknown)} are not Flywheel streams; choose from {sorted(STREAMS)}")
    writer = GroupCommit(store, config.linger_s, config.batch_size)

    async def record(deliveries: list[Delivery]) -> None:
        try:
            await writer.record([d.event for d in deliveries])
        except UnrecordableEvent as exc:
            # The bus layer retries the batch message by message, so only this one is rejected.
            raise Reject(str(exc)) from exc

    return [
        Consumer(bus, stream=stream, durable=f"recorder-{stream.lower()}", batch_handler=record,
                 batch_size=config.batch_size, max_in_flight=config.max_in_flight, ack_wait_s=config.ack_wait_s)
        for stream in streams
    ]


async def mirror_runs(bus: Bus, store: Store, stopping: asyncio.Event) -> None:
    """Keep the store's runs (tenant, kind) equal to the run-state bucket, which owns them,
    whoever registered the run (gateway, CLI, ``flywheel run``), until ``stopping``."""

    async def record(state: events.RunState) -> None:
        await store.upsert_runs([state])

    await watch_runs(bus, stopping, record)


async def run(settings: Settings) -> None:
    """Composition root of the recorder process: migrate, connect, consume until a signal, batched as the
    settings' ``recorder`` section says."""
    url = settings.resolved_database_url
    await migrate(url)
    store = Store.open(url)
    try:
        bus = await Bus.for_settings(settings, "recorder")
        database = sa.make_url(url).render_as_string(hide_password=True)
        service = Service("recorder", bus, info={"database": database})
        for consumer in build(bus, store, settings.recorder):
            service.add(consumer)
        service.add_task(functools.partial(mirror_runs, bus, store))
        await service.run()  # drains the bus when it stops
    finally:
        await store.close()

