"""The bus layer: JetStream streams, publishing and the one consumer loop every service uses.

What lives here, once:

- :data:`STREAMS` and :meth:`Bus.ensure`: the streams, the KV buckets (run state, service
  heartbeats, API keys, admission, scorer partitions) and the weights object store, created
  idempotently with file storage (a server restart loses nothing), by the operator alone (the
  stack's provisioning, the command line); a service's user finds them made
  (:meth:`Bus.require`: :class:`NotProvisioned` names one missing).
- :meth:`Bus.publish`: every publish carries ``Nats-Msg-Id`` (the event id), so a retry is
  stored once; transient failures (server restarting, no JetStream yet) are retried with
  backoff until ``publish_timeout_s``. OpenTelemetry context travels in the headers.
  :meth:`Bus.publish_many` with ``together`` sends the events
  of one subject as one batch message (see "Batches" in :mod:`flywheel.contract.events`).
- :class:`Consumer`: a durable pull consumer with bounded in-flight work (server-side
  ``max_ack_pending`` plus a local bound; its pull requests, one open at a time, answered on
  an inbox of its own, each message handed on as it arrives: :class:`_Pull`), ack on success,
  nak with backoff on a failure, ``in_progress`` while long work runs, and a dead letter on
  ``dead.<stream>`` (then term) after the last allowed delivery, or at once for a payload
  that does not decode, is not the consumer's event type, or was published on another
  subject than its own, or a handler that raises :class:`Reject`. ``stop()`` stops pulling, lets in-flight work finish
  for ``grace_s``, hands back (nak) what is left. A batch message's events reach the handler
  one :class:`Delivery` each, and the message is settled by their outcomes together
  (:meth:`Consumer._settle`).
- :class:`Replay`: an ordered consumer for readers that only look (a live trace viewer);
  :func:`watch` on top of it decodes, and skips (with a dead letter) what does not decode.
- :func:`dead_letter`: the one way a dead letter is made, bounded (a capped excerpt of the
  payload, the reason, the headers), so it can always be published, even for a message
  near the server's max payload.

Delivery is at least once: handlers must be idempotent (upsert by event id).
Not covered here: process signals and heartbeats (see :mod:`flywheel.contract.service`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    PubAck,
    RawStreamMsg,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from flywheel.contract import events, metrics, natsusers, retry
from flywheel.contract.retry import BUS_CONNECT, BUS_OPS, Backoff

if TYPE_CHECKING:
    from flywheel.contract.settings import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")
EventT = TypeVar("EventT", bound=events.Event)

# Stream name -> subjects. Subject layouts are part of the contract (see events.py).
STREAMS: dict[str, list[str]] = {
    "TASKS": ["tasks.>"],
    "ROLLOUTS": ["rollouts.>"],
    "TRACES": ["traces.>"],
    "SCORES": ["scores.>"],
    "SIGNALS": ["signals.>"],
    "WEIGHTS": ["weights.>"],
    "USAGE": ["usage.>"],
    "DEAD": ["dead.>"],
}
RUNS_BUCKET = "flywheel-runs"
SERVICES_BUCKET = "flywheel-services"
KEYS_BUCKET = "flywheel-keys"  # API keys by id (flywheel.contract.keys)
ADMISSION_BUCKET = "flywheel-admission"  # each run's issued rollouts over every inference replica
# Which replica of a scorer consumes which rollout partition, and which replicas are live: every
# entry is a lease its writer renews; the server removes one not renewed for PARTITION_LEASE_S.
PARTITIONS_BUCKET = "flywheel-partitions"
PARTITION_LEASE_S = 6.0
# Every run's weight versions, "<run>/<version>.safetensors" (see flywheel.contract.weights): one
# bucket made with the rest, since only the operator makes buckets; a purged version frees its
# disk wherever it is in the stream.
WEIGHTS_BUCKET = "flywheel-weights"
SERVICE_HEARTBEAT_TTL_S = 30.0
# KV bucket -> (history, ttl_s: None keeps keys until deleted)
BUCKETS: dict[str, tuple[int, float | None]] = {
    RUNS_BUCKET: (8, None), SERVICES_BUCKET: (1, SERVICE_HEARTBEAT_TTL_S), KEYS_BUCKET: (4, None),
    ADMISSION_BUCKET: (1, None), PARTITIONS_BUCKET: (1, PARTITION_LEASE_S)}

HEADER_MSG_ID = "Nats-Msg-Id"
HEADER_CONTENT_TYPE = "Content-Type"
# nats-py frames headers as "NATS/1.0\r\n", "key: value\r\n" each, then "\r\n".
_HEADER_FRAME_BYTES = len(b"NATS/1.0\r\n\r\n")

# A dead letter's bounds: it wraps a message that may be near the server's max payload
# (1 MiB by default), and must itself fit, whatever the original.
DEAD_LETTER_EXCERPT_BYTES = 16 * 1024
DEAD_LETTER_REASON_CHARS = 2000
DEAD_LETTER_HEADERS = 16
DEAD_LETTER_HEADER_CHARS = 256
WATCH_HEARTBEAT_S = 1.0  # idle heartbeat of a watch's ordered consumer
# Closing drains: a subscription's messages nobody will read (a watch left without being closed)
# would hold a process's exit for nats-py's default of 30 s; what matters is flushed in far less.
DRAIN_TIMEOUT_S = 5
MAX_DENIALS_KEPT = 64  # the server's latest refusals a connection remembers (Bus.check_denied)

_TRANSIENT_PUBLISH_ERRORS = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    asyncio.TimeoutError,
)


class NatsRefused(ConnectionError):
    """The NATS server refused the login (no user, or a user or password it does not know)."""


class NotProvisioned(ConnectionError):
    """A stream or bucket of the bus does not exist, and this connection's user may not make it."""


class PermissionDenied(PermissionError):
    """The NATS server refused this connection's user a subject (its permissions lack it): not
    transient, so not retried."""


NO_PEERS_FOR_PLACEMENT = 10005  # JetStream's error code: "no suitable peers for placement"
STREAM_EXISTS_OTHERWISE = 10058  # "stream name already in use with a different configuration"
_DENIED = re.compile(r"permissions violation for (publish|subscription) to \"?([^\"'\s]+)", re.IGNORECASE)


def stream_of(subject: str) -> str:
    """The stream that stores ``subject`` (by its first token)."""
    first = subject.split(".", 1)[0]
    for name, subjects in STREAMS.items():
        if any(s.split(".", 1)[0] == first for s in subjects):
            return name
    raise ValueError(f"subject {subject!r} belongs to no Flywheel stream; known prefixes: "
                     f"{', '.join(s[0].split('.')[0] for s in STREAMS.values())}")


def _log_retry(exc: BaseException, delay_s: float, num_failed: int) -> None:
    log.debug("bus: transient %s, retrying in %.2fs", type(exc).__name__, delay_s)


def _is_transient(exc: BaseException | None) -> bool:
    if isinstance(exc, _TRANSIENT_PUBLISH_ERRORS):
        return True
    # JetStream answers 503 while it is starting or has lost its meta leader; a cluster whose
    # nodes have not all met yet has no peers to place a replicated stream on (10005).
    return (isinstance(exc, nats.js.errors.ServiceUnavailableError)
            # (nats-py's KeyNotFoundError and kin are APIErrors built without an err_code)
            or (isinstance(exc, nats.js.errors.APIError) and getattr(exc, "err_code", None) == NO_PEERS_FOR_PLACEMENT))


ENSURE_RETRY_S = 1.0  # a consumer whose making timed out tries again after this long


@dataclass
class BusConfig:
    """How the bus connects and stores. Defaults suit one machine; raise limits deployed."""

    stream_max_age_s: float = 7 * 24 * 3600.0
    stream_max_bytes: int = -1
    duplicate_window_s: float = 120.0
    publish_timeout_s: float = 30.0
    request_timeout_s: float = 5.0
    max_publish_in_flight: int = 4000
    connect_timeout_s: float = 30.0
    # Copies of each stream, KV bucket and object store on a cluster's nodes (3 keeps every
    # one through a node's loss). None: as many as the streams already have, 1 for new ones,
    # so the services of a cluster the stack (or an operator) set up keep its replication.
    replicas: int | None = None


class PayloadTooLarge(nats.errors.MaxPayloadError, ValueError):
    """A message over the NATS server's max payload, refused before it was sent (the server would
    drop the connection that sent it): ``size`` bytes with its headers, ``limit`` the most."""

    def __init__(self, subject: str, msg_id: str | None, size: int, limit: int) -> None:
        super().__init__()
        self.subject, self.msg_id, self.size, self.limit = subject, msg_id, size, limit

    def __str__(self) -> str:
        what = f"event {self.msg_id!r}" if self.msg_id else "a message"
        return (f"{what} on {self.subject} is {self.size} bytes as published (payload and headers); the NATS server "
                f"takes at most {self.limit} (its max_payload)")


class Bus:
    """A connection to NATS plus JetStream, with Flywheel's streams ensured.

    Build with :meth:`connect`; close with :meth:`close` (drains). One per process.
    """

    def __init__(self, nc: NATS, config: BusConfig, tracer_provider: trace.TracerProvider | None = None) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream(timeout=config.request_timeout_s,
                                                publish_async_max_pending=config.max_publish_in_flight)
        self.config = config
        provider = tracer_provider or trace.get_tracer_provider()
        # Without a configured tracer provider there is no trace to carry: skip the
        # header work and spans entirely (about 10 us a message).
        self.tracer_provider = None if isinstance(provider, trace.ProxyTracerProvider) else provider
        self.tracer: trace.Tracer | None = (
            None if self.tracer_provider is None else self.tracer_provider.get_tracer("flywheel.contract.bus"))
        # publish_soon's publishes under way (held here: the loop keeps only weak references)
        self.soon: set[asyncio.Future[Any]] = set()
        self.denials: list[tuple[float, str, str]] = []  # what the server refused this connection, newest last
        self.user = "(no user)"  # the NATS user this connection logs in as, for messages
        self.replicas = config.replicas or 1  # what ensure() and weights_store(create=True) make (ensure reads it)

    @classmethod
    async def connect(cls, url: str, name: str, config: BusConfig | None = None, ensure: bool = True,
                      tracer_provider: trace.TracerProvider | None = None) -> Bus:
        """Connect (waiting up to ``connect_timeout_s`` for the server), then, with ``ensure``,
        make sure the streams and buckets are there: the operator (or a login the server does
        not restrict, or none) makes them (:meth:`ensure`); a service's user, which may not,
        finds them made (:meth:`require`)."""
        config = config or BusConfig()
        deadline = time.monotonic() + config.connect_timeout_s
        num_failed = 0
        connected = False
        last_error: BaseException | None = None
        denials: list[tuple[float, str, str]] = []  # (when, publish or subscription, subject) the server refused
        refused = asyncio.Event()  # the server refused the login

        async def on_error(exc: Exception) -> None:
            # Before the first connection a failure is expected (the server may be starting)
            # and ends in the ConnectionError below; once connected, each is worth a warning.
            nonlocal last_error
            last_error = exc
            if found := _DENIED.search(str(exc)):
                # The server says so and drops the message; the publish itself only times out
                # waiting for its ack, so the waiting op looks this up (Bus.retry).
                denials.append((time.monotonic(), found.group(1).lower(), found.group(2)))
                del denials[:-MAX_DENIALS_KEPT]
            if isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in str(exc).lower():
                refused.set()
            log.log(logging.WARNING if connected else logging.DEBUG, "nats: %s", exc)

        # The login goes as options: nats-py would send a URL's user and password still %-quoted.
        server, user, password = natsusers.split_login(url)
        login: dict[str, Any] = {"user": user, "password": password} if user is not None else {}
        # A service's user gets the server's deliveries and replies on its own inbox prefix only.
        login["inbox_prefix"] = natsusers.inbox_prefix(user)
        while True:
            # nats.connect retries a first connection forever (max_reconnect_attempts=-1): the
            # deadline is enforced here, and a refused login ends it at once (a retry cannot help).
            connecting = asyncio.ensure_future(nats.connect(
                server.split(","),
                name=name,
                connect_timeout=2,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.25,
                drain_timeout=DRAIN_TIMEOUT_S,
                error_cb=on_error,
                disconnected_cb=_log_disconnected,
                reconnected_cb=_log_reconnected,
                **login,
            ))
            refusal = asyncio.ensure_future(refused.wait())
            try:
                await asyncio.wait([connecting, refusal], timeout=max(deadline - time.monotonic(), 0.1),
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                refusal.cancel()
                if not connecting.done():
                    connecting.cancel()
                    await asyncio.gather(connecting, return_exceptions=True)
            if connecting.done() and not connecting.cancelled() and connecting.exception() is None:
                nc = connecting.result()
                connected = True
                break
            if refused.is_set():
                raise NatsRefused(
                    f"NATS at {natsusers.redacted(url)} refused the login"
                    + (f" of user {user!r}" if user else " (no user given)") + f": {last_error}. `flywheel up` runs "
                    "its nats-server with a user a service: give commands the data folder it was started with "
                    f"(--data-dir; {natsusers.USERS_FILE} there holds the operator's login), or nats_user and "
                    "nats_password (or a FLYWHEEL_NATS_URL with them) that the server knows")
            failure = None if connecting.cancelled() else connecting.exception()
            if failure is not None and not isinstance(failure, (nats.errors.NoServersError, OSError)):
                raise failure
            num_failed += 1
            delay_s = BUS_CONNECT.delay_s(num_failed)
            if time.monotonic() + delay_s > deadline:
                raise ConnectionError(f"cannot reach NATS at {natsusers.redacted(url)} within "
                                      f"{config.connect_timeout_s:g}s ({last_error or failure or 'timed out'}); is "
                                      "nats-server running? `flywheel up` starts one; FLYWHEEL_NATS_URL points "
                                      "elsewhere") from failure
            await asyncio.sleep(delay_s)
        bus = cls(nc, config, tracer_provider)
        bus.denials = denials
        bus.user = user or "(no user)"
        if ensure:
            await (bus.require() if user in natsusers.SERVICE_USERS else bus.ensure())
        return bus

    @classmethod
    async def for_settings(cls, settings: Settings, name: str) -> Bus:
        """A service's connection: its login from ``settings``, its streams made with
        ``nats_cluster`` replicas when that is above 1 (else as many as they already have)."""
        replicas = settings.nats_cluster if settings.nats_cluster > 1 else None
        return await cls.connect(settings.resolved_nats_url, name, BusConfig(replicas=replicas))

    async def ensure(self) -> None:
        """Create (or update) every stream, KV bucket and the weights object store, each with
        :attr:`replicas` copies: the operator's provisioning (a service's user may not). Idempotent."""
        given = self.config.replicas
        self.replicas = given if given is not None else await self.retry(self._existing_replicas)
        for name, subjects in STREAMS.items():
            cfg = StreamConfig(
                name=name,
                subjects=subjects,
                storage=StorageType.FILE,
                retention=RetentionPolicy.LIMITS,
                max_age=self.config.stream_max_age_s,
                max_bytes=self.config.stream_max_bytes,
                duplicate_window=self.config.duplicate_window_s,
                num_replicas=self.replicas,
            )
            await self.retry(functools.partial(self._ensure_stream, cfg))
        for bucket, (history, ttl) in BUCKETS.items():
            kv = KeyValueConfig(bucket=bucket, history=history, ttl=ttl, storage=StorageType.FILE,
                                replicas=self.replicas)
            await self.retry(functools.partial(self._ensure_bucket, kv))
        await self.retry(self._ensure_weights_store)

    async def require(self) -> None:
        """:class:`NotProvisioned` naming the first stream or bucket this connection's user works
        with (all of them for another user) that does not exist: a service's user may not make
        them, the operator's provisioning does (``flywheel up``; in a deployment before the
        services start, ``python -m flywheel.ops.provision``)."""
        granted = natsusers.GRANTS.get(self.user)
        prefix = f"{natsusers.API}.STREAM.INFO."
        names = ([g.removeprefix(prefix) for g in granted if g.startswith(prefix)] if granted is not None else
                 [*STREAMS, *(f"KV_{b}" for b in BUCKETS), f"OBJ_{WEIGHTS_BUCKET}"])
        found = await asyncio.gather(*(self.retry(functools.partial(self.js.stream_info, name)) for name in names),
                                     return_exceptions=True)  # at once: a service's start waits for these
        for name, info in zip(names, found, strict=True):
            if isinstance(info, nats.js.errors.NotFoundError):
                kind = ("KV bucket " + name[3:] if name.startswith("KV_") else "object store " + name[4:]
                        if name.startswith("OBJ_") else "stream " + name)
                raise NotProvisioned(
                    f"the NATS {kind} does not exist, and user {self.user!r} may not make it: the operator makes the "
                    "bus's streams and buckets (`flywheel up` does at start; a deployment runs `python -m "
                    "flywheel.ops.provision` as the operator first, as compose's nats-init service does)")
            if isinstance(info, BaseException):
                raise info

    async def _existing_replicas(self) -> int:
        """The replicas of the streams already there (1 when there are none yet)."""
        try:
            found = (await self.js.stream_info(next(iter(STREAMS)))).config.num_replicas
        except nats.js.errors.NotFoundError:
            return 1
        return found or 1

    async def _ensure_bucket(self, cfg: KeyValueConfig) -> None:
        try:
            await self.js.create_key_value(cfg)
        except nats.js.errors.BadRequestError as exc:
            # There with another config (its replicas, say): its stream brought to this one.
            if exc.err_code != STREAM_EXISTS_OTHERWISE:
                raise
            info = await self.js.stream_info(f"KV_{cfg.bucket}")
            info.config.num_replicas = cfg.replicas
            await self.js.update_stream(info.config)

    async def _ensure_weights_store(self) -> None:
        try:
            await self.js.create_object_store(WEIGHTS_BUCKET, ObjectStoreConfig(storage=StorageType.FILE,
                                                                                replicas=self.replicas))
        except nats.js.errors.BadRequestError as exc:
            # There with another config (its replicas): its stream brought to this one.
            if exc.err_code != STREAM_EXISTS_OTHERWISE:
                raise
            info = await self.js.stream_info(f"OBJ_{WEIGHTS_BUCKET}")
            info.config.num_replicas = self.replicas
            await self.js.update_stream(info.config)

    async def _ensure_stream(self, cfg: StreamConfig) -> None:
        try:
            await self.js.add_stream(cfg)
        except nats.js.errors.BadRequestError as exc:
            # Exists with a different config; bring it to ours.
            if exc.err_code != STREAM_EXISTS_OTHERWISE:
                raise
            await self.js.update_stream(cfg)

    async def runs_kv(self) -> KeyValue:
        return await self.retry(lambda: self.js.key_value(RUNS_BUCKET))

    async def keys_kv(self) -> KeyValue:
        return await self.retry(lambda: self.js.key_value(KEYS_BUCKET))

    async def services_kv(self) -> KeyValue:
        return await self.retry(lambda: self.js.key_value(SERVICES_BUCKET))

    async def admission_kv(self) -> KeyValue:
        return await self.retry(lambda: self.js.key_value(ADMISSION_BUCKET))

    async def partitions_kv(self) -> KeyValue:
        return await self.retry(lambda: self.js.key_value(PARTITIONS_BUCKET))

    async def kv_keys(self, bucket: str) -> list[str]:
        """Every key the KV bucket holds now, sorted (a deleted key stays listed until purged:
        reading it raises KeyDeletedError). One snapshot, the stream's subjects: nats-py's
        ``KeyValue.keys()`` walks a watcher that ends early, missing keys or all of them, while
        a key is rewritten (heartbeats and run leases are, every few seconds).
        Raises BucketNotFoundError when the bucket does not exist."""
        prefix = f"$KV.{bucket}."
        try:
            info = await self.retry(lambda: self.js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>"))
        except nats.js.errors.NotFoundError:
            raise nats.js.errors.BucketNotFoundError from None
        return sorted(subject.removeprefix(prefix) for subject in info.state.subjects or {})

    async def weights_store(self) -> ObjectStore:
        """The weights object store (:data:`WEIGHTS_BUCKET`)."""
        return await self.retry(lambda: self.js.object_store(WEIGHTS_BUCKET))

    # --- publishing ---------------------------------------------------------------------

    def headers_for(self, event: events.Event, content_type: str) -> dict[str, str]:
        # Few headers on purpose: nats-py builds and parses each one on every message, and
        # the server stores it. The event type is in the payload's ``type`` tag, and a
        # message without Content-Type is JSON (the contract's default), so only msgpack
        # names it: measured, a Content-Type on every JSON event cost several percent of
        # the bus layer's throughput.
        headers = {HEADER_MSG_ID: event.msg_id}
        if content_type != events.JSON:
            headers[HEADER_CONTENT_TYPE] = content_type
        if self.tracer is not None:
            propagate.inject(headers)
        return headers

    def tracer_of(self, name: str) -> trace.Tracer:
        """A tracer for a service's own spans (scoring, a training step), under the bus's tracer
        provider, so they join the traces the bus carries; a no-op one when tracing is off."""
        return trace.NoOpTracer() if self.tracer_provider is None else self.tracer_provider.get_tracer(name)

    def published_size(self, event: events.Event, content_type: str = events.JSON) -> int:
        """Bytes the NATS server counts against its max payload (``nc.max_payload``) for
        ``event``: payload and headers."""
        return _message_size(events.encode(event, content_type), self.headers_for(event, content_type))

    def check_fits(self, event: events.Event, content_type: str = events.JSON) -> None:
        """PayloadTooLarge when ``event`` is over the server's max payload: every publish checks
        this first (the one size guard); a producer that has a smaller thing to send instead
        (an error in place of what did not fit) asks here before publishing."""
        self._check_fits(event.subject(), events.encode(event, content_type), self.headers_for(event, content_type))

    def _check_fits(self, subject: str, payload: bytes, headers: dict[str, str]) -> None:
        size = _message_size(payload, headers)
        if size > self.nc.max_payload:
            raise PayloadTooLarge(subject, headers.get(HEADER_MSG_ID), size, self.nc.max_payload)

    async def publish(self, event: events.Event, content_type: str = events.JSON) -> PubAck:
        """Publish one event and wait for JetStream to store it (retried on transient errors)."""
        subject = event.subject()
        payload = events.encode(event, content_type)
        self._check_fits(subject, payload, self.headers_for(event, content_type))
        if self.tracer is None:
            headers = self.headers_for(event, content_type)
            ack = await self.retry(lambda: self.js.publish(subject, payload, headers=headers), subject)
        else:
            with self.tracer.start_as_current_span(f"publish {subject}", kind=trace.SpanKind.PRODUCER):
                headers = self.headers_for(event, content_type)
                ack = await self.retry(lambda: self.js.publish(subject, payload, headers=headers), subject)
        metrics.PUBLISHED.labels(ack.stream).inc()
        return ack

    def publish_soon(self, event: events.Event, what: str) -> None:
        """Publish ``event`` in the background, off the caller's path (a usage count beside a
        response): retried as :meth:`publish`; a failure is logged naming ``what`` (the event, for
        people), never raised. :meth:`wait_published` and :meth:`close` wait for them."""
        def done(task: asyncio.Future[PubAck]) -> None:
            self.soon.discard(task)
            if not task.cancelled() and task.exception() is not None:
                log.warning("bus: could not publish %s: %s", what, task.exception())

        task = asyncio.ensure_future(self.publish(event))
        self.soon.add(task)
        task.add_done_callback(done)

    async def wait_published(self) -> None:
        """Until what :meth:`publish_soon` started is on the bus or given up (each is bounded by
        ``publish_timeout_s``)."""
        if self.soon:
            await asyncio.wait(list(self.soon))

    async def publish_raw(self, subject: str, payload: bytes, headers: dict[str, str]) -> PubAck:
        """Publish bytes as they are (tools, tests, other-language bridges). Retried likewise."""
        self._check_fits(subject, payload, headers)
        return await self.retry(lambda: self.js.publish(subject, payload, headers=headers), subject)

    async def publish_many(self, batch: Iterable[events.Event], content_type: str = events.JSON,
                           together: bool = False) -> list[PubAck]:
        """Publish many events concurrently (bounded by ``max_publish_in_flight``); their acks, one
        an event, in order.

        ``together``: the events of one subject go as one batch message (see "Batches" in
        :mod:`flywheel.contract.events`; each of its events gets the batch's ack), unless the
        batch would not fit the server's max payload: those go one a message. Each message is
        acknowledged by JetStream before this returns; one whose publish fails transiently is
        published again with the same id (deduplicated by the server).
        """
        # subject, payload, headers, and the places in ``batch`` of the events it carries
        messages: list[tuple[str, bytes, dict[str, str], list[int]]] = []
        if together:
            by_subject: dict[str, list[tuple[int, events.Event]]] = {}
            for i, event in enumerate(batch):
                by_subject.setdefault(event.subject(), []).append((i, event))
            for subject, numbered in by_subject.items():
                members = [e for _, e in numbered]
                if len(members) > 1:
                    headers = self.headers_for(members[0], content_type)
                    headers[HEADER_MSG_ID] = events.batch_msg_id(members)
                    headers[events.BATCH_HEADER] = str(len(members))
                    payload = events.encode_many(members, content_type)
                    if self._fits(payload, headers):
                        messages.append((subject, payload, headers, [i for i, _ in numbered]))
                        continue
                messages += [(subject, events.encode(e, content_type), self.headers_for(e, content_type), [i])
                             for i, e in numbered]
        else:
            messages = [(e.subject(), events.encode(e, content_type), self.headers_for(e, content_type), [i])
                        for i, e in enumerate(batch)]
        for subject, payload, headers, _ in messages:  # all of them, before any is sent
            self._check_fits(subject, payload, headers)
        pending: list[tuple[str, bytes, dict[str, str], asyncio.Future[PubAck]]] = []
        started = time.monotonic()
        for subject, payload, headers, _ in messages:
            try:
                fut = await self.js.publish_async(subject, payload, headers=headers)
            except _TRANSIENT_PUBLISH_ERRORS + (nats.js.errors.TooManyStalledMsgsError,):
                fut = asyncio.get_running_loop().create_future()
                fut.set_exception(nats.errors.TimeoutError())
            pending.append((subject, payload, headers, fut))
        # An ack lost with a dropped connection never comes: wait request_timeout_s for the
        # acks, then publish again each one not acknowledged (same id, so the server keeps it
        # once). One wait for the batch: a wait_for per event cost a task and a timer each,
        # about a third of publish_many's own cost.
        if pending:
            try:
                await asyncio.wait([fut for *_, fut in pending], timeout=self.config.request_timeout_s)
            finally:
                # Giving up on an ack (or on all, when this is cancelled) frees its place in
                # nats-py's bound on unacknowledged publishes.
                for *_, fut in pending:
                    fut.cancel()
        if any(fut.cancelled() for *_, fut in pending):
            self.check_denied(started, [subject for subject, *_, fut in pending if fut.cancelled()])
        acks: dict[int, PubAck] = {}
        for (subject, payload, headers, fut), (*_, places) in zip(pending, messages, strict=True):
            if fut.cancelled() or _is_transient(fut.exception()):
                ack = await self.retry(functools.partial(self.js.publish, subject, payload, headers=headers), subject)
            else:
                ack = fut.result()  # raises what is not transient
            metrics.PUBLISHED.labels(ack.stream).inc()
            acks.update((i, ack) for i in places)
        return [acks[i] for i in range(len(acks))]

    def _fits(self, payload: bytes, headers: dict[str, str]) -> bool:  # a batch message, or one per event
        """Whether a message fits the server's max payload (headers count against it)."""
        return _message_size(payload, headers) <= self.nc.max_payload

    async def retry(self, op: Callable[[], Awaitable[T]], subject: str | None = None) -> T:
        """``op()``, tried again with backoff while it fails transiently (the server restarting,
        JetStream not ready, a timeout) until ``publish_timeout_s``; other errors propagate, and
        PermissionDenied when the server refused ``subject`` (None: anything) meanwhile."""
        async def attempt() -> T:
            started = time.monotonic()
            try:
                return await op()
            except Exception:
                self.check_denied(started, [subject] if subject is not None else ())
                raise

        return await retry.retry(attempt, BUS_OPS, transient=_is_transient, timeout_s=self.config.publish_timeout_s,
                                 on_retry=_log_retry)

    def check_denied(self, since: float, subjects: Iterable[str] = ()) -> None:
        """PermissionDenied, naming the subject and the user, when the server refused this
        connection one of ``subjects`` (none given: anything) since ``since``
        (``time.monotonic()``): what timed out then was refused, and trying again cannot help.
        (The client reads the server's word in lower case: a subject given is named as given.)"""
        given = {subject.lower(): subject for subject in subjects}
        refused = [(what, given.get(subject, subject)) for when, what, subject in self.denials
                   if when >= since and (not given or subject in given)]
        if refused:
            what, subject = refused[-1]
            raise PermissionDenied(
                f"NATS refused user {self.user!r} the {what} to {subject!r}: that user's permissions (in the "
                "server's config) lack the subject; a service publishing where it should not, or a user given "
                "too little")

    async def close(self) -> None:
        """Drain (let what was published and received finish), or just close when the server is
        gone already: shutting down must not fail because NATS did first."""
        if self.nc.is_closed:
            return
        await self.wait_published()
        try:
            await self.nc.drain()
        except (TimeoutError, nats.errors.ConnectionReconnectingError, nats.errors.ConnectionClosedError,
                nats.errors.TimeoutError) as exc:
            log.info("bus: drain failed (%s); closing", type(exc).__name__)
            await self.nc.close()


def _message_size(payload: bytes, headers: dict[str, str]) -> int:
    """Bytes of a message the NATS server counts against its max payload: payload and headers."""
    return len(payload) + _HEADER_FRAME_BYTES + sum(len(k.encode()) + len(v.encode()) + 4 for k, v in headers.items())


async def _log_disconnected() -> None:
    log.info("nats: disconnected")


async def _log_reconnected() -> None:
    log.info("nats: reconnected")


async def watch_bucket(kv: KeyValue, stopping: asyncio.Event) -> AsyncIterator[tuple[str, bytes]]:
    """``(key, value)`` for every key's current value in a KV bucket, then for every new value,
    until ``stopping`` (deleted keys are skipped). Values are bytes as stored: the caller
    decodes, and must survive a value that does not."""
    watcher = await kv.watchall()
    try:
        while not stopping.is_set():
            try:
                entry = await watcher.updates(timeout=0.5)
            except nats.errors.TimeoutError:
                continue
            if entry is not None and entry.value:  # None ends the initial values; empty: deleted
                yield entry.key, entry.value
    finally:
        await watcher.stop()


def dead_letter(*, stream: str, stream_seq: int, subject: str, consumer: str, num_delivered: int, reason: str,
                payload: bytes | None, headers: dict[str, str] | None,
                batch_index: int | None = None) -> events.DeadLetter:
    """The dead letter of one message (or of its event at ``batch_index``, whose ``payload`` is
    then that event alone), bounded whatever the message's size.

    Its id is ``<stream>.<stream_seq>.<consumer>`` (then ``.<batch_index>``): the same consumer
    dead-lettering the same message again (a watcher that restarted) publishes the same id,
    kept once."""
    payload = payload or b""
    if len(reason) > DEAD_LETTER_REASON_CHARS:
        reason = reason[:DEAD_LETTER_REASON_CHARS] + f"... ({len(reason)} characters)"
    kept = {k[:DEAD_LETTER_HEADER_CHARS]: str(v)[:DEAD_LETTER_HEADER_CHARS]
            for k, v in list((headers or {}).items())[:DEAD_LETTER_HEADERS]}
    letter_id = f"{stream}.{stream_seq}.{consumer}" + (f".{batch_index}" if batch_index is not None else "")
    return events.DeadLetter(
        id=letter_id, stream=stream, original_subject=subject[:DEAD_LETTER_HEADER_CHARS],
        consumer=consumer, num_delivered=num_delivered, reason=reason, payload=payload[:DEAD_LETTER_EXCERPT_BYTES],
        headers=kept, stream_seq=stream_seq, payload_size_bytes=len(payload), batch_index=batch_index)


async def publish_dead_letter(bus: Bus, letter: events.DeadLetter) -> bool:
    """Publish ``letter``; False (logged) when the bus refuses it for good. The original stays in
    its stream either way, so a consumer goes on after this, whatever it returns."""
    if letter.stream == "DEAD":  # a dead letter is never dead-lettered again
        return False
    try:
        await bus.publish(letter)
    except nats.errors.Error as exc:
        if _is_transient(exc):
            raise
        log.error("dead letter %s not published (%s: %s); the message stays in stream %s at sequence %d",
                  letter.id, type(exc).__name__, exc, letter.stream, letter.stream_seq)
        return False
    return True


class Undecodable(ValueError):
    """A message that is not the event its reader expects: it does not decode, is another
    event type, or names another subject than the one it was published on."""


def check_subject(event: EventT, subject: str) -> EventT:
    """``event`` with its numbers checked (:func:`flywheel.contract.events.checked`: a score, rollout
    or signal out of bounds comes back failed); Undecodable unless it belongs on ``subject`` (its
    own subject, from its fields) and, for other events, unless its numbers are in bounds."""
    own = event.subject()
    if own != subject:
        raise Undecodable(f"a {type(event).__name__} whose fields give the subject {own!r} was published on "
                          f"{subject!r}; publish each event on its own subject (see docs/events.md)")
    try:
        return events.checked(event)
    except events.OutOfBounds as exc:
        raise Undecodable(str(exc)) from None


def decode_message(decoder: events.Decoder[Any], msg: Msg | RawStreamMsg) -> Any:
    """The event in ``msg`` (delivered, or read from the stream), checked against its subject;
    :class:`Undecodable` with the reason."""
    # A stored message (RawStreamMsg) has every field optional: nats-py gives an empty payload as None.
    try:
        event = decoder.decode(msg.data or b"", (msg.headers or {}).get(HEADER_CONTENT_TYPE))
    except msgspec.DecodeError as exc:  # ValidationError included
        raise Undecodable(f"payload does not decode as {_type_name(decoder.type)}: {exc}") from None
    return check_subject(event, msg.subject or "")


def decode_events(decoder: events.Decoder[Any], msg: Msg | RawStreamMsg) -> list[Any]:
    """The events in ``msg``: its one event, or a batch's (a ``Flywheel-Batch`` header: an array of
    events of the message's subject, in order), each checked against its subject;
    :class:`Undecodable` with the reason."""
    headers = msg.headers or {}
    count = headers.get(events.BATCH_HEADER)
    if count is None:
        return [decode_message(decoder, msg)]
    try:
        batch = decoder.decode_many(msg.data or b"", headers.get(HEADER_CONTENT_TYPE))
    except msgspec.DecodeError as exc:  # ValidationError included
        raise Undecodable(f"batch payload does not decode as an array of {_type_name(decoder.type)}: {exc}") from None
    if not batch or count.strip() != str(len(batch)):
        raise Undecodable(f"a batch of {len(batch)} events whose {events.BATCH_HEADER} header says {count!r}: "
                          "a batch holds at least one event, and its header counts them")
    for i, event in enumerate(batch):
        try:
            batch[i] = check_subject(event, msg.subject or "")
        except Undecodable as exc:
            raise Undecodable(f"event {i} of the batch: {exc}") from None
    return batch


async def read_stream(bus: Bus, stream: str, event_type: Any = events.AnyEvent) -> list[Any]:
    """Every event ``stream`` holds now, in stream order (a batch's in its order), decoded: for
    tools, audits and tests that look at a whole stream, one request a message. A message that
    does not decode raises :class:`Undecodable` naming its sequence."""
    decoder: events.Decoder[Any] = events.Decoder(event_type)
    state = (await bus.js.stream_info(stream)).state
    out: list[Any] = []
    for seq in range(state.first_seq, state.last_seq + 1) if state.messages else ():
        try:
            msg = await bus.js.get_msg(stream, seq)
        except nats.js.errors.NotFoundError:  # deleted from the middle of the stream
            continue
        try:
            out += decode_events(decoder, msg)
        except Undecodable as exc:
            raise Undecodable(f"{stream} message {seq}: {exc}") from None
    return out


def delivery_counts(reply: str) -> tuple[int, int]:
    """``(num_delivered, stream_seq)`` of a JetStream delivery, from its ack subject.

    What ``Msg.metadata`` gives, without the rest of its work (a datetime and two frozen
    dataclasses: about 8 us a message, measured). The layouts are those nats-py reads:
    ``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>``,
    or with ``<domain>.<account hash>`` after ``ACK`` (11 or 12 tokens)."""
    tokens = reply.split(".")
    if len(tokens) == 9:
        return int(tokens[4]), int(tokens[5])
    return int(tokens[Msg.Ack.NumDelivered]), int(tokens[Msg.Ack.StreamSeq])


def _type_name(type_: Any) -> str:
    return getattr(type_, "__name__", None) or " | ".join(getattr(t, "__name__", str(t))
                                                         for t in getattr(type_, "__args__", ()))


class Replay:
    """An ordered consumer for readers that only look (live viewers): every message stored
    on ``subject`` from the start (or from ``start_time``), then each new one, in stream
    order. Ephemeral, unacknowledged, held in memory on the server; ``headers_only`` leaves
    the payloads on the server (read one with ``js.get_msg``). Use as ``async with``:
    leaving unsubscribes (the server then drops the consumer), even when the reader is being
    cancelled.
    """

    _closing: ClassVar[set[asyncio.Task[None]]] = set()  # cleanups that outlive a cancelled reader

    def __init__(self, bus: Bus, subject: str, *, start_time: Any = None, headers_only: bool = False) -> None:
        self.bus = bus
        self.subject = subject
        self.config = ConsumerConfig(
            deliver_policy=DeliverPolicy.ALL if start_time is None else DeliverPolicy.BY_START_TIME,
            opt_start_time=start_time, headers_only=headers_only or None)
        self._sub: Any = None

    async def __aenter__(self) -> Replay:
        self._sub = await self.bus.js.subscribe(self.subject, stream=stream_of(self.subject), config=self.config,
                                                ordered_consumer=True)
        # nats-py recreates a reset ordered consumer from this config by start sequence,
        # which the server refuses alongside a start time.
        self.config.opt_start_time = None
        return self

    async def next(self) -> Msg:
        """The next message, waiting as long as it takes."""
        return await self._sub.next_msg(timeout=None)

    async def __aexit__(self, *exc_info: object) -> None:
        cleanup = asyncio.ensure_future(self._close(self._sub))
        Replay._closing.add(cleanup)
        cleanup.add_done_callback(Replay._closing.discard)
        await asyncio.shield(cleanup)

    async def _close(self, sub: Any) -> None:
        # The server drops an ordered consumer seconds after its last subscriber left: no
        # delete (which would need a permission to delete the stream's other consumers too).
        await sub.unsubscribe()


def num_events(msg: Msg | RawStreamMsg) -> int:
    """How many events ``msg`` holds, from its headers alone (a batch's count, else one)."""
    count = (msg.headers or {}).get(events.BATCH_HEADER)
    return 1 if count is None else int(count)


class EventCount:
    """How many events ``stream`` holds on ``subject`` (a filter): its messages, a batch counting
    its events. Counted from the messages' headers (the server sends no payloads), and kept:
    each :meth:`now` reads only the messages stored since the last one."""

    def __init__(self, bus: Bus, stream: str, subject: str) -> None:
        self.bus = bus
        self.stream = stream
        self.subject = subject
        self.num_messages = 0  # counted so far
        self.total = 0  # their events
        self.last_seq = 0  # the last one counted
        self._lock = asyncio.Lock()  # one count at a time: two would count the new messages twice

    async def now(self) -> int:
        async with self._lock:
            info = await self.bus.retry(lambda: self.bus.js.stream_info(self.stream, subjects_filter=self.subject))
            new = sum((info.state.subjects or {}).values()) - self.num_messages
            if new <= 0:  # nothing new (or the stream's limits removed old ones: what was counted stays)
                return self.total
            config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.last_seq + 1,
                                    headers_only=True)
            sub = await self.bus.js.subscribe(self.subject, stream=self.stream, config=config, ordered_consumer=True)
            try:
                for _ in range(new):
                    try:
                        msg = await sub.next_msg(timeout=self.bus.config.request_timeout_s)
                    except nats.errors.TimeoutError:  # one was removed meanwhile: counted next time
                        break
                    self.num_messages += 1
                    self.total += num_events(msg)
                    self.last_seq = msg.metadata.sequence.stream
            finally:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()
            return self.total


async def watch(bus: Bus, subject: str, event_type: type[T], stopping: asyncio.Event, *, watcher: str,
                last_per_subject: bool = False, start_time: datetime | None = None,
                poll_s: float = 0.5) -> AsyncIterator[T]:
    """Every event stored on ``subject`` (from ``start_time`` when given), decoded, then each new
    one, until ``stopping``: an ordered consumer for a reader that looks at everything (a
    weights watcher).

    A message that is not an ``event_type`` on its own subject is logged, dead-lettered as
    consumed by ``watcher`` (same id from every replica and restart, so kept once) and
    skipped: it never stops the watch. ``last_per_subject`` starts at the last message of
    each subject instead of the first."""
    decoder: events.Decoder[T] = events.Decoder(event_type)
    if start_time is not None:
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start_time)
    else:
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT if last_per_subject else DeliverPolicy.ALL)
    # The server's idle heartbeats tell the client its ordered consumer is gone (a server
    # restart loses it) after two missed ones: at 1 s, the watch resumes within seconds.
    sub = await bus.js.subscribe(subject, stream=stream_of(subject), config=config, ordered_consumer=True,
                                 idle_heartbeat=WATCH_HEARTBEAT_S)
    # As in Replay: nats-py recreates a reset ordered consumer (after a server restart) from this
    # config by start sequence, which the server refuses alongside a start time.
    config.opt_start_time = None
    try:
        while not stopping.is_set():
            try:
                msg = await sub.next_msg(timeout=poll_s)
            except nats.errors.TimeoutError:
                continue
            try:
                found = decode_events(decoder, msg)
            except Undecodable as exc:
                md = msg.metadata
                log.warning("%s: skipping %s seq %d: %s", watcher, msg.subject, md.sequence.stream, exc)
                await publish_dead_letter(bus, dead_letter(
                    stream=md.stream, stream_seq=md.sequence.stream, subject=msg.subject, consumer=watcher,
                    num_delivered=md.num_delivered, reason=str(exc), payload=msg.data, headers=msg.headers))
                continue
            for event in found:
                yield event
    finally:
        try:
            await sub.unsubscribe()
        except nats.errors.Error:
            pass


async def wait_at_most(aw: Awaitable[T], timeout_s: float) -> T | None:
    """``aw``'s result, or None once ``timeout_s`` passed first (``aw`` is then cancelled):
    for waits on an event, a condition or a queue inside a loop. Not ``asyncio.wait_for``: on
    Python 3.11 it returns the result of a wait that completes in the same turn as the task is
    cancelled, swallowing the cancellation, and a cancelled task that loops on such waits
    then runs on, unseen (a consumer that does not stop, a waiting admission that retries
    forever)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await aw
    except TimeoutError:
        return None


# --- consuming ----------------------------------------------------------------------------


class Reject(Exception):
    """Raised by a handler for a message that can never succeed: dead-lettered at once."""


MAX_DELIVER = 5  # a consumer's deliveries of a message before it is dead-lettered, unless told otherwise


class HandBack(Exception):
    """Raised by a handler for a message this process should not finish (another consumer of
    its durable takes it on: a scorer replica that gave up the message's partition): handed
    back at once, for an immediate redelivery (which counts as a delivery)."""


@dataclass(slots=True)
class Delivery:
    """One decoded event handed to a handler: a message's, or one of a batch message's."""

    event: Any
    subject: str
    stream_seq: int
    num_delivered: int
    headers: dict[str, str]
    msg: Msg = field(repr=False)
    batch_index: int | None = None  # its place in a batch message (None: the message holds it alone)


Handler = Callable[[Delivery], Awaitable[None]]
BatchHandler = Callable[[list[Delivery]], Awaitable[None]]


@dataclass
class ConsumerStats:
    acked: int = 0
    naked: int = 0
    dead_lettered: int = 0
    handed_back: int = 0
    recreated: int = 0  # times its durable was found deleted and made again


class _ConsumerMetrics:
    """A consumer's Prometheus figures (flywheel.contract.metrics), its labels bound once."""

    def __init__(self, durable: str) -> None:
        self.acked, self.naked, self.dead_lettered, self.handed_back = (
            metrics.MESSAGES.labels(durable, outcome) for outcome in ("acked", "naked", "dead_lettered", "handed_back"))
        self.in_flight = metrics.IN_FLIGHT.labels(durable)
        self.pending = metrics.PENDING.labels(durable)
        self.handle_seconds = metrics.HANDLE_SECONDS.labels(durable)


class _Pull:
    """A durable's pull requests, one open at a time, answered on an inbox of its own.

    Does what nats-py's ``PullSubscription.fetch`` does, cheaper: fetch waits on every message
    of a batch through a task, a timer and a uuid of its own (``next_msg``), about as much
    CPU as the rest of a message's handling, and its lingering request holds what arrives
    until the batch fills or the timeout passes. Here the inbox's callback takes each message
    as the client reads it, and the messages of one read go to ``on_msgs`` together at the
    end of the loop's turn, while the request stays open for the rest.

    :meth:`next` asks for ``n`` messages: ``no_wait`` (what the stream has now, then status
    404) after a request that brought some, else a lingering request (``expires``) that
    waits for them. It returns once ``n`` came, on a status that ends the request (404 no
    messages, 408 expired, 409 and 503 refused), or ``expires_s`` plus a margin after it was
    sent (a server restart loses a request without a word). Each request answers on
    ``<inbox>.<k>``: a status that comes late, for a request that ended here already, is
    told apart and ignored. A message counts against the open request (the server names
    none), so it is handed on whenever it comes.
    """

    LOST_AFTER_S = 0.5  # past expires: a request the server did not answer is taken as lost

    def __init__(self, nc: NATS, stream: str, durable: str, on_msgs: Callable[[list[Msg]], None]) -> None:
        self.nc = nc
        self.subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.on_msgs = on_msgs
        self.inbox = ""
        self._sub: Any = None
        self._k = 0  # the open request's number (its reply subject's last token)
        self._remaining = 0  # messages the open request may still bring
        self._brought = 0  # messages the open (or last) request brought
        self._ended = asyncio.Event()
        self._status: tuple[str, str] | None = None  # the status that ended the last request
        self._arrived: list[Msg] = []  # this turn's messages, handed on at its end
        self._flush_soon: asyncio.Handle | None = None

    async def start(self) -> None:
        self.inbox = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(f"{self.inbox}.*", cb=self._on_msg)

    async def next(self, n: int, expires_s: float) -> tuple[str, str] | None:
        """Ask for ``n`` messages and wait until the request ends; its ending status (code,
        description) when the server refused it (409, 503), else None."""
        self._k += 1
        body: dict[str, Any] = {"batch": n}
        if self._brought:  # the stream had messages: take what it has now
            body["no_wait"] = True
        else:
            body["expires"] = int(expires_s * 1e9)
        self._remaining, self._brought, self._status = n, 0, None
        self._ended.clear()
        await self.nc.publish(self.subject, msgspec.json.encode(body), reply=f"{self.inbox}.{self._k}")
        await wait_at_most(self._ended.wait(), expires_s + self.LOST_AFTER_S)
        self._remaining = 0
        self._hand_on()
        return self._status

    async def close(self) -> None:
        """Stop listening and hand on what came. Called once no request is open, so nothing more
        is on its way (after a failed request, what the server still sends is redelivered once
        ``ack_wait`` has passed)."""
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        self._hand_on()

    async def _on_msg(self, msg: Msg) -> None:
        headers = msg.headers
        status = headers.get("Status") if headers and not msg.data else None
        if status is None:
            self._arrived.append(msg)
            if self._flush_soon is None:
                self._flush_soon = asyncio.get_running_loop().call_soon(self._hand_on)
            self._brought += 1
            if self._remaining > 0:
                self._remaining -= 1
                if self._remaining == 0:
                    self._ended.set()
            return
        if status == "100" or msg.subject != f"{self.inbox}.{self._k}":
            return  # a heartbeat, or the end of a request that ended here already
        if status not in ("404", "408"):
            self._status = (status, (headers or {}).get("Description", ""))
        self._ended.set()

    def _hand_on(self) -> None:
        if self._flush_soon is not None:
            self._flush_soon.cancel()
            self._flush_soon = None
        if self._arrived:
            msgs, self._arrived = self._arrived, []
            self.on_msgs(msgs)


async def let_durable_expire(bus: Bus, stream: str, durable: str, after_s: float) -> bool:
    """Have the server delete ``durable`` of ``stream`` once no one has pulled it for
    ``after_s`` (its ``inactive_threshold`` set so): what the process that reads it does when
    it reads it no more (a run ended). An update of its own durable, which a service may make
    where it may not delete. False when the durable is gone already."""
    try:
        info = await bus.retry(functools.partial(bus.js.consumer_info, stream, durable))
    except nats.js.errors.NotFoundError:
        return False
    # By its durable name (the request a service's user may make), not by name and filter.
    config = dataclasses.replace(info.config, name=None, inactive_threshold=after_s)
    try:
        await bus.retry(functools.partial(bus.js.add_consumer, stream, config))
    except nats.js.errors.NotFoundError:
        return False
    return True


class Consumer:
    """A durable pull consumer on one stream, driven by one loop.

    Give ``handler`` (one message at a time, up to ``max_in_flight`` concurrently) or
    ``batch_handler`` (lists of up to ``batch_size``; a failing batch is retried message by
    message so one bad message cannot hold back the others).

    ``max_deliver`` counts deliveries: after the last one fails the message goes to
    ``dead.<stream>``. The ``i``-th wait of ``backoff_s`` is the delay before delivery ``i + 1``
    (the last one repeating).
    A durable deleted under it (by hand, by the server) is made again when a pull is refused
    (``recreate_if`` says when not to): the work goes on, and ``stats.recreated`` counts it.
    ``letters_undecodable=False``: a message that is not its event is terminated without a dead
    letter of this consumer's, for a consumer whose messages another one also reads and
    dead-letters (inference's consumer of one run's tasks, beside its screen of every task).
    """

    def __init__(
        self,
        bus: Bus,
        *,
        stream: str,
        durable: str,
        handler: Handler | None = None,
        batch_handler: BatchHandler | None = None,
        event_type: Any = events.AnyEvent,
        filter_subject: str | Sequence[str] | None = None,
        max_in_flight: int = 64,
        batch_size: int = 64,
        max_deliver: int = MAX_DELIVER,
        backoff_s: Sequence[float] = (0.5, 2.0, 5.0, 15.0),
        ack_wait_s: float = 30.0,
        grace_s: float = 10.0,
        fetch_timeout_s: float = 1.0,
        deliver_new_only: bool = False,
        start_time: datetime | None = None,
        inactive_threshold_s: float | None = None,
        letters_undecodable: bool = True,
        recreate_if: Callable[[], bool] | None = None,
    ) -> None:
        if (handler is None) == (batch_handler is None):
            raise ValueError("Consumer needs exactly one of handler= or batch_handler=")
        if stream not in STREAMS:
            raise ValueError(f"stream={stream!r} is not a Flywheel stream; choose from {sorted(STREAMS)}")
        if max_deliver < 1:
            raise ValueError(f"max_deliver must be at least 1, got {max_deliver}")
        self.bus = bus
        self.stream = stream
        self.durable = durable
        self.handler = handler
        self.batch_handler = batch_handler
        self.decoder: events.Decoder[Any] = events.Decoder(event_type)
        self.filter_subject = filter_subject
        self.max_in_flight = max_in_flight
        self.batch_size = min(batch_size, max_in_flight)
        self.max_deliver = max_deliver
        self.backoff = Backoff.of(backoff_s)  # the wait before delivery n + 1 after n failed
        self.ack_wait_s = ack_wait_s
        self.grace_s = grace_s
        self.fetch_timeout_s = fetch_timeout_s
        self.deliver_new_only = deliver_new_only
        # Where a new durable starts: the stream's first message, only what comes next
        # (deliver_new_only) or what was stored from start_time on. A durable that exists goes
        # on where it was, whatever these say (the server fixes them when it is created).
        self.start_time = start_time
        self.created: bool | None = None  # by ensure(): whether it created the durable
        # The server deletes the durable after this long without a pull (None: never);
        # for consumers that belong to something that ends, like one run's trainer.
        self.inactive_threshold_s = inactive_threshold_s
        self.letters_undecodable = letters_undecodable
        # Whether a durable found deleted is made again (None: always); False for one whose work
        # is done, which another process may delete (a finished run's tasks).
        self.recreate_if = recreate_if
        self.stats = ConsumerStats()
        self._alive_at = events.utc_now()  # when a pull last got an answer (a deleted durable is made from it)
        self._metrics = _ConsumerMetrics(durable)
        self._stopping = asyncio.Event()
        self.fetching_ended = asyncio.Event()  # set once run() fetches no more (stopping, before the drain)
        self._in_flight = 0  # messages fetched and not finished
        self._wanted_free = 1  # free slots the loop waits for: workers wake it only then
        self._slot_freed = asyncio.Event()
        # Each unit of work (a message, or a fetched batch for batch_handler) goes to an idle
        # worker, or a new one when none is idle: every unit starts at once, as with a task
        # each, and there are never more workers than units in flight. A task per message
        # cost more than the rest of the loop's bookkeeping together.
        self._workers: list[asyncio.Task[None]] = []
        self._idle: list[asyncio.Future[list[Msg]]] = []  # one per idle worker, set to its next unit
        # id(msg) -> (msg, when it arrived): for in_progress, and for handing back on stop
        self._unfinished: dict[int, tuple[Msg, float]] = {}

    async def ensure(self) -> None:
        try:
            existing: ConsumerConfig | None = (await self.bus.retry(
                lambda: self.bus.js.consumer_info(self.stream, self.durable))).config
        except nats.js.errors.NotFoundError:
            existing = None
        self.created = bool(self.created) or existing is None  # a second ensure() finds what the first made
        subjects = [self.filter_subject] if isinstance(self.filter_subject, str) else self.filter_subject
        deliver: DeliverPolicy | None
        start_time: datetime | None
        if self.start_time is not None:
            deliver, start_time = DeliverPolicy.BY_START_TIME, self.start_time
        else:
            deliver, start_time = (DeliverPolicy.NEW if self.deliver_new_only else DeliverPolicy.ALL), None
        if existing is not None:  # fixed at creation: sending another would be refused
            deliver, start_time = existing.deliver_policy, existing.opt_start_time
        cfg = ConsumerConfig(
            durable_name=self.durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            # Unlimited on the server: the loop decides when to dead-letter, so a message
            # whose handler crashed the process on its last delivery is not silently lost.
            max_deliver=-1,
            max_ack_pending=self.max_in_flight,
            filter_subject=subjects[0] if subjects and len(subjects) == 1 else None,
            filter_subjects=list(subjects) if subjects and len(subjects) > 1 else None,
            deliver_policy=deliver,
            opt_start_time=start_time,
            inactive_threshold=self.inactive_threshold_s,
        )
        await self.bus.retry(lambda: self.bus.js.add_consumer(self.stream, cfg))

    async def _ensure_patiently(self) -> None:
        """:meth:`ensure`, tried again while the bus answers too slowly for it (a loaded machine,
        a server restarting: past ``publish_timeout_s``), saying so once, until it succeeds or a
        stop is asked: a service that starts while the bus is slow waits for it, never exits."""
        said = False
        while True:
            try:
                await self.ensure()
                if said:
                    log.info("consumer %s on %s: the bus answers; consuming", self.durable, self.stream)
                return
            except Exception as exc:
                if not _is_transient(exc) or self._stopping.is_set():
                    raise
                if not said:
                    log.warning("consumer %s on %s: the bus does not answer yet (%s: %s); trying again until it "
                                "does", self.durable, self.stream, type(exc).__name__, exc)
                    said = True
                await asyncio.sleep(ENSURE_RETRY_S)

    def stop(self) -> None:
        """Stop pulling; :meth:`run` then finishes in-flight work and returns."""
        self._stopping.set()
        self._slot_freed.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    async def run(self) -> None:
        await self._ensure_patiently()
        pull = _Pull(self.bus.nc, self.stream, self.durable, self._dispatch)
        await pull.start()
        keepalive = asyncio.ensure_future(self._keep_alive())
        try:
            while not self._stopping.is_set():
                free = await self._wait_for_slots()
                if free == 0:
                    continue
                try:
                    refused = await pull.next(min(free, self.batch_size), self.fetch_timeout_s)
                except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError):
                    if self._stopping.is_set() or self.bus.nc.is_closed:
                        break
                    raise
                except nats.errors.Error as exc:
                    refused = ("", str(exc))
                if refused is None:
                    self._alive_at = events.utc_now()
                    continue
                if await self._deleted():
                    # Deleted by hand, or by the server (inactive_threshold): made again, so the
                    # work goes on instead of a warning a pull for ever.
                    await self._recreate()
                    continue
                # Server restarting, leader change: asking again at once would spin.
                log.warning("consumer %s: pull refused (%s %s); retrying", self.durable, *refused)
                await wait_at_most(self._stopping.wait(), 0.25)
        finally:
            self.fetching_ended.set()
            keepalive.cancel()
            await pull.close()
            await self._drain_in_flight()

    async def _deleted(self) -> bool:
        """Whether the durable is gone from its stream (False when the server cannot say now)."""
        try:
            await self.bus.js.consumer_info(self.stream, self.durable)
        except nats.js.errors.NotFoundError:
            return not self._stopping.is_set() and (self.recreate_if is None or self.recreate_if())
        except (nats.errors.Error, TimeoutError):
            return False
        return False

    async def _recreate(self) -> None:
        """Make the deleted durable again, as :meth:`ensure` first made it; one that took only new
        messages takes them from when it was last seen alive, so what was published while it was
        gone is not skipped. What it had delivered and not acked comes again (every handler is
        idempotent: delivery is at least once)."""
        if self.deliver_new_only and self.start_time is None:
            self.start_time = self._alive_at
        self.stats.recreated += 1
        log.warning("consumer %s: it is gone from stream %s (deleted); made again, %s", self.durable, self.stream,
                    f"from {self.start_time.isoformat()}" if self.start_time is not None
                    else "from the stream's first message")
        try:
            await self.ensure()
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("consumer %s: could not make it again yet (%s); trying again", self.durable, exc)
            await wait_at_most(self._stopping.wait(), 0.25)

    async def _wait_for_slots(self) -> int:
        """Wait for free slots. Fetch one message at a time only when few are freeing:
        below a quarter of a batch free, wait a few milliseconds for more (one round trip
        per batch instead of one per message under load)."""
        await self._until_free(1)
        low_water = max(1, self.batch_size // 4)
        if self.max_in_flight - self._in_flight < low_water:
            await wait_at_most(self._until_free(low_water), 0.005)
        return 0 if self._stopping.is_set() else self.max_in_flight - self._in_flight

    async def _until_free(self, n: int) -> None:
        self._wanted_free = n
        while self.max_in_flight - self._in_flight < n and not self._stopping.is_set():
            self._slot_freed.clear()
            await self._slot_freed.wait()

    def _dispatch(self, msgs: list[Msg]) -> None:
        self._in_flight += len(msgs)
        self._metrics.in_flight.set(self._in_flight)
        with contextlib.suppress(ValueError, IndexError, nats.errors.Error):  # a reply without the counts: no figure
            self._metrics.pending.set(msgs[-1].metadata.num_pending or 0)
        now = time.monotonic()
        for m in msgs:
            self._unfinished[id(m)] = (m, now)
        size = self.batch_size if self.batch_handler is not None else 1
        for unit in [msgs] if len(msgs) <= size else [msgs[i:i + size] for i in range(0, len(msgs), size)]:
            if self._idle:
                self._idle.pop().set_result(unit)
            else:
                self._workers.append(asyncio.ensure_future(self._worker(unit)))

    async def _worker(self, msgs: list[Msg]) -> None:
        while True:
            try:
                await self._process_batch(msgs)
            except Exception:
                log.exception("consumer %s: internal error", self.durable)
            finally:
                self._in_flight -= len(msgs)
                self._metrics.in_flight.set(self._in_flight)
                if self.max_in_flight - self._in_flight >= self._wanted_free:
                    self._slot_freed.set()
            next_unit = asyncio.get_running_loop().create_future()
            self._idle.append(next_unit)
            msgs = await next_unit

    async def _drain_in_flight(self) -> None:
        self._wanted_free = self.max_in_flight
        deadline = time.monotonic() + self.grace_s
        while self._in_flight and (left_s := deadline - time.monotonic()) > 0:
            self._slot_freed.clear()
            await wait_at_most(self._slot_freed.wait(), left_s)
        for w in self._workers:
            w.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers.clear()
        self._idle.clear()
        for m, _ in list(self._unfinished.values()):
            # Hand back what did not finish: redelivered at once to another consumer.
            try:
                await m.nak()
                self.stats.handed_back += 1
                self._metrics.handed_back.inc()
            except nats.errors.Error:
                pass
        self._unfinished.clear()

    # --- per-message outcome --------------------------------------------------------------

    async def _process_batch(self, msgs: list[Msg]) -> None:
        """Decode ``msgs`` into deliveries (a batch message gives one per event), run the handler
        on them, then settle each message by the outcomes of its events."""
        good: list[Delivery] = []
        for m in msgs:
            try:
                found = decode_events(self.decoder, m)
            except Undecodable as exc:
                if self.letters_undecodable:
                    await self._dead_letter(m, str(exc))
                else:
                    log.info("consumer %s: %s; terminated (another consumer dead-letters it)", self.durable, exc)
                    await m.term()
                    self._unfinished.pop(id(m), None)
                continue
            num_delivered, stream_seq = delivery_counts(m.reply)
            if num_delivered > self.max_deliver:
                await self._dead_letter(m, f"delivered {num_delivered} times (max_deliver={self.max_deliver}) "
                                           "without an outcome: the handler crashed or timed out")
                continue
            batched = events.BATCH_HEADER in (m.headers or {})
            good += [Delivery(event, m.subject, stream_seq, num_delivered, m.headers or {}, m, i if batched else None)
                     for i, event in enumerate(found)]
        if not good:
            return
        outcomes: list[Exception | None]
        if self.batch_handler is None:
            # One handler call an event; a batch message's events run side by side, as messages do.
            outcomes = list(await asyncio.gather(*(self._attempt(d) for d in good)))
        else:
            failed = await self._attempt_all(good)
            # Isolate the failing event(s): retry one by one.
            outcomes = [failed] if len(good) == 1 else [None] * len(good) if failed is None else [
                await self._attempt(d) for d in good]
        start = 0
        while start < len(good):  # each message's deliveries are adjacent
            end = start + 1
            while end < len(good) and good[end].msg is good[start].msg:
                end += 1
            await self._settle(good[start:end], outcomes[start:end])
            start = end

    async def _attempt(self, d: Delivery) -> Exception | None:
        return await self._attempt_all([d])

    async def _attempt_all(self, ds: list[Delivery]) -> Exception | None:
        """What the handler raised on ``ds`` (None: it succeeded)."""
        try:
            await self._call(ds)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return exc
        return None

    async def _call(self, ds: list[Delivery]) -> None:
        tracer = self.bus.tracer
        started = time.monotonic()
        try:
            if tracer is None:
                return await self._handle(ds)
            token = otel_context.attach(propagate.extract(ds[0].headers))
            try:
                with tracer.start_as_current_span(f"process {ds[0].subject}", kind=trace.SpanKind.CONSUMER):
                    await self._handle(ds)
            finally:
                otel_context.detach(token)
        finally:
            self._metrics.handle_seconds.observe(time.monotonic() - started)

    def _handle(self, ds: list[Delivery]) -> Awaitable[None]:
        # A plain function returning the handler's awaitable: one coroutine less a message.
        if self.batch_handler is not None:
            return self.batch_handler(ds)
        assert self.handler is not None and len(ds) == 1
        return self.handler(ds[0])

    async def _keep_alive(self) -> None:
        """Tell the server that work in flight goes on, so a long handler is not redelivered.

        Every message held longer than a third of ``ack_wait_s`` gets ``in_progress``.
        """
        period_s = self.ack_wait_s / 3
        while True:
            await asyncio.sleep(period_s)
            cutoff = time.monotonic() - period_s
            for m, since in list(self._unfinished.values()):
                if since <= cutoff:
                    try:
                        await m.in_progress()
                    except nats.errors.Error as exc:
                        log.warning("consumer %s: in_progress failed: %s", self.durable, exc)

    async def _ack(self, m: Msg) -> None:
        await m.ack()
        self._unfinished.pop(id(m), None)
        self.stats.acked += 1
        self._metrics.acked.inc()

    async def _settle(self, ds: list[Delivery], outcomes: list[Exception | None]) -> None:
        """One message's outcome from its events' (``ds``, all of it): acked when each succeeded;
        handed back when one was (:class:`HandBack`); delivered again with backoff while one
        failed otherwise and deliveries are left (the handler sees every event of it again: it
        is idempotent); else each failed event is dead-lettered (:class:`Reject`: at once) and the
        message is done."""
        m, d = ds[0].msg, ds[0]
        failures = [(d, exc) for d, exc in zip(ds, outcomes, strict=True) if exc is not None]
        if not failures:
            await self._ack(m)
            return
        if any(isinstance(exc, HandBack) for _, exc in failures):
            await m.nak()
            self._unfinished.pop(id(m), None)
            self.stats.handed_back += 1
            self._metrics.handed_back.inc()
            return
        again = [exc for _, exc in failures if not isinstance(exc, Reject)]
        if again and d.num_delivered < self.max_deliver:
            delay_s = self.backoff.delay_s(d.num_delivered)
            log.warning("consumer %s: %s on %s (delivery %d), retry in %.1fs", self.durable,
                        type(again[0]).__name__, d.subject, d.num_delivered, delay_s)
            await m.nak(delay=delay_s)
            self._unfinished.pop(id(m), None)
            self.stats.naked += 1
            self._metrics.naked.inc()
            return
        reasons = [f"rejected: {exc}" if isinstance(exc, Reject) else
                   f"failed on delivery {d.num_delivered} of {self.max_deliver}: {type(exc).__name__}: {exc}"
                   for _, exc in failures]
        if d.batch_index is None:  # the message held one event
            await self._dead_letter(m, reasons[0])
            return
        for (failed, _), reason in zip(failures, reasons, strict=True):
            await self._dead_letter_event(failed, reason)
        if len(failures) == len(ds):
            await m.term()
            self._unfinished.pop(id(m), None)
        else:
            await self._ack(m)  # the rest of it was handled

    async def _dead_letter_event(self, d: Delivery, reason: str) -> None:
        """The dead letter of one event of a batch message: it alone, as it would travel alone."""
        log.error("consumer %s: dead letter for event %d of %s seq %d: %s", self.durable, d.batch_index, d.subject,
                  d.stream_seq, reason[:DEAD_LETTER_REASON_CHARS])
        content_type = d.headers.get(HEADER_CONTENT_TYPE, events.JSON)
        # Its own headers: the batch's, less what makes it a batch, and its own id.
        headers = {k: v for k, v in d.headers.items() if k != events.BATCH_HEADER} | {HEADER_MSG_ID: d.event.msg_id}
        await publish_dead_letter(self.bus, dead_letter(
            stream=self.stream, stream_seq=d.stream_seq, subject=d.subject, consumer=self.durable,
            num_delivered=d.num_delivered, reason=reason, payload=events.encode(d.event, content_type),
            headers=headers, batch_index=d.batch_index))
        self.stats.dead_lettered += 1
        self._metrics.dead_lettered.inc()

    async def _dead_letter(self, m: Msg, reason: str) -> None:
        num_delivered, stream_seq = delivery_counts(m.reply)
        log.error("consumer %s: dead letter for %s seq %d: %s", self.durable, m.subject, stream_seq,
                  reason[:DEAD_LETTER_REASON_CHARS])
        await publish_dead_letter(self.bus, dead_letter(
            stream=self.stream, stream_seq=stream_seq, subject=m.subject, consumer=self.durable,
            num_delivered=num_delivered, reason=reason, payload=m.data, headers=m.headers))
        await m.term()
        self._unfinished.pop(id(m), None)
        self.stats.dead_lettered += 1
        self._metrics.dead_lettered.inc()
