"""A training API the ``tinker`` SDK speaks: training loops written against it train here.

``python -m flywheel_trainer.tinker_api [--port 8430]`` serves, on loopback, the routes of the
Tinker API (``/api/v1/...``) that a supervised or RL loop uses: the client's feature flags,
sessions and their heartbeats, ``create_model`` (a LoRA adapter on a base model Flywheel
resolves: ``tiny``, ``smollm2``, a model folder), ``get_info``, ``forward``/``forward_backward``
(losses ``cross_entropy`` and ``importance_sampling``, :mod:`flywheel_trainer.adapter_host`),
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
bodies, and fwd/bwd chunks one after another. Keys: this version serves one tenant on
loopback, as the embedded stack's gateway does when open: any key with the SDK's ``tml-``
prefix; with setting ``auth = "keys"`` it refuses to start. Not served yet: the ``ppo``,
``cispo`` and ``gspo`` losses, custom losses, prompt logprobs and top-k logprobs of samples,
sampling through Flywheel's inference service (with its batching), several replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from tinker import types as tt
from tinker.proto import tinker_public_pb2 as pb

from flywheel.contract.settings import Settings
from flywheel.sdk.models import BUILDERS
from flywheel_trainer.adapter_host import Adapter, Base, Datum, Sampled, Sampling, UserError, checkpoint_of

POLL_S = 10.0  # how long retrieve_future holds a poll for a result before try_again
MAX_RESULTS = 10_000  # results kept for retrieve_future (the oldest go first)
NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")  # a checkpoint's name
PATH = re.compile(r"^tinker://([A-Za-z0-9_:-]+)/weights/([A-Za-z0-9._-]{1,128})$")
PROTO = "application/x-protobuf"
MAX_SAMPLES = 256  # samples of one request
MAX_SNAPSHOTS = 16  # samplers of a session's weights snapshots kept (save_weights_for_sampler), newest first
MAX_NEW_TOKENS = 4096  # tokens of one sample


@dataclass
class Model:
    """A training model: its adapter on its base, the order its requests run in."""

    id: str
    session: str
    base: Base
    adapter: Adapter
    next_seq: int = 1
    waiting: dict[int, tuple[str, Callable[[], Any], Callable[[Any], Any] | None]] = field(default_factory=dict)
    seen: dict[int, str] = field(default_factory=dict)  # seq_id -> the request id it was answered
    tail: asyncio.Future[None] | None = None


@dataclass
class Sampler:
    """A sampling session: the adapter it samples from (None: the base alone)."""

    id: str
    session: str
    base: Base
    adapter: Adapter | None
    model_path: str | None


class TrainingAPI:
    """The API's state: bases, models, sessions, futures."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.bases: dict[str, Base] = {}
        self.models: dict[str, Model] = {}
        self.sessions: dict[str, float] = {}  # session id -> last heartbeat
        self.results: dict[str, asyncio.Future[Any]] = {}
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

    def checkpoint(self, model_id: str, name: str) -> Path:
        return self.data_dir / "tinker" / model_id / f"{name}.pt"

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

    def future(self, work: Callable[[], Any], model_id: str | None = None) -> dict[str, Any]:
        """Run ``work`` (a coroutine function) in the background; its future's answer."""
        request_id = secrets.token_hex(12)
        self._keep(request_id, asyncio.ensure_future(work()))
        return {"request_id": request_id, **({"model_id": model_id} if model_id else {})}

    def _keep(self, request_id: str, future: asyncio.Future[Any]) -> None:
        self.results[request_id] = future
        while len(self.results) > MAX_RESULTS:
            del self.results[next(iter(self.results))]

    def background(self, work: Any) -> None:
        """``work`` (an awaitable) run to its end, held until then."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def ordered(self, model: Model, seq_id: int | None, work: Callable[[], Any],
                then: Callable[[Any], Any] | None = None) -> dict[str, Any]:
        """``work`` (blocking, run in a thread) after every earlier ``seq_id`` of ``model``, its
        result passed through ``then`` on the event loop; a ``seq_id`` answered before gets that
        answer's future (a retry)."""
        seq = model.next_seq if seq_id is None else seq_id
        if seq in model.seen:
            return {"request_id": model.seen[seq], "model_id": model.id}
        if seq < model.next_seq:
            raise HTTPException(400, f"seq_id {seq}: model {model.id} has run its requests up to {model.next_seq - 1}")
        request_id = secrets.token_hex(12)
        self._keep(request_id, asyncio.get_running_loop().create_future())
        model.seen[seq] = request_id
        model.waiting[seq] = (request_id, work, then)
        while model.next_seq in model.waiting:
            rid, job, after = model.waiting.pop(model.next_seq)
            model.next_seq += 1
            model.tail = asyncio.ensure_future(self._after(model.tail, rid, job, after))
        return {"request_id": request_id, "model_id": model.id}

    async def _after(self, before: asyncio.Future[None] | None, request_id: str, job: Callable[[], Any],
                     then: Callable[[Any], Any] | None) -> None:
        if before is not None:
            await asyncio.gather(before, return_exceptions=True)
        future = self.results.get(request_id)
        try:
            result = await self.torch(job)
            if then is not None:
                result = then(result)
        except Exception as exc:  # the request's own failure: its future says it, the server goes on
            if future is not None and not future.done():
                future.set_exception(exc)
            return
        if future is not None and not future.done():
            future.set_result(result)

    def sampler(self, sampler_id: str) -> Sampler:
        found = self.samplers.get(sampler_id)
        if found is None:
            why = self.let_go.get(sampler_id)
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

    def save_named(self, model: Model, name: str, seq_id: int | None, overwrite: bool, answer: dict[str, Any]
                   ) -> dict[str, Any]:
        """Save ``model``'s adapter as checkpoint ``name`` in its request order; the future of
        ``answer`` with the checkpoint's ``path``."""
        if not NAME.match(name):
            raise HTTPException(422, f"path {name!r}: a checkpoint's name is letters, digits, '.', '_' and '-'")
        where = self.checkpoint(model.id, name)

        def run() -> dict[str, Any]:
            if where.exists() and not overwrite:
                raise UserError(f"path {name!r}: model {model.id} has a checkpoint of that name; give another, or "
                                "overwrite=True")
            model.base.save(model.adapter, where)
            return {"path": f"tinker://{model.id}/weights/{name}", **answer}

        return self.ordered(model, seq_id, run)

    def checkpoint_at(self, path: str) -> Path:
        """The file of a ``tinker://MODEL/weights/NAME`` path; 404 saying so when there is none."""
        found = PATH.match(path)
        if found is None or not self.checkpoint(found.group(1), found.group(2)).is_file():
            raise HTTPException(404, f"path {path!r}: no such checkpoint on this server (save_weights answers with "
                                     "its tinker://MODEL/weights/NAME path)")
        return self.checkpoint(found.group(1), found.group(2))

    def model(self, model_id: str | None) -> Model:
        found = self.models.get(model_id or "")
        if found is None:
            raise HTTPException(404, f"model_id {model_id!r}: no such model on this server (create_model makes one)")
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


async def from_checkpoint(api: TrainingAPI, session: str, model_seq_id: int, where: Path, asked: Any
                          ) -> dict[str, Any]:
    """A new model of ``session``: an adapter like the checkpoint's, set to it (its optimizer too
    when asked)."""
    model_id = model_id_of(session, model_seq_id)
    base, adapter = await api.adapter_from(where, model_id, asked.optimizer, asked.base_model)
    api.models[model_id] = Model(model_id, session, base, adapter)
    return {"path": asked.path, "model_id": model_id, "type": "load_weights"}


def failure(exc: BaseException) -> dict[str, Any]:
    user = isinstance(exc, UserError | HTTPException)
    text = exc.detail if isinstance(exc, HTTPException) else str(exc)
    return {"error": f"{type(exc).__name__}: {text}" if not user else str(text), "category": "user" if user else
            "server"}


def create_app(settings: Settings) -> FastAPI:
    app = FastAPI(title="Flywheel training API (Tinker-compatible)")
    api = app.state.api = TrainingAPI(settings.data_dir.resolve())

    async def body_of(request: Request, model: Any) -> Any:
        try:
            return model.model_validate(await request.json())
        except ValueError as exc:
            raise HTTPException(422, f"{request.url.path}: {exc}") from None

    @app.middleware("http")
    async def keyed(request: Request, call_next: Any) -> Any:
        key = request.headers.get("x-api-key", "")
        if request.url.path.startswith("/api/v1/") and request.url.path != "/api/v1/healthz" and \
                not key.startswith("tml-"):
            return JSONResponse({"detail": "no API key: send X-API-Key: tml-... (the tinker SDK does)"}, 401)
        return await call_next(request)

    @app.get("/api/v1/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config() -> dict[str, Any]:
        return {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "parallel_fwdbwd_chunks": False,
                "proto_compress_fwdbwd": False, "use_pyqwest_transport": False, "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False, "sample_join_sampling_session": False}

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config() -> dict[str, Any]:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        names = sorted({*BUILDERS, *api.bases})
        return {"supported_models": [{"model_name": n, "trainable": True, "sampleable": False} for n in names]}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        await body_of(request, tt.CreateSessionRequest)
        session = f"session-{secrets.token_hex(8)}"
        api.sessions[session] = time.monotonic()
        return {"type": "create_session", "session_id": session}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> dict[str, Any]:
        beat = await body_of(request, tt.SessionHeartbeatRequest)
        if beat.session_id not in api.sessions:
            raise HTTPException(404, f"session {beat.session_id!r}: no such session (create_session makes one)")
        api.sessions[beat.session_id] = time.monotonic()
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str) -> None:
        """The session is done: its models' and samplers' adapters are let go (checkpoints stay)."""
        if api.sessions.pop(session_id, None) is None:
            raise HTTPException(404, f"session {session_id!r}: no such session")
        for sampler in [s for s in api.samplers.values() if s.session == session_id]:
            del api.samplers[sampler.id]
            if sampler.adapter is not None:
                await api.torch(sampler.base.remove, sampler.adapter.name)
        for model in [m for m in api.models.values() if m.session == session_id]:
            if model.tail is not None:
                await asyncio.gather(model.tail, return_exceptions=True)
            del api.models[model.id]
            await api.torch(model.base.remove, model.id)

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict[str, str]:
        return {"status": "accepted"}

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        asked = await body_of(request, tt.CreateModelRequest)
        if asked.session_id not in api.sessions:
            raise HTTPException(404, f"session {asked.session_id!r}: no such session (create_session makes one)")
        if asked.lora_config is None:
            raise HTTPException(422, "lora_config: this server trains LoRA adapters (full-weight models train in a "
                                     "run of their own: flywheel run)")
        lora = asked.lora_config
        model_id = model_id_of(asked.session_id, asked.model_seq_id)

        async def make() -> dict[str, Any]:
            base = await api.base(asked.base_model)
            adapter = await api.torch(base.add, model_id, lora.rank, lora.seed, lora.train_attn,
                                              lora.train_mlp, lora.train_unembed)
            api.models[model_id] = Model(model_id, asked.session_id, base, adapter)
            return {"model_id": model_id, "type": "create_model"}

        return api.future(make, model_id)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        model = api.model((await body_of(request, tt.GetInfoRequest)).model_id)
        arch = type(model.base.model).__name__
        return {"type": "get_info", "model_id": model.id, "model_name": model.base.name, "is_lora": True,
                "lora_rank": model.adapter.rank,
                "model_data": {"arch": arch, "model_name": model.base.name, "tokenizer_id": model.base.name}}

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        if PROTO not in request.headers.get("content-type", ""):
            raise HTTPException(415, f"forward_backward takes the SDK's protobuf body ({PROTO})")
        message = pb.ForwardBackwardRequest()
        try:
            message.ParseFromString(await request.body())
            data = [_datum(d) for d in message.data]
        except (ValueError, UserError) as exc:
            raise HTTPException(422, f"forward_backward: {exc}") from None
        model = api.model(message.model_id)

        def run() -> bytes:
            outputs, metrics = model.base.forward_backward(model.adapter, data, message.loss_fn, message.forward_only)
            return _output(outputs, metrics)

        return api.ordered(model, message.seq_id, run)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        asked = await body_of(request, tt.OptimStepRequest)
        model = api.model(asked.model_id)
        params = asked.optim_params
        if not isinstance(params, tt.AdamParams):
            raise HTTPException(422, f"optim_params: this server steps AdamW (adam_params), not {params!r}")

        def run() -> dict[str, Any]:
            return {"metrics": model.base.optim_step(model.adapter, params.learning_rate, params.beta1, params.beta2,
                                                     params.eps, params.weight_decay, params.grad_clip_norm)}

        return api.ordered(model, asked.seq_id, run)

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        asked = await body_of(request, tt.SaveWeightsRequest)
        model = api.model(asked.model_id)
        name = asked.path or f"step-{model.adapter.steps}"
        return api.save_named(model, name, asked.seq_id, asked.overwrite, {"type": "save_weights"})

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        asked = await body_of(request, tt.LoadWeightsRequest)
        where = api.checkpoint_at(asked.path)
        if asked.model_id is None:  # a new model made from the checkpoint: its first request
            if asked.session_id not in api.sessions or asked.model_seq_id is None:
                raise HTTPException(404, f"session {asked.session_id!r}: no such session (create_session makes one)")
            return api.future(functools.partial(from_checkpoint, api, asked.session_id, asked.model_seq_id, where,
                                                asked), model_id_of(asked.session_id, asked.model_seq_id))
        model = api.model(asked.model_id)

        def run() -> dict[str, Any]:
            model.base.load(model.adapter, where, asked.optimizer)
            return {"path": asked.path, "model_id": model.id, "type": "load_weights"}

        return api.ordered(model, asked.seq_id, run)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
        asked = await body_of(request, tt.SaveWeightsForSamplerRequest)
        model = api.model(asked.model_id)
        if asked.path is not None:  # a named checkpoint, for create_sampling_client(model_path=...)
            return api.save_named(model, asked.path, asked.seq_id, True, {})
        if asked.sampling_session_seq_id is None:
            raise HTTPException(422, "save_weights_for_sampler: give path (a checkpoint) or sampling_session_seq_id "
                                     "(a sampler of the weights as they are)")
        sampler_id = sampler_id_of(model.session, asked.sampling_session_seq_id)

        def snapshot() -> Adapter:  # the weights as they are at this point of the model's requests
            return model.base.snapshot(model.adapter, sampler_id)

        def keep(adapter: Adapter) -> dict[str, Any]:  # on the event loop: the samplers are its
            api.samplers[sampler_id] = Sampler(sampler_id, model.session, model.base, adapter, None)
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

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        asked = await body_of(request, tt.CreateSamplingSessionRequest)
        if asked.session_id not in api.sessions:
            raise HTTPException(404, f"session {asked.session_id!r}: no such session (create_session makes one)")
        sampler_id = sampler_id_of(asked.session_id, asked.sampling_session_seq_id)
        if asked.model_path is None:
            if asked.base_model is None:
                raise HTTPException(422, "create_sampling_session: give model_path or base_model")
            try:
                base = await api.base(asked.base_model)
            except UserError as exc:
                raise HTTPException(422, str(exc)) from None
            api.samplers[sampler_id] = Sampler(sampler_id, asked.session_id, base, None, None)
        else:
            base, adapter = await api.adapter_from(api.checkpoint_at(asked.model_path), sampler_id, False)
            api.samplers[sampler_id] = Sampler(sampler_id, asked.session_id, base, adapter, asked.model_path)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> dict[str, Any]:
        sampler = api.sampler(sampler_id)
        return {"sampler_id": sampler.id, "base_model": sampler.base.name, "model_path": sampler.model_path}

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict[str, Any]:
        asked = await body_of(request, tt.SampleRequest)
        if asked.sampling_session_id is None:
            raise HTTPException(422, "asample: give sampling_session_id (create_sampling_session makes one)")
        sampler = api.sampler(asked.sampling_session_id)
        if not 1 <= asked.num_samples <= MAX_SAMPLES:
            raise HTTPException(422, f"num_samples={asked.num_samples}: 1 to {MAX_SAMPLES}")
        if asked.prompt_logprobs or asked.topk_prompt_logprobs or asked.topk_sample_logprobs or \
                asked.prompt_alt_tokens_k or asked.target_prompt_logprobs is not None:
            raise HTTPException(422, "asample: prompt logprobs, top-k logprobs and alternative tokens are not served "
                                     "yet; ask for the samples alone")
        params = sampling_of(asked.sampling_params)
        prompt = asked.prompt.to_ints()

        def run() -> bytes:
            return _samples(sampler.base.sample(sampler.adapter, prompt, asked.num_samples, params))

        answer = api.future(lambda: api.torch(run))
        return {**answer, "sample_sequence_ids": [f"{answer['request_id']}-{i}" for i in range(asked.num_samples)]}

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Any:
        asked = await body_of(request, tt.FutureRetrieveRequest)
        future = api.results.get(asked.request_id)
        if future is None:
            return {"error": f"request {asked.request_id!r}: no such request on this server (or its result was "
                             "let go: the newest 10000 are kept)", "category": "user"}
        try:
            result = await asyncio.wait_for(asyncio.shield(future), POLL_S)
        except TimeoutError:
            return {"type": "try_again", "request_id": asked.request_id, "queue_state": "active"}
        except Exception as exc:  # the request failed: its future carries why
            return failure(exc)
        if isinstance(result, bytes):
            return Response(result, media_type=PROTO)
        return result

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


def _samples(sampled: list[Sampled]) -> bytes:
    """The SDK's SampleResponse message."""
    message = pb.SampleResponse()
    for one in sampled:
        message.sequences.add(stop_reason=pb.STOP_REASON_STOP if one.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
                              tokens=np.asarray(one.tokens, dtype=np.int32).tobytes(),
                              logprobs=np.asarray(one.logprobs, dtype=np.float32).tobytes())
    return message.SerializeToString()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flywheel_trainer.tinker_api",
                                     description="A Tinker-compatible training API on loopback (see the module).")
    parser.add_argument("--port", type=int, default=8430)
    args = parser.parse_args(argv)
    settings = Settings.load()
    if settings.auth == "keys":
        parser.error("the training API serves one tenant on loopback in this version: it does not run with "
                     "auth = keys (tenants' keys) yet")
    import uvicorn

    uvicorn.run(create_app(settings), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
