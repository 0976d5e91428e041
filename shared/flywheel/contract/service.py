"""Process lifecycle for every service: signals, heartbeats, one shutdown path.

A service builds its parts (consumers, background tasks) in its composition root, adds
them to a :class:`Service`, and awaits :meth:`Service.run`. On SIGTERM or SIGINT the
service stops taking work (consumers stop pulling), finishes or hands back what is in
flight, removes its heartbeat and drains the NATS connection. The heartbeat is a key in
the services KV bucket (``<service>.<instance>``) that expires unless renewed, so
``flywheel status`` tells a live service from a dead one.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import os
import secrets
import signal
import socket
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import msgspec
import nats.errors
import nats.js.errors

from flywheel.contract import events, metrics
from flywheel.contract.bus import SERVICE_HEARTBEAT_TTL_S, SERVICES_BUCKET, Bus, Consumer, wait_at_most
from flywheel.contract.heap import freeze_heap

if TYPE_CHECKING:
    from flywheel.contract.settings import Settings

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = SERVICE_HEARTBEAT_TTL_S / 6


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: a line per model call of every rollout, with its
    # interception key in the URL. Its warnings and errors still show.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().getEffectiveLevel()))


def setup_torch_threads(num_threads: int | None) -> None:
    """Cap torch's intra-op threads (setting torch_threads); None leaves torch's default."""
    if num_threads is None:
        return
    import torch

    torch.set_num_threads(num_threads)


P = ParamSpec("P")
T = TypeVar("T")
# Its thread starts at the first call.
_COMPUTE_THREAD = ThreadPoolExecutor(1, thread_name_prefix="flywheel-compute")


async def compute(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run ``fn`` (model work: anything that calls torch) on the process's one compute thread,
    off the event loop, one call at a time in the order they come.

    PyTorch on CPU gives each OS thread that calls it a team of OpenMP threads, which live as
    long as that thread. Once a process holds more of them than it has cores, GNU OpenMP
    stops letting idle team threads spin between operations, and every operation pays to
    wake them: sampling SmolLM2-135M on 2 cores ran 33% slower while a second, idle thread
    had once called torch (``asyncio.to_thread`` keeps its threads). Every model call of a
    service goes through here, so a process has one team."""
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_COMPUTE_THREAD, call)


def setup_telemetry(service_name: str, settings: Settings) -> bool:
    """Serve Prometheus metrics on ``settings.metrics_port`` (:mod:`flywheel.contract.metrics`;
    unset: not served), and export traces as :func:`setup_tracing` says. Returns whether
    tracing is on."""
    try:
        metrics.serve(settings.metrics_port, settings.metrics_host)
    except OSError as exc:  # the service goes on without its figures; the log says why
        log.error("%s: %s", service_name, exc)
    return setup_tracing(service_name)


def setup_tracing(service_name: str) -> bool:
    """Export OpenTelemetry traces when the standard OTEL_* variables ask for it.

    With ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) set, spans go over
    OTLP/HTTP, and the bus carries trace context in message headers, so one trace spans
    every service a task passes through. Otherwise tracing stays off and costs nothing.
    Needs the ``telemetry`` extra. Returns whether tracing is on.
    """
    if not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return False
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"flywheel-{service_name}"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return True


def instance_name() -> str:
    """A name for this process among the instances of its service: host, pid, and a random part
    (two containers on the host network may both be pid 1 on one host name)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Service:
    """Runs consumers and background tasks until a signal, then shuts down once."""

    def __init__(self, name: str, bus: Bus, info: dict[str, Any] | None = None, handle_signals: bool = True) -> None:
        """``handle_signals=False`` when another server owns the signals (uvicorn):
        that server then calls :meth:`stop`."""
        self.name = name
        self.handle_signals = handle_signals
        self.bus = bus
        self.instance = instance_name()
        self.info = info or {}
        self.consumers: list[Consumer] = []
        self.tasks: list[Callable[[asyncio.Event], Awaitable[None]]] = []
        self.stopping = asyncio.Event()
        self.started_at = events.utc_now()

    def add(self, consumer: Consumer) -> Consumer:
        self.consumers.append(consumer)
        return consumer

    def add_task(self, fn: Callable[[asyncio.Event], Awaitable[None]]) -> None:
        """A background coroutine; it gets the stop event and must return once it is set."""
        self.tasks.append(fn)

    def stop(self) -> None:
        self.stopping.set()
        for c in self.consumers:
            c.stop()

    @property
    def key(self) -> str:
        return f"{self.name}.{self.instance}"

    async def beat(self, status: str = "ok") -> None:
        """Write the heartbeat now, with the current ``info`` (it is renewed every few seconds
        anyway; a process whose info just changed beats at once so readers see it)."""
        kv = await self.bus.services_kv()
        beat = events.ServiceHeartbeat(service=self.name, instance=self.instance, pid=os.getpid(),
                                       host=socket.gethostname(),
                                       status=status,  # type: ignore[arg-type]  # callers pass "ok", a Literal value
                                       started_at=self.started_at, info=self._info())
        await kv.put(self.key, events.encode(beat))

    def _info(self) -> dict[str, Any]:
        """``info`` (an entry that is a function: what it returns now), plus the port this process
        serves its Prometheus metrics on, if it does."""
        port = metrics.served_port()
        info = {key: value() if callable(value) else value for key, value in self.info.items()}
        return info if port is None else {**info, "metrics_port": port}

    async def _heartbeat(self) -> None:
        while not self.stopping.is_set():
            try:
                await self.beat("ok")
            except nats.errors.Error as exc:
                log.warning("%s: heartbeat failed: %s", self.name, exc)
            await wait_at_most(self.stopping.wait(), HEARTBEAT_INTERVAL_S)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT) if self.handle_signals else ()
        for sig in signals:
            loop.add_signal_handler(sig, self.stop)
        freeze_heap()  # the imports and the composition root's parts
        # a task may hold consumers of its own (the scorer's partitions): both counts are said
        log.info("%s: running (%d consumers, %d tasks)", self.name, len(self.consumers), len(self.tasks))
        workers = [asyncio.ensure_future(c.run()) for c in self.consumers]
        workers += [asyncio.ensure_future(fn(self.stopping)) for fn in self.tasks]
        beat = asyncio.ensure_future(self._heartbeat())
        stop_wait = asyncio.ensure_future(self.stopping.wait())
        try:
            done, _ = await asyncio.wait([*workers, stop_wait], return_when=asyncio.FIRST_COMPLETED)
            failed = [w for w in done if w is not stop_wait and not w.cancelled() and w.exception()]
            self.stop()
            await asyncio.gather(*workers, return_exceptions=True)
            if failed:
                raise failed[0].exception()  # type: ignore[misc]  # failed holds only tasks whose exception() is set
        finally:
            stop_wait.cancel()
            beat.cancel()
            for sig in signals:
                loop.remove_signal_handler(sig)
            try:
                kv = await self.bus.services_kv()
                await kv.delete(self.key)
            except nats.errors.Error:
                pass
            await self.bus.close()
            log.info("%s: stopped", self.name)


async def read_heartbeats(bus: Bus) -> list[events.ServiceHeartbeat]:
    """Every live service instance (expired heartbeats are gone from the bucket). An entry that
    is not a heartbeat (something else wrote the key) is logged and left out."""
    kv = await bus.services_kv()
    keys = await bus.kv_keys(SERVICES_BUCKET)
    decoder = events.Decoder(events.ServiceHeartbeat)
    beats = []
    for key in keys:
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            continue
        if not entry.value:
            continue
        try:
            beats.append(decoder.decode(entry.value))
        except msgspec.DecodeError as exc:  # ValidationError included
            log.warning("services bucket: key %r is not a service heartbeat (%s); skipped", key, exc)
    return sorted(beats, key=lambda b: (b.service, b.instance))
