"""OpenAI-compatible HTTP API over each run's current policy.

``POST /v1/chat/completions`` and ``POST /v1/completions`` answer with the policy of the
run named by ``model`` (the run id; 404 naming it when the runs bucket has no such run),
sampled through the same batching queue as the run's rollouts; a finished run's answers
with its last weights, and ``model = RUN@STEP`` with the weights of trainer step STEP while
the run keeps them (the newest few and those its evals are pinned to; 404 naming the steps
it keeps otherwise), loaded in a model of their own; a run of kind ``eval`` that
``flywheel eval --model NAME`` registered answers with its model's own weights. Sampling fields override
the run's configured sampling. Every choice carries the sampled tokens' log-probabilities
(``log_softmax(logits / temperature)``, as the trainer computes them) in the standard
shape, whether or not ``logprobs`` was asked for; ``system_fingerprint`` names the policy
version that answered. ``GET /healthz`` reports NATS and the per-run counters.

With ``auth = "keys"`` (settings) these routes want a tenant's API key
(:mod:`flywheel.contract.keys`): 401 without a good one, 403 without the scope (``write``
to sample, ``read`` for ``/v1/models``); ``/v1/models`` lists the key's tenant's runs, running
or ended. A ``model`` that is another tenant's run, or a run whose state does not decode (its
owner cannot be read, so it is nobody's), is the 404 of a run that does not exist, the same
body, so a key learns nothing of other tenants' run ids. The deployment's ``service_token``
sees every tenant's (the orchestrator's evals). The interception endpoint keeps its own
per-rollout keys.

The key (or the rollout key) is checked from the headers before anything reads the body
(:class:`Authenticate`), and a body above the setting ``inference.max_body_bytes`` is refused
with 413 before it is parsed (:mod:`flywheel.contract.bodylimit`): a caller without a key
cannot make the service read, hold or parse what it sends.

Every request that samples is metered: a :class:`~flywheel.contract.events.Usage` (source
``api``: the prompt once, every choice's tokens) goes on the bus once it is answered, its
tenant the key's (open, or the deployment's token: the run's owner).

Errors use OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``): 400 for a
request that cannot be served (naming the field), 404 for an unknown run, 503 while the
run has no weights loaded. Chat requests take OpenAI messages with tool calls and tool
results, and ``tools``: the template renders them, and each answer's calls (the Hermes
``<tool_call>`` format the template teaches, parsed as the interception endpoint parses them)
come back as ``tool_calls`` with ``finish_reason = "tool_calls"``. ``stream = true`` sends
the answer token by token as it is sampled, in OpenAI's chunks (:mod:`flywheel_inference.streaming`;
a request the run cannot serve still gets its error before any chunk). Not covered:
``tool_choice`` naming a function, ``top_logprobs`` (the alternatives' logprobs), ``echo``,
and prompts given as lists of prompts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import Headers

from flywheel.contract import events
from flywheel.contract.bodylimit import BodyLimit, BodyTooLarge, too_large_detail
from flywheel.contract.config import StopStrings, sampling_field
from flywheel.contract.keys import SCOPES, Caller, KeyCheck, KeyRefused, ScopeRefused
from flywheel.contract.runs import BadRunState, end_of, get_run, list_runs
from flywheel.sdk.messages import message_dict, message_from_dict
from flywheel_inference import agent_apis, interception
from flywheel_inference.completion import Completion
from flywheel_inference.hosting import HostedRun, UnknownRun
from flywheel_inference.interception import openai_error, parse_tool_calls
from flywheel_inference.policy import Sampled, WeightsUnavailable
from flywheel_inference.streaming import (
    ChunkWriter,
    Ending,
    TextStream,
    TokenQueue,
    chat_logprobs,
    chat_message,
    respond,
)
from flywheel_inference.worker import Worker

log = logging.getLogger(__name__)
router = APIRouter()
MAX_CHOICES = 64


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _worker(request: Request) -> Worker:
    return request.app.state.worker


WorkerDep = Annotated[Worker, Depends(_worker)]
bearer = HTTPBearer(auto_error=False, scheme_name="APIKey",
                    description="A tenant's API key, fw_<id>_<secret> (`flywheel keys create`); not needed when "
                                "inference runs open (auth = \"open\", loopback only).")


async def _caller(request: Request,
                  _: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)] = None) -> Caller:
    """The caller :class:`Authenticate` settled from the request's key before its body was read
    (the ``Security`` parameter puts the scheme in the OpenAPI schema)."""
    caller: Caller = request.state.caller
    return caller


CallerDep = Annotated[Caller, Depends(_caller)]
OPEN = Caller("default", frozenset(SCOPES))  # every caller of an open API (auth = "open")
NO_KEY_PATHS = ("/healthz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")  # nothing of a tenant's


class Authenticate:
    """ASGI middleware: who calls, settled from the headers before anything reads the body, so a
    request without a good key is answered (401; 403 without the scope) having read none of it.
    ``/intercept/<key>/...`` wants a live rollout key (its own credential: 401 otherwise, as the
    endpoint answers); ``NO_KEY_PATHS`` want nothing; every other path a tenant's API key (open:
    none), whose :class:`~flywheel.contract.keys.Caller` the routes get as ``request.state.caller``.
    (Plain ASGI, not ``BaseHTTPMiddleware``, which would buffer the body it is here to leave unread.)"""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path: str = scope.get("path", "")
        if scope["type"] != "http" or path in NO_KEY_PATHS:
            await self.app(scope, receive, send)
            return
        state = scope["app"].state
        refused: JSONResponse | None = None
        if path.startswith("/intercept/"):
            if path.split("/")[2] not in state.interception.sessions:
                refused = openai_error(401, interception.UNKNOWN_ROLLOUT_KEY, None, "invalid_rollout_key")
        else:
            refused = await self._authorize(scope, state.keys)
        if refused is not None:
            await refused(scope, receive, send)
            return
        await self.app(scope, receive, send)

    @staticmethod
    async def _authorize(scope: dict[str, Any], check: KeyCheck | None) -> JSONResponse | None:
        """Puts the caller in the request's state; the refusal when the key is not good enough."""
        caller = OPEN
        if check is not None:
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            try:
                caller = await check.authorize(token.strip() if scheme.lower() == "bearer" else None,
                                               scope["method"], scope["path"])
            except KeyRefused as exc:
                return openai_error(401, str(exc), None, "invalid_api_key")
            except ScopeRefused as exc:
                return openai_error(403, str(exc), None, "insufficient_scope")
        scope.setdefault("state", {})["caller"] = caller
        return None


class _SamplingRequest(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI clients send many."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(description="the run id")
    # The contract's sampling fields, bounds and descriptions; unset: the run's. The temperature
    # takes 0 as OpenAI's API does (clients and user simulators send it for greedy answers).
    temperature: float | None = Field(
        None, ge=0, allow_inf_nan=False,
        description=f"softmax temperature; below {events.MIN_TEMPERATURE:g} (0 included) it is sampled at "
                    f"{events.MIN_TEMPERATURE:g}: greedy up to ties, with the chosen tokens' logprobs")
    top_p: float | None = sampling_field("top_p", None)
    max_tokens: int | None = sampling_field("max_tokens", None)
    stop: str | StopStrings | None = Field(None, description=events.SAMPLING_DESCRIPTIONS["stop"])
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    seed: int | None = sampling_field("seed", None)
    stream: bool = Field(False, description="send the answer token by token, as server-sent events")
    stream_options: dict[str, Any] | None = Field(None, description="include_usage: a last chunk with the usage")

    def refuse_unsupported(self) -> None:
        """400, naming the field, for what the endpoint does not do (each endpoint's own)."""

    def sampling(self, default: events.Sampling, max_tokens: int | None = None) -> events.Sampling:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return events.Sampling(
            temperature=default.temperature if self.temperature is None else max(self.temperature,
                                                                                 events.MIN_TEMPERATURE),
            top_p=default.top_p if self.top_p is None else self.top_p,
            max_tokens=max_tokens or self.max_tokens or default.max_tokens,
            stop=default.stop if stop is None else stop,
            seed=self.seed,
        )


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1, description="OpenAI chat messages, tool calls and tool "
                                                                    "results included")
    tools: list[dict[str, Any]] | None = Field(None, description="OpenAI function tools; the answer's calls come "
                                                                 "back as tool_calls")
    tool_choice: str | dict[str, Any] | None = Field(None, description="auto (or none) only")
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = Field(None, ge=0)

    def refuse_unsupported(self) -> None:
        if self.top_logprobs:
            raise ApiError(400, "top_logprobs is not supported: only the sampled tokens' logprobs are returned",
                           "top_logprobs")
        if self.tool_choice not in (None, "auto", "none"):
            raise ApiError(400, f"tool_choice={self.tool_choice!r} is not supported: give auto (the model decides) "
                                "or none", "tool_choice")
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
                raise ApiError(400, f"tools[{i}]: only {{'type': 'function', 'function': {{...}}}} tools", "tools")

    def chat_messages(self) -> list[events.Message]:
        try:
            return [message_from_dict(m, f"messages[{i}]") for i, m in enumerate(self.messages)]
        except ValueError as exc:
            raise ApiError(400, str(exc), "messages") from exc

    @property
    def offered_tools(self) -> list[dict[str, Any]] | None:
        return self.tools if self.tools and self.tool_choice != "none" else None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] = Field(description="text, or token ids")
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False

    def refuse_unsupported(self) -> None:
        if self.logprobs:
            raise ApiError(400, "logprobs > 0 is not supported: only the sampled tokens' logprobs are returned",
                           "logprobs")
        if self.echo:
            raise ApiError(400, "echo=true is not supported", "echo")


def _no_such_model(model: str) -> ApiError:
    """What a key gets for a model it may not use: a run that does not exist, another tenant's,
    one whose owner cannot be read; alike, so that nothing tells them apart."""
    return ApiError(404, f"model {model!r}: no run of that id; the model is a run id of your tenant, or RUN@STEP",
                    "model", "model_not_found")


async def _hosted(worker: Worker, model: str, who: Caller) -> HostedRun:
    run = model.partition("@")[0]
    if who.key_id is not None and not who.service:
        # Read on every request, even for a run hosted already: its owner is the bucket's word now.
        try:
            state = await get_run(worker.bus, run)
        except BadRunState:  # its owner cannot be read: nobody's, refused to every key
            state = None
        if state is None or not who.sees(state.tenant):
            raise _no_such_model(model)
    try:
        return await worker.served(model)
    except UnknownRun as exc:
        raise ApiError(404, f"model {model!r}: {exc}; the model is a run id, or RUN@STEP", "model",
                       "model_not_found") from exc
    except ValueError as exc:  # the run has no usable config, or the step is not a number
        raise ApiError(400, f"model {model!r}: {exc}", "model") from exc


async def _sample(worker: Worker, who: Caller, hosted: HostedRun, prompt: list[int], sampling: events.Sampling,
                  n: int) -> list[Sampled]:
    _check(hosted, prompt, sampling)
    try:
        sampled = await hosted.policy.sample([prompt] * n, sampling)
    except WeightsUnavailable as exc:
        raise ApiError(503, str(exc)) from exc
    _meter(worker, who, hosted, prompt, sampled)
    return sampled


def _meter(worker: Worker, who: Caller, hosted: HostedRun, prompt: list[int], sampled: list[Sampled]) -> None:
    """Publish what an answered request used, off the response's path (a bus that is down is
    retried by the bus layer; what still fails is logged, naming the run)."""
    usage = events.Usage(run=hosted.config.run, source="api",
                         tenant=who.tenant if who.key_id is not None and not who.service else "",
                         prompt_tokens=len(prompt),
                         sampled_tokens=sum(len(s.completion.token_ids) for s in sampled))
    worker.bus.publish_soon(usage, f"the usage of an API request of run {usage.run} ({usage.prompt_tokens} prompt, "
                                   f"{usage.sampled_tokens} sampled tokens)")


def _check(hosted: HostedRun, prompt: list[int], sampling: events.Sampling) -> None:
    try:
        hosted.policy.check([prompt], sampling)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc
    try:
        hosted.policy.check_ready()
    except WeightsUnavailable as exc:
        raise ApiError(503, str(exc)) from exc


async def _streamed(worker: Worker, who: Caller, hosted: HostedRun, body: _SamplingRequest, prompt: list[int],
                    sampling: events.Sampling, chat: bool, ending: Callable[[Completion], Ending],
                    tools: bool = False) -> StreamingResponse:
    """The answers as server-sent events, each token sent once its text is safe to show."""
    _check(hosted, prompt, sampling)
    tok = hosted.policy.backend.tokenizer
    tokens = TokenQueue()
    job = asyncio.ensure_future(hosted.policy.sample([prompt] * body.n, sampling, on_token=tokens.on_token))

    async def endings() -> tuple[list[Ending], dict[str, int], str]:
        sampled = await job
        _meter(worker, who, hosted, prompt, sampled)
        return [ending(s.completion) for s in sampled], _usage(prompt, sampled), _fingerprint(sampled)

    writer = ChunkWriter(chat, f"{'chatcmpl' if chat else 'cmpl'}-{events.new_id()}", int(time.time()), body.model,
                         tok)
    streams = [TextStream(tok, sampling.stop, tools) for _ in range(body.n)]
    return await respond(writer, streams, tokens, job, endings, bool((body.stream_options or {}).get("include_usage")))


def _tokens(tok: Any, token_ids: list[int]) -> list[str]:
    return interception.Renderer.of(tok).token_texts(token_ids)


def _usage(prompt: list[int], sampled: list[Sampled]) -> dict[str, int]:
    num_completion = sum(len(s.completion.token_ids) for s in sampled)
    return {"prompt_tokens": len(prompt), "completion_tokens": num_completion,
            "total_tokens": len(prompt) + num_completion}


def _fingerprint(sampled: list[Sampled]) -> str:
    return f"policy-v{max(s.version for s in sampled)}"


def _chat_ending(c: Completion, tools: bool) -> Ending:
    """A chat answer's content, tool calls (when tools were offered) and finish reason."""
    text, calls = parse_tool_calls(c.text) if tools else (c.text, [])
    if not calls:
        return Ending(text, c.finish_reason)
    return Ending(text, "tool_calls", message_dict(events.Message(role="assistant", tool_calls=calls))["tool_calls"])


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, worker: WorkerDep,
                           who: CallerDep) -> dict[str, Any] | StreamingResponse:
    from flywheel.sdk import models

    body.refuse_unsupported()
    messages = body.chat_messages()
    hosted = await _hosted(worker, body.model, who)
    tok = hosted.policy.backend.tokenizer
    tools = body.offered_tools
    prompt = models.render_prompt(tok, messages, tools)
    sampling = body.sampling(hosted.sampling, body.max_completion_tokens)
    if body.stream:
        return await _streamed(worker, who, hosted, body, prompt, sampling, True,
                               lambda c: _chat_ending(c, bool(tools)), bool(tools))
    sampled = await _sample(worker, who, hosted, prompt, sampling, body.n)
    choices = []
    for i, s in enumerate(sampled):
        c = s.completion
        ending = _chat_ending(c, bool(tools))
        choices.append({"index": i, "message": chat_message(ending), "finish_reason": ending.finish_reason,
                        "logprobs": chat_logprobs(_tokens(tok, c.token_ids), c.logprobs)})
    return {"id": f"chatcmpl-{events.new_id()}", "object": "chat.completion", "created": int(time.time()),
            "model": body.model, "system_fingerprint": _fingerprint(sampled), "choices": choices,
            "usage": _usage(prompt, sampled)}


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, worker: WorkerDep,
                      who: CallerDep) -> dict[str, Any] | StreamingResponse:
    body.refuse_unsupported()
    hosted = await _hosted(worker, body.model, who)
    tok = hosted.policy.backend.tokenizer
    prompt = tok.encode(body.prompt, add_special_tokens=False) if isinstance(body.prompt, str) else body.prompt
    sampling = body.sampling(hosted.sampling)
    if body.stream:
        return await _streamed(worker, who, hosted, body, prompt, sampling, False,
                               lambda c: Ending(c.text, c.finish_reason))
    sampled = await _sample(worker, who, hosted, prompt, sampling, body.n)
    choices = []
    for i, s in enumerate(sampled):
        c = s.completion
        tokens = _tokens(tok, c.token_ids)
        offsets = [sum(len(t) for t in tokens[:j]) for j in range(len(tokens))]
        choices.append({"index": i, "text": c.text, "finish_reason": c.finish_reason,
                        "logprobs": {"tokens": tokens, "token_logprobs": c.logprobs, "top_logprobs": None,
                                     "text_offset": offsets}})
    return {"id": f"cmpl-{events.new_id()}", "object": "text_completion", "created": int(time.time()),
            "model": body.model, "system_fingerprint": _fingerprint(sampled), "choices": choices,
            "usage": _usage(prompt, sampled)}


@router.get("/v1/models")
async def list_models(worker: WorkerDep, who: CallerDep) -> JSONResponse:
    """The models a client may name, in OpenAI's shape: the training runs registered, running or
    ended (a model is a run id; the run's config says which weights and sampling; an ended run
    answers from its last weights), with an API key its tenant's alone: the running ones first
    (a client that takes the first model gets a live run). Each also has the run's ``status``
    (``abandoned`` for a run whose owner let its lease lapse)."""
    runs = [s for s in await list_runs(worker.bus) if s.kind == "train" and s.config and who.sees(s.tenant)]
    return JSONResponse({"object": "list", "data": [
        {"id": s.id, "object": "model", "created": int(s.created_at.timestamp()), "owned_by": s.tenant,
         "status": _status(s)} for s in sorted(runs, key=lambda s: (end_of(s) is not None, s.id))]})


def _status(state: events.RunState) -> str:
    end = end_of(state)
    return state.status if end is None else end.status


@router.get("/healthz")
async def healthz(worker: WorkerDep, request: Request) -> JSONResponse:
    """200 while connected to NATS, with (open: no API keys) the counters of every run this
    replica hosts; with keys it names no run (a probe's, it asks for no key)."""
    connected = worker.bus.nc.is_connected
    body: dict[str, Any] = {"status": "ok" if connected else "unavailable",
                            "nats": "ok" if connected else "down: not connected"}
    if request.app.state.keys is None:
        body["runs"] = worker.info["runs"]
    return JSONResponse(body, status_code=200 if connected else 503)


class RolloutKeyAsBearer:
    """ASGI middleware: a harness given a rollout key instead of a URL. ``/v1/chat/completions``,
    ``/v1/responses`` or ``/v1/messages`` with ``Authorization: Bearer fw-...`` (or, as the
    ``anthropic`` SDK sends it, ``x-api-key: fw-...``) is that rollout's interception endpoint.
    (Plain ASGI, not ``BaseHTTPMiddleware``, which costs a task per request.)"""

    PATHS = ("/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens")

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] in self.PATHS:
            headers = dict(scope["headers"])
            key = headers.get(b"authorization", b"").decode("latin-1").removeprefix("Bearer ").strip()
            if not key.startswith("fw-"):
                key = headers.get(b"x-api-key", b"").decode("latin-1").strip()
            if key.startswith("fw-"):
                scope = {**scope, "path": f"/intercept/{key}{scope['path']}"}
        await self.app(scope, receive, send)


def install(app: FastAPI, max_body_bytes: int) -> None:
    """The routes, the OpenAI error shape, the key check before the body and the body limit
    (``max_body_bytes``). They answer from ``app.state.worker`` and its rollouts' sessions,
    ``app.state.interception``, and check keys with ``app.state.keys``, which the composition
    root sets at start."""

    async def on_api_error(_: Request, exc: ApiError) -> JSONResponse:
        return openai_error(exc.status, exc.message, exc.param, exc.code)

    async def on_too_large(_: Request, exc: BodyTooLarge) -> JSONResponse:
        return openai_error(413, str(exc.detail), None, "request_too_large")

    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [(".".join(str(p) for p in e["loc"][1:]) or "body", e["msg"]) for e in exc.errors()]
        return openai_error(400, "; ".join(f"{field}: {msg}" for field, msg in problems), problems[0][0])

    # Each middleware added wraps those before it: a request meets RolloutKeyAsBearer (a rollout
    # key in the header becomes its path), then Authenticate, then BodyLimit, then the routes.
    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes,
                       refuse=lambda detail: openai_error(413, detail, None, "request_too_large"),
                       detail=too_large_detail("inference", max_body_bytes, "inference.max_body_bytes",
                                               "send a shorter prompt or fewer messages"))
    app.add_middleware(Authenticate)
    app.add_middleware(RolloutKeyAsBearer)
    app.include_router(router)
    interception.install(app)
    agent_apis.install(app)
    app.add_exception_handler(ApiError,
                              on_api_error)  # type: ignore[arg-type]  # typed for Exception; gets only that class
    app.add_exception_handler(RequestValidationError,
                              on_validation)  # type: ignore[arg-type]  # typed for Exception; gets only that class
    app.add_exception_handler(BodyTooLarge,
                              on_too_large)  # type: ignore[arg-type]  # typed for Exception; gets only that class
