"""The recorder: every stream on the bus, written into the trace store.

One durable pull consumer per stream (``recorder-tasks``, ``recorder-rollouts``, ...), in
batch mode: each batch the bus hands over is one :meth:`Store.record` call, so one
transaction and one ``executemany`` per table, however many events it holds. Recording is
idempotent, so a batch redelivered after a crash (the recorder is killed between the
write and the ack) changes nothing. A batch that fails is retried by the bus layer,
message by message; a message that keeps failing, or that can never be recorded (an
event without a time zone), goes to ``dead.<stream>``, which the recorder records too (a
dead letter is never dead-lettered again). Batch size, in-flight bound and ack wait are the
settings' ``recorder`` section (:class:`flywheel.contract.settings.RecorderSettings`).

The runs table mirrors the run-state KV bucket (:func:`mirror_runs`): a run's tenant is
whatever registered it said, not a default. Not covered: retention (the store keeps everything) and live viewers
(``GET /v1/traces/{rollout}/stream`` reads the bus itself, see :mod:`flywheel_gateway.api_traces`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence

import sqlalchemy as sa

from flywheel.contract import events
from flywheel.contract.bus import STREAMS, Bus, Consumer, Delivery, Reject
from flywheel.contract.runs import watch_runs
from flywheel.contract.service import Service
from flywheel.contract.settings import RecorderSettings, Settings
from flywheel_gateway.migrate import migrate
from flywheel_gateway.store import Store, UnrecordableEvent

# What the trace store keeps: every stream (a teacher's signals without their top-k lists).
RECORDED_STREAMS = tuple(STREAMS)


def build(bus: Bus, store: Store, config: RecorderSettings,
          streams: Sequence[str] = RECORDED_STREAMS) -> list[Consumer]:
    """One durable batch consumer per stream of ``streams`` (every recorded stream, unless a test
    records fewer), each writing ``store``, batched as ``config`` says."""
    unknown = set(streams) - set(STREAMS)
    if unknown:
        raise ValueError(f"streams: {sorted(unknown)} are not Flywheel streams; choose from {sorted(STREAMS)}")

    async def record(deliveries: list[Delivery]) -> None:
        try:
            await store.record([d.event for d in deliveries])
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

