"""A training API the ``tinker`` SDK speaks: training loops written against it train here.

``python -m flywheel_trainer.tinker_api [--host H] [--port 8430]`` (settings
``training_api_host``, ``training_api_port``; loopback alone when open) serves the routes of the
Tinker API (``/api/v1/...``) that a supervised or RL loop uses: the client's feature flags,
sessions and their heartbeats, ``create_model`` (a LoRA adapter on a base model Flywheel
resolves: ``tiny``, ``smollm2``, a model folder), ``get_info``, ``forward``/``forward_backward``
(losses ``cross_entropy``, ``importance_sampling``, ``ppo``, ``cispo`` and ``gspo`` with their
``loss_fn_config``, :mod:`flywheel_trainer.adapter_host`),
``optim_step`` (AdamW with the request's parameters), ``save_weights``/``load_weights``
(with or without the optimizer state), sampling (``save_weights_for_sampler``, sampling
sessions of a checkpoint or a base model, ``asample``) and ``retrieve_future``. Point the SDK
at it::

    import tinker
    service = tinker.ServiceClient(base_url="http://127.0.0.1:8430", api_key="tml-local")
    training = service.create_lora_training_client(base_model="tiny", rank=8)

Every model of every session is an adapter on one copy of its base model in this process.
Work requests answer at once with a future (a request id) and run in the background, one at a
time on a base, each model's in the order of its ``seq_id`` (a request that arrives early
waits for those before it; a retried request gets its first answer's future); the SDK polls
``retrieve_future``, which holds a poll up to ``POLL_S`` before answering ``try_again``.
``forward_backward`` bodies and results, and samples, are the SDK's protobuf messages
(``tinker.proto.tinker_public_pb2``); everything else is JSON of the SDK's own types. A
request that cannot be done as asked fails its future with a ``user`` error naming the field.
A sampler samples in this process from a snapshot of the model's adapter taken in the order
of its requests (``save_weights_for_sampler``), or from a checkpoint, or from the base.

The server tells the SDK (``/api/v1/client/config``) to send plain API keys, no compressed
bodies, and fwd/bwd chunks one after another. Keys: with setting ``auth = "keys"`` every
request carries a tenant's Flywheel key behind the SDK's ``tml-`` prefix
(``X-API-Key: tml-fw_<id>_<secret>``; ``TINKER_API_KEY`` for the SDK), checked against the
keys bucket as the gateway checks it (:class:`flywheel.contract.keys.KeyCheck`; ``write``
scope); open (loopback only) any ``tml-`` key is tenant ``default``. Everything a request
makes (a session, its models and samplers, a future, a checkpoint) is its tenant's: another
tenant's id or ``tinker://`` path is answered as one that does not exist, with the same words,
and checkpoints lie under ``<data_dir>/tinker/<tenant>/``.

Metering: each request that did work publishes a ``usage`` event (source ``training_api``,
``run`` the session; :class:`flywheel.contract.events.Usage`), which the recorder stores and
``GET /v1/usage`` sums by tenant. With ``[quotas] trained_tokens_per_day`` set, a
``forward_backward`` whose tokens would take its tenant past the day's limit (its runs' and its
API requests' trained tokens since 00:00 UTC, as the gateway's usage counts them, plus what this
process admitted since it last asked) fails its future naming the quota, before any of it runs.

Not served yet: server-side custom losses (the SDK's ``forward_backward_custom`` runs the loss
on the client with a ``forward``, then a ``cross_entropy`` of its gradients: that works), a
sample's ``prompt_alt_tokens_k`` and ``target_prompt_logprobs`` (prompt logprobs and top-k
logprobs are served), sampling through Flywheel's inference service (with its batching),
several replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request, Response
from tinker import types as tt
from tinker.proto import tinker_public_pb2 as pb

from flywheel.contract import events, natsusers
from flywheel.contract.bus import Bus, BusConfig
from flywheel.contract.keys import KeyCheck, KeyRefused, ScopeRefused, check_open
from flywheel.contract.settings import Settings
from flywheel.sdk import gateway
from flywheel.sdk.models import BUILDERS
from flywheel_trainer.adapter_host import (
    Adapter,
    Base,
    Datum,
    PromptScores,
    Sampled,
    Sampling,
    UserError,
    checkpoint_of,
)

POLL_S = 10.0  # how long retrieve_future holds a poll for a result before try_again
MAX_RESULTS = 10_000  # results kept for retrieve_future (the oldest go first)
NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")  # a checkpoint's name
PATH = re.compile(r"^tinker://([A-Za-z0-9_:-]+)/weights/([A-Za-z0-9._-]{1,128})$")
PROTO = "application/x-protobuf"
# An id this server made (a request's, a session's, and so a model's): the process's boot id first.
BOOT = re.compile(r"^(?:session-)?([0-9a-f]{8})[0-9a-f]{20}(?::|$)")
MAX_SAMPLES = 256  # samples of one request
MAX_SNAPSHOTS = 16  # samplers of a session's weights snapshots kept (save_weights_for_sampler), newest first
MAX_NEW_TOKENS = 4096  # tokens of one sample
MAX_TOP_K = 64  # top-k logprobs of a position
EMPTY_LOGPROB = -99999.0  # the SDK's empty cell of a top-k matrix
KEY_PREFIX = "tml-"  # what the SDK insists a key starts with; a Flywheel key follows it
OPEN_TENANT = "default"  # the tenant of every request to an open API (as the open gateway's)
OPTIONAL_BUS_S = 2.0  # how long an open API waits for NATS at start before it serves unmetered
QUOTA_FRESH_S = 5.0  # how long the gateway's count of a tenant's trained tokens today is taken as it is
log = logging.getLogger("flywheel.training_api")


@dataclass
class Session:
    """A client's session: whose it is, its last heartbeat."""

    id: str
    tenant: str
    beat: float


@dataclass
class Model:
    """A training model: its adapter on its base, the order its requests run in."""

    id: str
    session: str
    tenant: str
    base: Base
    adapter: Adapter
    next_seq: int = 1
    waiting: dict[int, tuple[str, Callable[[], Any], Callable[[Any, str], Any] | None]] = field(
        default_factory=dict)
    seen: dict[int, str] = field(default_factory=dict)  # seq_id -> the request id it was answered
    tail: asyncio.Future[None] | None = None


@dataclass
class Sampler:
    """A sampling session: the adapter it samples from (None: the base alone)."""

    id: str
    session: str
    tenant: str
    base: Base
    adapter: Adapter | None
    model_path: str | None


class TrainingAPI:
    """The API's state: bases, models, sessions, futures."""

    def __init__(self, data_dir: Path, quota: DailyQuota | None = None) -> None:
        self.data_dir = data_dir
        self.quota = quota
        # Ids this process makes carry it, so that one of an earlier run of the server (before a
        # restart: its sessions, models and futures lived in that process's memory) says so.
        self.boot = secrets.token_hex(4)
        self.started = datetime.now(UTC)
        self.bus: Bus | None = None  # where usage goes (None: not metered)
        self.keys: KeyCheck | None = None  # tenants' keys (None: open, one tenant)
        self.bases: dict[str, Base] = {}
        self.models: dict[str, Model] = {}
        self.sessions: dict[str, Session] = {}
        self.results: dict[str, tuple[str, asyncio.Future[Any]]] = {}  # request id -> (tenant, its future)
        self.samplers: dict[str, Sampler] = {}
        self.let_go: dict[str, str] = {}  # samplers no longer kept -> why
        self._background: set[asyncio.Future[Any]] = set()
        # Every model's work on one thread of its own: torch's intra-op threads are made once and
        # kept busy; spread over a pool's threads (asyncio.to_thread), a step took 3x as long.
        self._torch = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="flywheel-torch")
        self._base_lock = asyncio.Lock()

    async def torch(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the API's torch thread."""
        return await asyncio.get_running_loop().run_in_executor(self._torch, functools.partial(fn, *args))

    def checkpoint(self, tenant: str, model_id: str, name: str) -> Path:
        return self.data_dir / "tinker" / tenant / model_id / f"{name}.pt"

    def new_id(self) -> str:
        return f"{self.boot}{secrets.token_hex(10)}"

    def gone(self, some_id: str | None) -> str:
        """Why an id (a session's, a model's, a request's) of an earlier run of this server is
        not found; empty for any other (ids of another tenant are answered alike)."""
        found = BOOT.search(some_id or "")
        if found is None or found.group(1) == self.boot:
            return ""
        return (f"; it was made before this server restarted at {self.started:%Y-%m-%d %H:%M:%S} UTC, and sessions, "
                "models and futures live in the server's memory: start again from a checkpoint "
                "(create_training_client_from_state_with_optimizer)")

    def session(self, session_id: str | None, tenant: str) -> Session:
        """The tenant's session; another tenant's is answered as one that does not exist."""
        found = self.sessions.get(session_id or "")
        if found is None or found.tenant != tenant:
            raise HTTPException(404, f"session {session_id!r}: no such session (create_session makes one)"
                                     + self.gone(session_id))
        return found

    def meter(self, session: str, tenant: str, request_id: str, prompt_tokens: int = 0, sampled_tokens: int = 0,
              trained_tokens: int = 0) -> None:
        """Publish what a request used (a ``usage`` event; nothing when not metered)."""
        if self.bus is None or not prompt_tokens + sampled_tokens + trained_tokens:
            return
        usage = events.Usage(id=f"training_api.{request_id}", run=session, source="training_api", tenant=tenant,
                             prompt_tokens=prompt_tokens, sampled_tokens=sampled_tokens, trained_tokens=trained_tokens)
        self.background(self._publish(usage))

    async def _publish(self, usage: events.Usage) -> None:
        assert self.bus is not None
        try:
            await self.bus.publish(usage)
        except Exception:  # the request's answer stands; the count is lost, and said so
            log.exception("usage of session %s (%s) not published: it goes uncounted", usage.run, usage.id)

    async def base(self, name: str) -> Base:
        async with self._base_lock:  # one load of a base, however many models ask at once
            if name not in self.bases:
                if name not in BUILDERS and not Path(name).expanduser().is_dir():
                    raise UserError(f"base_model {name!r}: not a model of this server ({', '.join(BUILDERS)}, or "
                                    "the folder of a Hugging Face model on it); it downloads none")
                try:
                    self.bases[name] = await self.torch(Base, name, self.data_dir)
                except (OSError, ValueError) as exc:
                    raise UserError(f"base_model {name!r}: {exc}") from None
            return self.bases[name]

    def future(self, tenant: str, work: Callable[[str], Any], model_id: str | None = None) -> dict[str, Any]:
        """Run ``work(request_id)`` (a coroutine function) in the background; its future's answer."""
        request_id = self.new_id()
        self._keep(tenant, request_id, asyncio.ensure_future(work(request_id)))
        return {"request_id": request_id, **({"model_id": model_id} if model_id else {})}

    def _keep(self, tenant: str, request_id: str, future: asyncio.Future[Any]) -> None:
        self.results[request_id] = (tenant, future)
        while len(self.results) > MAX_RESULTS:
            del self.results[next(iter(self.results))]

    def pending(self) -> set[asyncio.Future[Any]]:
        """What runs in the background now (usage being published, adapters being let go)."""
        return set(self._background)

    def background(self, work: Any) -> None:
        """``work`` (an awaitable) run to its end, held until then."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def ordered(self, model: Model, seq_id: int | None, work: Callable[[], Any],
                then: Callable[[Any, str], Any] | None = None) -> dict[str, Any]:
        """``work`` (blocking, run in a thread) after every earlier ``seq_id`` of ``model``, its
        result passed through ``then(result, request_id)`` on the event loop; a ``seq_id``
        answered before gets that answer's future (a retry)."""
        seq = model.next_seq if seq_id is None else seq_id
        if seq in model.seen:
            return {"request_id": model.seen[seq], "model_id": model.id}
        if seq < model.next_seq:
            raise HTTPException(400, f"seq_id {seq}: model {model.id} has run its requests up to {model.next_seq - 1}")
        request_id = self.new_id()
        self._keep(model.tenant, request_id, asyncio.get_running_loop().create_future())
        model.seen[seq] = request_id
        model.waiting[seq] = (request_id, work, then)
        while model.next_seq in model.waiting:
            rid, job, after = model.waiting.pop(model.next_seq)
            model.next_seq += 1
            model.tail = asyncio.ensure_future(self._after(model.tail, rid, job, after))
        return {"request_id": request_id, "model_id": model.id}

    async def _after(self, before: asyncio.Future[None] | None, request_id: str, job: Callable[[], Any],
                     then: Callable[[Any, str], Any] | None) -> None:
        if before is not None:
            await asyncio.gather(before, return_exceptions=True)
        future = self.results.get(request_id, ("", None))[1]
        try:
            result = await self.torch(job)
            if then is not None:
                result = then(result, request_id)
        except Exception as exc:  # the request's own failure: its future says it, the server goes on
            if future is not None and not future.done():
                future.set_exception(exc)
            return
        if future is not None and not future.done():
            future.set_result(result)

    def sampler(self, sampler_id: str, tenant: str) -> Sampler:
        found = self.samplers.get(sampler_id)
        if found is None or found.tenant != tenant:
            why = self.let_go.get(sampler_id) if sampler_id.split(":")[0] in self._own_sessions(tenant) else None
            raise HTTPException(404, f"sampling session {sampler_id!r}: " + (
                f"let go: {why}; sample from a newer one" if why else
                "no such sampler on this server (create_sampling_session or save_weights_for_sampler makes one)"))
        return found

    async def adapter_from(self, where: Path, name: str, optimizer: bool, base_model: str | None = None
                           ) -> tuple[Base, Adapter]:
        """A new adapter ``name`` like the one of the checkpoint at ``where``, set to it (its
        optimizer state too when ``optimizer``), on that checkpoint's base."""
        base_name, rank, targets = await self.torch(checkpoint_of, where)
        if base_model not in (None, base_name):
            raise UserError(f"base_model {base_model!r}: the checkpoint {where.name} is of {base_name!r}")
        base = await self.base(base_name)
        adapter = await self.torch(base.attach, name, rank, None, targets)
        await self.torch(base.load, adapter, where, optimizer)
        return base, adapter

    def _own_sessions(self, tenant: str) -> set[str]:
        return {s.id for s in self.sessions.values() if s.tenant == tenant}

    def save_named(self, model: Model, name: str, seq_id: int | None, overwrite: bool, answer: dict[str, Any]
                   ) -> dict[str, Any]:
        """Save ``model``'s adapter as checkpoint ``name`` in its request order; the future of
        ``answer`` with the checkpoint's ``path``."""
        if not NAME.match(name):
            raise HTTPException(422, f"path {name!r}: a checkpoint's name is letters, digits, '.', '_' and '-'")
        where = self.checkpoint(model.tenant, model.id, name)

        def run() -> dict[str, Any]:
            if where.exists() and not overwrite:
                raise UserError(f"path {name!r}: model {model.id} has a checkpoint of that name; give another, or "
                                "overwrite=True")
            model.base.save(model.adapter, where)
            return {"path": f"tinker://{model.id}/weights/{name}", **answer}

        return self.ordered(model, seq_id, run)

    def checkpoint_at(self, path: str, tenant: str) -> Path:
        """The file of a ``tinker://MODEL/weights/NAME`` path of the tenant's; 404 saying so when
        it has none (another tenant's is not looked for: its checkpoints lie apart)."""
        found = PATH.match(path)
        if found is None or not self.checkpoint(tenant, found.group(1), found.group(2)).is_file():
            raise HTTPException(404, f"path {path!r}: no such checkpoint on this server (save_weights answers with "
                                     "its tinker://MODEL/weights/NAME path)")
        return self.checkpoint(tenant, found.group(1), found.group(2))

    def model(self, model_id: str | None, tenant: str) -> Model:
        found = self.models.get(model_id or "")
        if found is None or found.tenant != tenant:
            raise HTTPException(404, f"model_id {model_id!r}: no such model on this server (create_model makes one)"
                                     + self.gone(model_id))
        return found


def sampler_id_of(session: str, seq_id: int) -> str:
    """A sampling session's id, from its session and its number there."""
    return f"{session}:sample:{seq_id}"


def sampling_of(params: Any) -> Sampling:
    """The SDK's SamplingParams as the adapter host takes them (stop: tokens or strings)."""
    stop = params.stop
    tokens: set[int] | None = None
    strings: tuple[str, ...] = ()
    if isinstance(stop, str):
        strings = (stop,)
    elif stop is not None:
        tokens = {s for s in stop if isinstance(s, int)}
        strings = tuple(s for s in stop if isinstance(s, str))
        if strings and not tokens:
            tokens = None  # strings alone: the end-of-sequence token still ends a sample
    if params.max_tokens is not None and not 1 <= params.max_tokens <= MAX_NEW_TOKENS:
        raise HTTPException(422, f"sampling_params.max_tokens={params.max_tokens}: 1 to {MAX_NEW_TOKENS}")
    return Sampling(max_tokens=params.max_tokens or 16, temperature=params.temperature, top_p=params.top_p,
                    top_k=params.top_k, seed=params.seed, stop_tokens=tokens, stop_strings=strings)


def model_id_of(session: str, model_seq_id: int) -> str:
    """A model's id, as the SDK derives it from its session and its client's number."""
    return f"{session}:train:{model_seq_id}"


async def from_checkpoint(api: TrainingAPI, session: Session, model_seq_id: int, where: Path, asked: Any
                          ) -> dict[str, Any]:
    """A new model of ``session``: an adapter like the checkpoint's, set to it (its optimizer too
    when asked)."""
    model_id = model_id_of(session.id, model_seq_id)
    base, adapter = await api.adapter_from(where, model_id, asked.optimizer, asked.base_model)
    api.models[model_id] = Model(model_id, session.id, session.tenant, base, adapter)
    return {"path": asked.path, "model_id": model_id, "type": "load_weights"}


def failure(exc: BaseException) -> dict[str, Any]:
    user = isinstance(exc, UserError | HTTPException)
    text = exc.detail if isinstance(exc, HTTPException) else str(exc)
    return {"error": f"{type(exc).__name__}: {text}" if not user else str(text), "category": "user" if user else
            "server"}


class DailyQuota:
    """``[quotas] trained_tokens_per_day`` for the API's ``forward_backward``: the tenant's
    trained tokens today as the gateway's ``GET /v1/usage`` sums them (asked again after
    ``QUOTA_FRESH_S``), plus what this process admitted since it asked. A refusal fails the
    request's future (a ``user`` error naming the quota: the SDK retries a 429 for minutes, a
    failed future it raises at once); the gateway not answering refuses it too, naming the
    gateway: the check fails closed."""

    def __init__(self, limit: int, gateway_url: str, token: str | None) -> None:
        self.limit, self.gateway_url, self.token = limit, gateway_url.rstrip("/"), token
        self._counted: dict[str, tuple[float, datetime, int]] = {}  # tenant -> (asked at, day, trained then)
        self._since: dict[str, int] = {}  # tenant -> tokens admitted since the gateway was asked

    async def admit(self, tenant: str, tokens: int) -> None:
        """Count ``tokens`` against the tenant's day, or raise the 429 that names the quota."""
        if not self.limit:
            return
        today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        asked_at, day, counted = self._counted.get(tenant, (0.0, today, 0))
        if day != today or time.monotonic() - asked_at > QUOTA_FRESH_S:
            counted = await self._trained_today(tenant, today)
            self._counted[tenant], self._since[tenant] = (time.monotonic(), today, counted), 0
        used = counted + self._since.get(tenant, 0)
        if used + tokens > self.limit:
            raise UserError(f"quota trained_tokens_per_day: tenant {tenant!r} trained on {used} tokens since 00:00 "
                            f"UTC and this request has {tokens}, past its limit (setting "
                            f"quotas.trained_tokens_per_day = {self.limit}); nothing of it ran")
        self._since[tenant] = self._since.get(tenant, 0) + tokens

    async def _trained_today(self, tenant: str, today: datetime) -> int:
        url = f"{self.gateway_url}/v1/usage"
        try:
            async with gateway.async_client(self.gateway_url, self.token, timeout_s=10.0, from_settings=False) as http:
                answer = await http.get("/v1/usage", params={"tenant": tenant, "since": today.isoformat()})
            answer.raise_for_status()
            totals = answer.json()["totals"]
            return int(totals["trained_tokens"]) + int(totals["sft_tokens"])
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise UserError(f"quota trained_tokens_per_day: the gateway's usage ({url}) did not answer ({exc}); a "
                            "request that trains is refused until it does") from None


def create_app(settings: Settings, bus: str = "off") -> FastAPI:
    """The API; ``bus``: ``required`` (connect at start or fail: tenants' keys need it),
    ``optional`` (meter usage where the bus answers, say so where not) or ``off``."""
    quota = settings.quotas.trained_tokens_per_day
    api = TrainingAPI(settings.data_dir.resolve(),
                      DailyQuota(quota, settings.resolved_gateway_url, settings.service_token) if quota else None)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        where = natsusers.redacted(settings.resolved_nats_url)
        if bus == "required":
            api.bus = await Bus.for_settings(settings, "training_api")
        elif bus == "optional":
            try:  # a moment, not the services' 30 s: the API serves either way
                api.bus = await Bus.connect(settings.resolved_nats_url, "training_api",
                                            BusConfig(connect_timeout_s=OPTIONAL_BUS_S))
            except (ConnectionError, OSError) as exc:
                log.warning("usage of the training API is not metered: no NATS at %s (%s)", where, exc)
        if api.bus is not None:
            log.info("usage of the training API is metered on NATS at %s", where)
        if settings.auth == "keys":
            assert api.bus is not None, "tenants' keys are read from the bus"
            api.keys = KeyCheck(api.bus, service_token=settings.service_token)
        try:
            yield
        finally:
            if api.bus is not None:
                await asyncio.gather(*api.pending(), return_exceptions=True)
                await api.bus.close()

    app = FastAPI(title="Flywheel training API (Tinker-compatible)", lifespan=lifespan)
    app.state.api = api

    async def body_of(request: Request, model: Any) -> Any:
        try:
            return model.model_validate(await request.json())
        except ValueError as exc:
            raise HTTPException(422, f"{request.url.path}: {exc}") from None

    def tenant_of(request: Request) -> str:
        return str(request.state.tenant)

    async def authorize(request: Request) -> None:
        """The request's tenant (``request.state.tenant``) from its key; 401/403 as the module says."""
        key = request.headers.get("x-api-key", "")
        if not key.startswith(KEY_PREFIX):
            raise HTTPException(401, f"no API key: send X-API-Key: {KEY_PREFIX}... (the tinker SDK does"
                                     + (f"; here {KEY_PREFIX} then a Flywheel key, fw_..." if api.keys else "") + ")")
        if api.keys is None:
            request.state.tenant = OPEN_TENANT
            return
        try:
            who = await api.keys.authorize(key.removeprefix(KEY_PREFIX), "POST", request.url.path)
        except KeyRefused as exc:
            raise HTTPException(401, f"{exc} (the training API takes {KEY_PREFIX} then the key)") from None
        except ScopeRefused as exc:
            raise HTTPException(403, str(exc)) from None
        if who.service:
            raise HTTPException(403, "the deployment's service token trains no models: use a tenant's key")
        request.state.tenant = who.tenant

    # Every route but the probe's wants a key (a dependency: a middleware costs each request more).
    router = APIRouter(prefix="/api/v1", dependencies=[Depends(authorize)])

    @app.get("/api/v1/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @router.post("/client/config")
    async def client_config() -> dict[str, Any]:
        return {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "parallel_fwdbwd_chunks": False,
                "proto_compress_fwdbwd": False, "use_pyqwest_transport": False, "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False, "sample_join_sampling_session": False}

    @router.post("/client/dynamic_config")
    async def dynamic_config() -> dict[str, Any]:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @router.get("/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        names = sorted({*BUILDERS, *api.bases})
        return {"supported_models": [{"model_name": n, "trainable": True, "sampleable": False} for n in names]}

    @router.post("/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        await body_of(request, tt.CreateSessionRequest)
        session = f"session-{api.new_id()}"
        api.sessions[session] = Session(session, tenant_of(request), time.monotonic())
        return {"type": "create_session", "session_id": session}

    @router.post("/session_heartbeat")
    async def heartbeat(request: Request) -> dict[str, Any]:
        beat = await body_of(request, tt.SessionHeartbeatRequest)
        api.session(beat.session_id, tenant_of(request)).beat = time.monotonic()
        return {"type": "session_heartbeat"}

    @router.post("/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request) -> None:
        """The session is done: its models' and samplers' adapters are let go (checkpoints stay)."""
        api.session(session_id, tenant_of(request))
        del api.sessions[session_id]
        for sampler in [s for s in api.samplers.values() if s.session == session_id]:
            del api.samplers[sampler.id]
            if sampler.adapter is not None:
                await api.torch(sampler.base.remove, sampler.adapter.name)
        for model in [m for m in api.models.values() if m.session == session_id]:
            if model.tail is not None:
                await asyncio.gather(model.tail, return_exceptions=True)
            del api.models[model.id]
            await api.torch(model.base.remove, model.id)

    @router.post("/telemetry")
    async def telemetry() -> dict[str, str]:
        return {"status": "accepted"}

    @router.post("/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        asked = await body_of(request, tt.CreateModelRequest)
        session = api.session(asked.session_id, tenant_of(request))
        if asked.lora_config is None:
            raise HTTPException(422, "lora_config: this server trains LoRA adapters (full-weight models train in a "
                                     "run of their own: flywheel run)")
        lora = asked.lora_config
        model_id = model_id_of(session.id, asked.model_seq_id)

        async def make(_: str) -> dict[str, Any]:
            base = await api.base(asked.base_model)
            adapter = await api.torch(base.add, model_id, lora.rank, lora.seed, lora.train_attn,
                                              lora.train_mlp, lora.train_unembed)
            api.models[model_id] = Model(model_id, session.id, session.tenant, base, adapter)
            return {"model_id": model_id, "type": "create_model"}

        return api.future(session.tenant, make, model_id)

    @router.post("/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        model = api.model((await body_of(request, tt.GetInfoRequest)).model_id, tenant_of(request))
        arch = type(model.base.model).__name__
        return {"type": "get_info", "model_id": model.id, "model_name": model.base.name, "is_lora": True,
                "lora_rank": model.adapter.rank,
                "model_data": {"arch": arch, "model_name": model.base.name, "tokenizer_id": model.base.name}}

    @router.post("/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        if PROTO not in request.headers.get("content-type", ""):
            raise HTTPException(415, f"forward_backward takes the SDK's protobuf body ({PROTO})")
        message = pb.ForwardBackwardRequest()
        try:
            message.ParseFromString(await request.body())
            data = [_datum(d) for d in message.data]
            config = _loss_config(message)
        except (ValueError, UserError) as exc:
            raise HTTPException(422, f"forward_backward: {exc}") from None
        model = api.model(message.model_id, tenant_of(request))
        tokens = sum(len(d.tokens) for d in data)
        refused: UserError | None = None
        if not message.forward_only and api.quota is not None and message.seq_id not in model.seen:
            try:
                await api.quota.admit(model.tenant, tokens)  # a retry was counted the first time
            except UserError as exc:
                refused = exc  # its future fails saying so, in its place in the model's order

        def run() -> bytes:
            if refused is not None:
                raise refused
            outputs, metrics = model.base.forward_backward(model.adapter, data, message.loss_fn, message.forward_only,
                                                           config)
            return _output(outputs, metrics)

        def metered(result: bytes, request_id: str) -> bytes:
            if message.forward_only:
                api.meter(model.session, model.tenant, request_id, prompt_tokens=tokens)
            else:
                api.meter(model.session, model.tenant, request_id, trained_tokens=tokens)
            return result

        return api.ordered(model, message.seq_id, run, metered)

    @router.post("/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        asked = await body_of(request, tt.OptimStepRequest)
        model = api.model(asked.model_id, tenant_of(request))
        params = asked.optim_params
        if not isinstance(params, tt.AdamParams):
            raise HTTPException(422, f"optim_params: this server steps AdamW (adam_params), not {params!r}")

        def run() -> dict[str, Any]:
            return {"metrics": model.base.optim_step(model.adapter, params.learning_rate, params.beta1, params.beta2,
                                                     params.eps, params.weight_decay, params.grad_clip_norm)}

        return api.ordered(model, asked.seq_id, run)

    @router.post("/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        asked = await body_of(request, tt.SaveWeightsRequest)
        model = api.model(asked.model_id, tenant_of(request))
        name = asked.path or f"step-{model.adapter.steps}"
        return api.save_named(model, name, asked.seq_id, asked.overwrite, {"type": "save_weights"})

    @router.post("/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        asked = await body_of(request, tt.LoadWeightsRequest)
        tenant = tenant_of(request)
        where = api.checkpoint_at(asked.path, tenant)
        if asked.model_id is None:  # a new model made from the checkpoint: its first request
            session = api.session(asked.session_id, tenant)
            if asked.model_seq_id is None:
                raise HTTPException(422, "load_weights: give model_id, or session_id and model_seq_id (a new model)")
            return api.future(tenant, lambda _: from_checkpoint(api, session, asked.model_seq_id, where, asked),
                              model_id_of(session.id, asked.model_seq_id))
        model = api.model(asked.model_id, tenant)

        def run() -> dict[str, Any]:
            model.base.load(model.adapter, where, asked.optimizer)
            return {"path": asked.path, "model_id": model.id, "type": "load_weights"}

        return api.ordered(model, asked.seq_id, run)

    @router.post("/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
        asked = await body_of(request, tt.SaveWeightsForSamplerRequest)
        model = api.model(asked.model_id, tenant_of(request))
        if asked.path is not None:  # a named checkpoint, for create_sampling_client(model_path=...)
            return api.save_named(model, asked.path, asked.seq_id, True, {})
        if asked.sampling_session_seq_id is None:
            raise HTTPException(422, "save_weights_for_sampler: give path (a checkpoint) or sampling_session_seq_id "
                                     "(a sampler of the weights as they are)")
        sampler_id = sampler_id_of(model.session, asked.sampling_session_seq_id)

        def snapshot() -> Adapter:  # the weights as they are at this point of the model's requests
            return model.base.snapshot(model.adapter, sampler_id)

        def keep(adapter: Adapter, _: str) -> dict[str, Any]:  # on the event loop: the samplers are its
            api.samplers[sampler_id] = Sampler(sampler_id, model.session, model.tenant, model.base, adapter, None)
            # An RL loop makes a sampler a step: the session's oldest snapshots go past MAX_SNAPSHOTS.
            snapshots = [s for s in api.samplers.values() if s.session == model.session and s.model_path is None
                         and s.adapter is not None]
            for gone in snapshots[:-MAX_SNAPSHOTS]:
                del api.samplers[gone.id]
                api.let_go[gone.id] = (f"a newer snapshot of the session's weights replaced it ({MAX_SNAPSHOTS} are "
                                       "kept)")
                api.background(api.torch(gone.base.remove, gone.id))
            return {"sampling_session_id": sampler_id}

        return api.ordered(model, asked.seq_id, snapshot, keep)

    @router.post("/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        asked = await body_of(request, tt.CreateSamplingSessionRequest)
        tenant = tenant_of(request)
        session = api.session(asked.session_id, tenant)
        sampler_id = sampler_id_of(session.id, asked.sampling_session_seq_id)
        if asked.model_path is None:
            if asked.base_model is None:
                raise HTTPException(422, "create_sampling_session: give model_path or base_model")
            try:
                base = await api.base(asked.base_model)
            except UserError as exc:
                raise HTTPException(422, str(exc)) from None
            api.samplers[sampler_id] = Sampler(sampler_id, session.id, tenant, base, None, None)
        else:
            base, adapter = await api.adapter_from(api.checkpoint_at(asked.model_path, tenant), sampler_id, False)
            api.samplers[sampler_id] = Sampler(sampler_id, session.id, tenant, base, adapter, asked.model_path)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @router.get("/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request) -> dict[str, Any]:
        sampler = api.sampler(sampler_id, tenant_of(request))
        return {"sampler_id": sampler.id, "base_model": sampler.base.name, "model_path": sampler.model_path}

    @router.post("/asample")
    async def asample(request: Request) -> dict[str, Any]:
        asked = await body_of(request, tt.SampleRequest)
        if asked.sampling_session_id is None:
            raise HTTPException(422, "asample: give sampling_session_id (create_sampling_session makes one)")
        sampler = api.sampler(asked.sampling_session_id, tenant_of(request))
        if not 1 <= asked.num_samples <= MAX_SAMPLES:
            raise HTTPException(422, f"num_samples={asked.num_samples}: 1 to {MAX_SAMPLES}")
        if asked.prompt_alt_tokens_k or asked.target_prompt_logprobs is not None:
            raise HTTPException(422, "asample: prompt_alt_tokens_k and target_prompt_logprobs are not served yet; "
                                     "prompt_logprobs and the top-k logprobs are")
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
            if not 0 <= getattr(asked, name) <= MAX_TOP_K:
                raise HTTPException(422, f"{name}={getattr(asked, name)}: 0 to {MAX_TOP_K}")
        if asked.prompt_logprobs_last_n is not None and not asked.prompt_logprobs:
            raise HTTPException(422, "prompt_logprobs_last_n: applies to prompt logprobs; set prompt_logprobs")
        params = replace(sampling_of(asked.sampling_params), top_logprobs=asked.topk_sample_logprobs)
        prompt = asked.prompt.to_ints()
        scored = bool(asked.prompt_logprobs or asked.topk_prompt_logprobs)

        async def work(request_id: str) -> bytes:
            sampled = await api.torch(sampler.base.sample, sampler.adapter, prompt, asked.num_samples, params)
            scores = (await api.torch(sampler.base.score_prompt, sampler.adapter, prompt, asked.topk_prompt_logprobs,
                                      asked.prompt_logprobs_last_n) if scored else None)
            api.meter(sampler.session, sampler.tenant, request_id, prompt_tokens=len(prompt),
                      sampled_tokens=sum(len(one.tokens) for one in sampled))
            return _samples(sampled, scores, bool(asked.prompt_logprobs), asked.topk_sample_logprobs)

        answer = api.future(sampler.tenant, work)
        return {**answer, "sample_sequence_ids": [f"{answer['request_id']}-{i}" for i in range(asked.num_samples)]}

    @router.post("/retrieve_future")
    async def retrieve_future(request: Request) -> Any:
        asked = await body_of(request, tt.FutureRetrieveRequest)
        tenant, future = api.results.get(asked.request_id, ("", None))
        if future is None or tenant != tenant_of(request):
            return {"error": f"request {asked.request_id!r}: no such request on this server (or its result was "
                             f"let go: the newest {MAX_RESULTS} are kept){api.gone(asked.request_id)}",
                    "category": "user"}
        try:
            result = await asyncio.wait_for(asyncio.shield(future), POLL_S)
        except TimeoutError:
            return {"type": "try_again", "request_id": asked.request_id, "queue_state": "active"}
        except Exception as exc:  # the request failed: its future carries why
            return failure(exc)
        if isinstance(result, bytes):
            return Response(result, media_type=PROTO)
        return result

    app.include_router(router)
    return app




def _array(tensor: Any) -> np.ndarray:
    """A proto Tensor as a flat numpy array (a sparse one made dense)."""
    dtype = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64}.get(tensor.dtype)
    if dtype is None:
        raise UserError(f"a loss_fn_inputs tensor of dtype {tensor.dtype}: float32 or int64")
    if tensor.HasField("sparse_csr"):
        values = np.frombuffer(tensor.sparse_csr.values, dtype=dtype)
        rows = np.frombuffer(tensor.sparse_csr.crow_indices, dtype=np.int64)
        cols = np.frombuffer(tensor.sparse_csr.col_indices, dtype=np.int64)
        shape = list(tensor.shape)
        dense = np.zeros(shape, dtype=dtype)
        for row in range(len(rows) - 1):
            dense[row, cols[rows[row]:rows[row + 1]]] = values[rows[row]:rows[row + 1]]
        return dense.reshape(-1)
    return np.frombuffer(tensor.dense, dtype=dtype).copy()


def _datum(message: Any) -> Datum:
    tokens: list[int] = []
    for chunk in message.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise UserError(f"a model_input chunk of kind {chunk.WhichOneof('chunk')}: this server takes text tokens")
        tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
    return Datum(tokens, {name: _array(t) for name, t in message.loss_fn_inputs.items()})


def _loss_config(message: Any) -> dict[str, float]:
    """The request's ``loss_fn_config``: the SDK's tagged values (v2) where it sends them, else
    the older map of numbers; a text value is refused (no loss here reads one)."""
    if message.loss_fn_config_v2:
        config = {}
        for key, value in message.loss_fn_config_v2.items():
            if value.WhichOneof("value") != "number":
                raise UserError(f"loss_fn_config[{key!r}]: a number (this server's losses read no text)")
            config[key] = value.number
        return config
    return dict(message.loss_fn_config)


def _output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """The SDK's ForwardBackwardOutput message: one ArrayRecord, each field batched over datums."""
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    record = message.loss_fn_outputs.add()
    record.num_datums = len(outputs)
    for name in outputs[0] if outputs else ():
        arrays = [np.ascontiguousarray(o[name], dtype=np.float32) for o in outputs]
        offsets = np.cumsum([0, *(a.nbytes for a in arrays)]).astype(np.int64)
        record.fields[name].CopyFrom(pb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays),
                                                      offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32))
    return message.SerializeToString()


def _samples(sampled: list[Sampled], scores: PromptScores | None, prompt_logprobs: bool, top_k: int) -> bytes:
    """The SDK's SampleResponse message: the samples, and the prompt's logprobs and top-k
    logprobs when asked (NaN and empty rows where a position has none)."""
    message = pb.SampleResponse()
    for one in sampled:
        sequence = message.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if one.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(one.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(one.logprobs, dtype=np.float32).tobytes())
        if top_k:
            sequence.topk_sampled_logprobs.CopyFrom(_top(one.top, top_k))
    if scores is not None and prompt_logprobs:
        message.prompt_logprobs = np.asarray(scores.logprobs, dtype=np.float32).tobytes()
    if scores is not None and scores.top is not None:
        message.topk_prompt_logprobs.CopyFrom(_top(scores.top, len(scores.top[-1][0]) if scores.top else 0))
    return message.SerializeToString()


def _top(rows: list[tuple[list[int], list[float]]], k: int) -> Any:
    """The SDK's TopkLogprobs: a dense N x k matrix, empty cells token 0 and logprob -99999."""
    ids = np.zeros((len(rows), k), dtype=np.int32)
    values = np.full((len(rows), k), EMPTY_LOGPROB, dtype=np.float32)
    for i, (row_ids, row_values) in enumerate(rows):
        ids[i, :len(row_ids)] = row_ids
        values[i, :len(row_values)] = row_values
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=values.tobytes(), k=k, length=len(rows))


def main(argv: list[str] | None = None) -> None:
    settings = Settings.load()
    parser = argparse.ArgumentParser(prog="python -m flywheel_trainer.tinker_api",
                                     description="A Tinker-compatible training API (see the module).")
    parser.add_argument("--host", default=settings.training_api_host,
                        help="address to listen on (setting training_api_host); open: loopback only")
    parser.add_argument("--port", type=int, default=settings.training_api_port, help="setting training_api_port")
    args = parser.parse_args(argv)
    if settings.auth == "open":
        try:
            check_open("the training API", args.host)
        except ValueError as exc:
            parser.error(str(exc))
    import uvicorn  # imported here: the server, for this process alone

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Keys are read from the bus: with them it must answer; open, usage is metered where it does.
    uvicorn.run(create_app(settings, bus="required" if settings.auth == "keys" else "optional"),
                host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
