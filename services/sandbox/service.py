"""The sandbox service on NATS: request/reply on ``sandbox.*``, and its composition root.

``sandbox.create``, ``sandbox.run`` and ``sandbox.build`` are served in the queue group
``sandbox``, so replicas share new sandboxes (replicas that build images share one engine);
the other operations arrive on ``sandbox.<instance>.<op>``, the replica that holds the
sandbox (its id names it). Every request is handled in its own
task, so a long exec never holds up other sandboxes; one sandbox runs one request at a time.

A request that cannot be done gets an :class:`~flywheel.sdk.sandbox.ErrorReply` naming what
is wrong (a field that does not validate, a spec asking for network the service does not
allow, an unknown or expired sandbox, a file over the limit, the caps, too many requests in
flight) and the service keeps serving. On SIGTERM it stops taking requests, destroys every
sandbox it holds (requests in flight then answer kind ``gone``) and leaves.

Metering: a sandbox labelled with a run (``flywheel-run``: a rollout's sandbox session is)
is a :class:`~flywheel.contract.events.Usage` of source ``sandbox`` once it is destroyed,
however that happens: its seconds alive, and its rollout.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.aio.msg import Msg

from flywheel.contract import events
from flywheel.contract.bus import Bus
from flywheel.contract.service import Service
from flywheel.contract.settings import Settings
from flywheel.sdk.sandbox import (
    POOLED_OPS,
    QUEUE_GROUP,
    REQUEST_TYPES,
    ROLLOUT_LABEL,
    RUN_LABEL,
    SERVICE_NAME,
    ErrorReply,
    SandboxError,
    encode,
    subject,
)
from flywheel_sandbox.backend_docker import DockerBackend, DockerConfig
from flywheel_sandbox.backends import LocalBackend, LocalConfig, python_path
from flywheel_sandbox.sessions import ManagerConfig, Session, SessionManager

log = logging.getLogger(__name__)


class SandboxResponder:
    """Subscribes to the ``sandbox.*`` subjects and answers each request from the manager."""

    def __init__(self, bus: Bus, manager: SessionManager, max_in_flight: int) -> None:
        """``max_in_flight``: requests handled at once (setting ``sandbox.max_requests_in_flight``);
        one more is answered kind ``capacity`` at once (memory stays bounded under a flood)."""
        self.bus = bus
        self.manager = manager
        self.max_in_flight = max_in_flight
        self.decoders = {op: msgspec.json.Decoder(t) for op, t in REQUEST_TYPES.items()}
        self.handlers: dict[str, Callable[[Any], Awaitable[msgspec.Struct]]] = {
            "create": lambda r: manager.create(r.spec, r.idempotency_key),
            "run": manager.run,
            "exec": manager.exec,
            "write_file": manager.write_file,
            "read_file": manager.read_file,
            "destroy": lambda r: manager.destroy(r.id),
            "destroy_by_label": lambda r: manager.destroy_by_label(r.labels),
            "build": manager.build,
        }
        self.in_flight: set[asyncio.Task[None]] = set()
        manager.on_destroyed = self.meter
        self.num_requests = 0
        self.ready = asyncio.Event()  # set once every subject is subscribed

    async def serve(self, stopping: asyncio.Event) -> None:
        subs = []
        for op in REQUEST_TYPES:
            queue = QUEUE_GROUP if op in POOLED_OPS else ""
            subs.append(await self.bus.nc.subscribe(subject(op, self.manager.instance), queue=queue,
                                                    cb=self._callback(op)))
        await self.bus.nc.flush()
        self.ready.set()
        log.info("sandbox: serving on sandbox.{%s} and sandbox.%s.*", ",".join(POOLED_OPS), self.manager.instance)
        await stopping.wait()
        for sub in subs:
            await sub.unsubscribe()
        await self.drain()  # answered before the bus closes: the manager is destroying their sandboxes

    async def drain(self) -> None:
        """Wait for requests in flight (after the manager destroyed their sandboxes, they end soon),
        and for the usage of the sandboxes destroyed to be on the bus."""
        await asyncio.gather(*self.in_flight, return_exceptions=True)
        await self.bus.wait_published()

    def meter(self, session: Session, seconds: float) -> None:
        """Publish a destroyed sandbox's seconds, if a run is named on it (off the request's path; a
        publish that fails is logged, naming the run and the sandbox)."""
        run = session.spec.labels.get(RUN_LABEL)
        if not run:
            return
        usage = events.Usage(id=f"sandbox.{session.id}", run=run, source="sandbox", sandbox_s=round(seconds, 3),
                             rollout_id=session.spec.labels.get(ROLLOUT_LABEL))
        self.bus.publish_soon(usage, f"the usage of sandbox {session.id} of run {run} ({seconds:.1f} s)")

    def _callback(self, op: str) -> Callable[[Msg], Awaitable[None]]:
        async def on_message(msg: Msg) -> None:
            if len(self.in_flight) >= self.max_in_flight:
                busy = ErrorReply(kind="capacity", error=f"{self.max_in_flight} requests are in flight on this sandbox "
                                                         "service: retry later, or run more replicas")
                if msg.reply:
                    await msg.respond(encode(busy))
                return
            task = asyncio.ensure_future(self.handle(op, msg))
            self.in_flight.add(task)
            task.add_done_callback(self.in_flight.discard)

        return on_message

    async def handle(self, op: str, msg: Msg) -> None:
        self.num_requests += 1
        try:
            request = self.decoders[op].decode(msg.data)
            reply: msgspec.Struct = await self.handlers[op](request)
        except msgspec.ValidationError as exc:
            reply = ErrorReply(kind="invalid_request", error=f"{op}: {exc}")
        except msgspec.DecodeError as exc:
            expected = REQUEST_TYPES[op].__name__
            reply = ErrorReply(kind="invalid_request", error=f"{op}: the body is not a JSON {expected}: {exc}")
        except SandboxError as exc:
            reply = ErrorReply(kind=exc.kind, error=exc.error)
        except Exception as exc:  # a bug here must not stop the service: answer, log, keep serving
            log.exception("sandbox: %s failed", op)
            reply = ErrorReply(kind="internal", error=f"{op}: {type(exc).__name__}: {exc}")
        if msg.reply:
            await msg.respond(encode(reply))


def build_backend(settings: Settings) -> Any:
    """The backend named by setting ``sandbox_backend`` (its heavy imports only when chosen)."""
    if settings.sandbox_backend == "docker":
        return DockerBackend(DockerConfig(image=settings.sandbox_image, relay_dir=settings.sandbox_relay_dir))
    return LocalBackend(LocalConfig(python_path=python_path(settings.sandbox_python_path),
                                    relay_dir=settings.sandbox_relay_dir))


def manager_config(settings: Settings) -> ManagerConfig:
    """The session manager's caps, warm pool and network policy (flat settings ``sandbox_*``) and its
    limits (the settings' ``sandbox`` section)."""
    return ManagerConfig(max_alive=settings.sandbox_max_alive, max_starting=settings.sandbox_max_starting,
                         warm_pool=settings.sandbox_warm_pool, allow_network=settings.sandbox_allow_network,
                         limits=settings.sandbox)


async def run(settings: Settings) -> None:
    """Composition root: backend, bus, manager, responder, service; runs until a signal."""
    backend = build_backend(settings)
    bus = await Bus.for_settings(settings, SERVICE_NAME)
    service = Service(SERVICE_NAME, bus, info={"backend": backend.name,
                                               "allow_network": settings.sandbox_allow_network})
    manager = SessionManager(backend, service.instance, manager_config(settings))
    responder = SandboxResponder(bus, manager, settings.sandbox.max_requests_in_flight)
    service.add_task(responder.serve)
    service.add_task(manager.maintain)
    try:
        await service.run()
    finally:
        await backend.close()
