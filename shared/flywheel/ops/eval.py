"""``flywheel eval ENV``: an environment's harness against any OpenAI-compatible endpoint.

The same :class:`flywheel.sdk.environment.Environment` that a training run uses runs here
unchanged: its harness gets a per-rollout base URL, exactly as inside the inference service,
only here the URL is a local **recording proxy** (:class:`RecordingProxy`) in front of the
endpoint under evaluation (the local inference service by default, with the run id as the
model; or any OpenAI-compatible server). The proxy forwards ``/chat/completions`` (streaming
included), takes ``/responses`` and ``/messages`` (the OpenAI Responses and Anthropic Messages
APIs, translated by :mod:`flywheel.sdk.wire`) as chat completions upstream, and records each
request's messages and the answer into a :class:`flywheel.sdk.tracegraph.TraceGraph` per
rollout (the message layer; upstream logprobs and usage are kept per call), retrying transient
upstream failures (429, 5xx, connection errors) with backoff before anything reaches the harness.

The run: ``num_tasks`` rows of the task set, ``num_rollouts`` rollouts of each (one group, so
group rewards apply), at most ``concurrency`` rollouts at once. Each rollout runs as in
training (:func:`flywheel.sdk.rollout.run_harness`: the rollout timeout, harness errors,
no model call, state that must be JSON) and each group is scored as the scorer service
scores it (:class:`flywheel.sdk.scoring.Scoring`, when its last rollout ends), so an
environment gives the same statuses, errors and rewards here as in a training run; a
rollout's ``reward`` is :func:`flywheel.sdk.scoring.rollout_reward` over the environment's
rewards. A harness or reward that fails is recorded on that rollout (``error``,
``reward_errors``), never ends the eval. Results go to a JSONL file, one
rollout a line (run, task, messages, state, rewards, usage, error), written group by group,
so ``resume`` goes on with the eval run the file holds and skips every task whose group is
in it already. Task and rollout ids are made as every producer makes them
(:func:`flywheel.contract.events.task_id`, :func:`~flywheel.contract.events.rollout_id`),
from the eval run's id. The summary: reward mean
and standard error (and per reward), pass@k for k in 1..num_rollouts (a rollout passes when
its reward reaches ``pass_threshold``, by default the sum of the reward weights: every
reward at 1.0), each over the rollouts without an error (``num_scored``), the errors by kind
(:func:`error_kind`: each with its count and an example), tokens from the upstream's usage.
Any model on the local stack, with no training run: :mod:`flywheel.ops.evalmodel`.

``record`` publishes the rollouts and their scores on the bus under a run of kind ``eval``
(registered in the runs bucket), so the gateway's recorder stores them beside training runs.
The eval run belongs to the tenant of the run it evaluates (``during``'s training run, or the
run a ``model`` of ``RUN`` or ``RUN@STEP`` names on this bus), so its owner sees it; else to
``tenant`` (``default`` unset). A run it evaluates whose state does not decode refuses the
recording (its owner cannot be told), as a ``tenant`` that is not that run's does.
Where NATS answers, harnesses get a sandbox client (``RolloutContext.sandbox_client``) and
rewards reach the sandbox service through it (:mod:`flywheel.sdk.sandbox_tools`).

Not covered: the token layer (an arbitrary endpoint returns no token ids; the interception
endpoint of the inference service records those in training), ``/completions`` (legacy
text completions) through the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import re
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import msgspec

from flywheel.contract import events
from flywheel.ops.tables import table
from flywheel.runtime.environments import Hooks, RolloutLink, WorkerEnvironment, WorkerError, WorkerPool
from flywheel.runtime.envworker import EnvironmentInfo, RewardOutcome
from flywheel.runtime.runs import load_environment
from flywheel.sdk import wire
from flywheel.sdk.environment import EnvironmentOverrides, Value, messages_of, subject_name
from flywheel.sdk.hooks import Blocked
from flywheel.sdk.messages import message_dict, message_from_dict
from flywheel.sdk.rollout import ROLLOUT_TIMEOUT_S, Ran, conclude
from flywheel.sdk.sandbox import SandboxClient
from flywheel.sdk.sandbox_tools import SandboxUnavailable
from flywheel.sdk.sandbox_tools import connect as connect_sandbox
from flywheel.sdk.scoring import REWARD_TIMEOUT_S, required_scorers, rollout_reward, score_event
from flywheel.sdk.tracegraph import TraceGraph

if TYPE_CHECKING:
    import httpx
    from starlette.applications import Starlette

    from flywheel.contract.bus import Bus
    from flywheel.contract.settings import Settings

RETRY_STATUS = (408, 409, 429, 500, 502, 503, 504)
HARNESS_API_KEY = "flywheel-eval"  # what the harness sends to the proxy; the proxy holds the real key


# --- the recording proxy ------------------------------------------------------------------


@dataclass
class Recording:
    """What the proxy saw of one rollout: its trace graph and, per call, usage and logprobs."""

    graph: TraceGraph = field(default_factory=TraceGraph)
    calls: list[dict[str, Any]] = field(default_factory=list)
    sampling: events.Sampling | None = None  # imposed on each of its calls (None: sent as the harness sent it)
    responses: dict[str, list[events.Message]] = field(default_factory=dict)  # Responses API, by id
    hooks: Hooks | None = None  # the environment's hooks on each call (run in its worker)

    async def add(self, messages: list[events.Message], completion: Mapping[str, Any]) -> None:
        """The request's messages below the longest matching path, then each choice below them
        (its response hooks seeing each)."""
        path = self.graph.match(messages)
        parent = path[-1].id if path else None
        for message in messages[len(path):]:
            parent = self.graph.add(parent, message)[0].id
        choices = sorted(completion.get("choices") or [], key=lambda c: c.get("index", 0))
        for choice in choices:
            answer = message_from_dict({"content": "", **(choice.get("message") or {}), "role": "assistant"},
                                       "choices[].message")
            self.graph.add(parent, answer)
            if self.hooks:
                await self.hooks.after(messages, answer)
        self.calls.append({"usage": completion.get("usage") or {},
                           "finish_reasons": [c.get("finish_reason") for c in choices],
                           "logprobs": [c.get("logprobs") for c in choices if c.get("logprobs")]})

    @property
    def num_calls(self) -> int:
        """Model calls answered (the harness's endpoint, as :func:`flywheel.sdk.rollout.run_harness` asks)."""
        return len(self.calls)

    @property
    def truncated(self) -> bool:
        """Whether an answer was cut at ``max_tokens``."""
        return any(reason == "length" for call in self.calls for reason in call["finish_reasons"])

    def tokens(self) -> dict[str, int]:
        totals = {"prompt_tokens": 0, "completion_tokens": 0}
        for call in self.calls:
            for key in totals:
                totals[key] += int(call["usage"].get(key) or 0)
        return totals


class _Stream:
    """Rebuilds a chat completion from its server-sent chunks, as they pass through."""

    def __init__(self) -> None:
        self._buffer = b""
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, Any] = {}

    def feed(self, data: bytes) -> None:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for raw in lines:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            try:
                chunk = json.loads(payload)
            except json.JSONDecodeError:
                continue
            self._chunk(chunk)

    def _chunk(self, chunk: Mapping[str, Any]) -> None:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for c in chunk.get("choices") or []:
            choice = self.choices.setdefault(c.get("index", 0), {"message": {"content": ""}, "finish_reason": None})
            delta = c.get("delta") or {}
            message = choice["message"]
            message["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                calls = message.setdefault("tool_calls", [])
                while len(calls) <= call.get("index", 0):
                    calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                target = calls[call.get("index", 0)]
                target["id"] = call.get("id") or target["id"]
                fn = call.get("function") or {}
                target["function"]["name"] += fn.get("name") or ""
                target["function"]["arguments"] += fn.get("arguments") or ""
            if c.get("finish_reason"):
                choice["finish_reason"] = c["finish_reason"]
            if (c.get("logprobs") or {}).get("content"):
                choice.setdefault("logprobs", {"content": []})["content"].extend(c["logprobs"]["content"])

    def completion(self) -> dict[str, Any]:
        return {"choices": [{"index": i, **c} for i, c in sorted(self.choices.items())], "usage": self.usage}


def impose_sampling(body: Mapping[str, Any], sampling: events.Sampling) -> dict[str, Any]:
    """A chat request with ``sampling`` in place of the harness's own settings, as the interception
    endpoint imposes a run's in training: temperature, top_p, the stop strings and the seed as
    given; the harness may only lower max_tokens (or max_completion_tokens, where it sent that)."""
    out = {**body, "temperature": sampling.temperature, "top_p": sampling.top_p}
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    asked = body.get(key)
    out[key] = min(asked, sampling.max_tokens) if isinstance(asked, int) and asked > 0 else sampling.max_tokens
    if sampling.stop:
        out["stop"] = list(sampling.stop)
    if sampling.seed is not None:
        out["seed"] = sampling.seed
    return out


def eval_sampling(env: EnvironmentInfo, given: Mapping[str, Any]) -> events.Sampling:
    """What an eval samples with: the contract's defaults, the environment's own sampling over
    them, ``given`` (the command's flags) over those, as a training run's config would. A
    temperature of 0 is taken (greedy, as OpenAI-compatible servers take it); a ValueError names
    anything else out of bounds."""
    names = events.Sampling.__struct_fields__
    unknown = sorted(set(env.sampling) - set(names))
    if unknown:
        raise ValueError(f"environment {env.name!r}: sampling has {unknown}; known settings are {', '.join(names)}")
    try:
        sampling = msgspec.convert({**env.sampling, **given}, events.Sampling)
    except msgspec.ValidationError as exc:
        raise ValueError(f"sampling: {exc}") from None
    msgspec.structs.replace(sampling, temperature=max(sampling.temperature, events.MIN_TEMPERATURE)).check()
    if sampling.temperature < 0:
        raise ValueError(f"sampling.temperature must be >= 0, got {sampling.temperature}")
    return sampling


def _recorded(recording: Recording) -> Callable[[], Mapping[str, str]]:
    return lambda: wire.recorded_tool_calls(recording.graph.nodes.values())


class _OpenAIErrors:
    """Errors a Responses agent gets from the proxy: the upstream's as they came, the proxy's own
    (a hook's block) in OpenAI's shape."""

    @staticmethod
    def upstream(status: int, content: bytes) -> Any:
        from starlette.responses import Response

        return Response(content, status_code=status, media_type="application/json")

    @staticmethod
    def refused(status: int, message: str, code: str) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": "messages",
                                       "code": code}}, status_code=status)


class _AnthropicErrors:
    """Errors a Messages agent gets from the proxy, in the Messages API's shape."""

    @staticmethod
    def upstream(status: int, content: bytes) -> Any:
        try:
            message = json.loads(content)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = content.decode(errors="replace")[:500]
        return _AnthropicErrors.refused(status, f"upstream: {message}", "")

    @staticmethod
    def refused(status: int, message: str, code: str) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse(wire.anthropic_error(status, message), status_code=status)


def with_system_prompt(messages: list[events.Message], prompt: str) -> list[events.Message]:
    """``messages`` with ``prompt`` as the content of their first system message (put first if none)."""
    system = events.Message(role="system", content=prompt)
    if messages and messages[0].role == "system":
        return [system, *messages[1:]]
    return [system, *messages]


class RecordingProxy:
    """Forwards ``/r/<key>/v1/chat/completions`` to ``upstream`` and records every call of each key.

    ``transport`` replaces the HTTP transport to the upstream (tests). ``max_retries`` transient
    failures (429, 5xx, connection errors) are retried per call, ``backoff_s`` doubling (or the
    upstream's ``Retry-After``), before the upstream's answer is handed to the harness.
    """

    def __init__(self, upstream: str, api_key: str | None = None, *, max_retries: int = 5, backoff_s: float = 0.5,
                 timeout_s: float = 600.0, transport: httpx.AsyncBaseTransport | None = None,
                 system_prompt: str | None = None) -> None:
        import httpx

        self.upstream = upstream.rstrip("/")
        self.system_prompt = system_prompt  # every call's system message, where set (with_system_prompt)
        self.api_key = api_key
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.recordings: dict[str, Recording] = {}
        self.num_retries = 0
        self._client = httpx.AsyncClient(timeout=timeout_s, transport=transport,
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.url = ""  # http://127.0.0.1:<port>, once serving

    def base_url(self, key: str) -> str:
        """The OpenAI base URL a rollout's harness gets."""
        return f"{self.url}/r/{key}/v1"

    def open(self, key: str, sampling: events.Sampling | None = None, hooks: Hooks | None = None) -> Recording:
        """A new recording for ``key``, filled as its calls pass through; ``sampling`` is sent
        with each of them (:func:`impose_sampling`); ``hooks`` (the environment's) see each call."""
        recording = self.recordings[key] = Recording(sampling=sampling, hooks=hooks)
        return recording

    def take(self, key: str) -> Recording:
        """The recording of ``key``, forgotten by the proxy."""
        return self.recordings.pop(key, None) or Recording()

    def app(self) -> Starlette:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route

        async def chat(request: Request) -> Response:
            try:
                body = await request.json()
                given = [message_from_dict(m, f"messages[{i}]") for i, m in enumerate(body["messages"])]
                messages = await self._system(given, request.path_params["key"])
                if messages != given:
                    body = {**body, "messages": [message_dict(m) for m in messages]}
            except Blocked as exc:
                return _OpenAIErrors.refused(400, str(exc), "blocked_by_environment")
            except (ValueError, KeyError, TypeError) as exc:
                return JSONResponse({"error": {"message": f"the proxy cannot read this request: {exc}",
                                               "type": "invalid_request_error"}}, status_code=400)
            return await self._forward(request.path_params["key"], body, messages)

        async def list_models(request: Request) -> Response:
            response = await self._send("GET", "/models", None, stream=False)
            return Response(response.content, status_code=response.status_code,
                            media_type=response.headers.get("content-type"))

        async def responses(request: Request) -> Response:
            recording = self.recordings.setdefault(request.path_params["key"], Recording())
            try:
                body = wire.parse_body(await request.body())
                call, conversation = wire.responses_call(body, recording.responses.get, _recorded(recording))
            except wire.WireError as exc:
                return JSONResponse({"error": {"message": exc.message, "type": "invalid_request_error",
                                               "param": exc.param, "code": exc.code}}, status_code=exc.status)
            model = body.get("model")
            turn = wire.ResponseTurn(body, conversation, recording.responses, model if isinstance(model, str) else "",
                                     recording.sampling)
            return await self._translated(request.path_params["key"], call, model, turn.answered,
                                          wire.ResponseEvents(turn), _OpenAIErrors)

        async def messages(request: Request) -> Response:
            recording = self.recordings.setdefault(request.path_params["key"], Recording())
            try:
                body = wire.parse_body(await request.body())
                call = wire.messages_call(body, _recorded(recording))
            except wire.WireError as exc:
                return JSONResponse(wire.anthropic_error(exc.status, exc.message), status_code=exc.status)
            model = body["model"]

            def whole(answer: events.Message, finish_reason: str, usage: tuple[int, int]) -> dict[str, Any]:
                return wire.message_body(ident=wire.message_id(), model=model, content=wire.message_content(answer),
                                         stop=wire.stop_reason(answer, finish_reason), usage=usage)

            return await self._translated(request.path_params["key"], call, model, whole, wire.MessageEvents(model),
                                          _AnthropicErrors)

        return Starlette(routes=[Route("/r/{key}/v1/chat/completions", chat, methods=["POST"]),
                                 Route("/r/{key}/v1/responses", responses, methods=["POST"]),
                                 Route("/r/{key}/v1/messages", messages, methods=["POST"]),
                                 Route("/r/{key}/v1/models", list_models, methods=["GET"])])

    async def _system(self, messages: list[events.Message], key: str) -> list[events.Message]:
        """``messages`` as they go upstream: with the proxy's system prompt, where it has one,
        then through the rollout's request hooks (raises :class:`flywheel.sdk.hooks.Blocked`)."""
        if self.system_prompt is not None:
            messages = with_system_prompt(messages, self.system_prompt)
        recording = self.recordings.get(key)
        return await recording.hooks.before(messages) if recording is not None and recording.hooks else messages

    def _prepared(self, key: str, body: dict[str, Any]) -> tuple[Recording, dict[str, Any]]:
        """The recording of ``key`` and ``body`` with its sampling imposed."""
        recording = self.recordings.setdefault(key, Recording())
        if recording.sampling is not None:
            body = impose_sampling(body, recording.sampling.with_seed_offset(7919 * len(recording.calls)))
        return recording, body

    async def _translated(self, key: str, call: wire.ChatCall, model: Any,
                          whole: Callable[[events.Message, str, tuple[int, int]], dict[str, Any]],
                          writer: wire.ResponseEvents | wire.MessageEvents,
                          errors: type[_OpenAIErrors | _AnthropicErrors]) -> Any:
        """A Responses or Messages request (already a chat ``call``) sent upstream as a chat
        completion and recorded as one; the answer goes back in the request's API shape, whole
        (``whole``) or, when streamed, as ``writer``'s events with the text relayed as it comes."""
        from starlette.responses import JSONResponse, StreamingResponse

        try:
            call = replace(call, messages=await self._system(call.messages, key))
        except Blocked as exc:
            return errors.refused(400, str(exc), "blocked_by_environment")
        chat: dict[str, Any] = {"model": model, "messages": [message_dict(m) for m in call.messages]}
        if call.tools:
            chat["tools"] = call.tools
        if call.max_tokens is not None:
            chat["max_tokens"] = call.max_tokens
        if call.stream:
            chat |= {"stream": True, "stream_options": {"include_usage": True}}
        recording, chat = self._prepared(key, chat)
        response = await self._send("POST", "/chat/completions", chat, stream=call.stream)
        if response.status_code != 200:
            content = await response.aread()
            await response.aclose()
            return errors.upstream(response.status_code, content)

        async def answer_of(completion: Mapping[str, Any]) -> tuple[events.Message, str, tuple[int, int]]:
            await recording.add(call.messages, completion)
            choice = (completion.get("choices") or [{}])[0]
            answer = message_from_dict({"content": "", **(choice.get("message") or {}), "role": "assistant"})
            usage = completion.get("usage") or {}
            return (answer, choice.get("finish_reason") or "stop",
                    (int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)))

        if not call.stream:
            return JSONResponse(whole(*await answer_of(json.loads(response.content))))

        async def relay() -> AsyncIterator[str]:
            stream, sent = _Stream(), 0
            yield writer.start()
            try:
                async for data in response.aiter_raw():
                    stream.feed(data)
                    text = (stream.choices.get(0) or {"message": {"content": ""}})["message"]["content"]
                    if len(text) > sent:
                        yield writer.text(text[sent:])
                        sent = len(text)
                stream.feed(b"\n")
                answer, finish_reason, usage = await answer_of(stream.completion())
                if len(answer.content) > sent:
                    yield writer.text(answer.content[sent:])
                yield writer.end(answer, finish_reason, usage)
            except Exception as exc:  # the upstream broke off: the client hears why
                yield writer.error(f"upstream {self.upstream}: {type(exc).__name__}: {exc}")
            finally:
                await response.aclose()

        return StreamingResponse(relay(), status_code=200, media_type="text/event-stream")

    async def _forward(self, key: str, body: dict[str, Any], messages: list[events.Message]) -> Any:
        from starlette.responses import Response, StreamingResponse

        recording, body = self._prepared(key, body)
        streaming = bool(body.get("stream"))
        response = await self._send("POST", "/chat/completions", body, stream=streaming)
        if response.status_code != 200 or not streaming:
            content = await response.aread()
            await response.aclose()
            if response.status_code == 200:
                await recording.add(messages, json.loads(content))
            return Response(content, status_code=response.status_code,
                            media_type=response.headers.get("content-type", "application/json"))

        async def relay() -> AsyncIterator[bytes]:
            stream = _Stream()
            try:
                async for data in response.aiter_raw():
                    stream.feed(data)
                    yield data
                stream.feed(b"\n")
                await recording.add(messages, stream.completion())
            finally:
                await response.aclose()

        return StreamingResponse(relay(), status_code=200,
                                 media_type=response.headers.get("content-type", "text/event-stream"))

    async def _send(self, method: str, path: str, body: Any, stream: bool) -> httpx.Response:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        for attempt in range(self.max_retries + 1):
            request = self._client.build_request(method, self.upstream + path, json=body, headers=headers)
            last = attempt == self.max_retries
            try:
                response = await self._client.send(request, stream=True)
            except httpx.TransportError as exc:
                if last:
                    return httpx.Response(502, json={"error": {
                        "message": f"upstream {self.upstream} unreachable after {attempt + 1} tries: "
                                   f"{type(exc).__name__}: {exc}", "type": "upstream_error"}})
                await self._backoff(attempt, None)
                continue
            if response.status_code in RETRY_STATUS and not last:
                retry_after = response.headers.get("retry-after")
                await response.aclose()
                await self._backoff(attempt, retry_after)
                continue
            if not stream:
                await response.aread()
            return response
        raise AssertionError("unreachable")

    async def _backoff(self, attempt: int, retry_after: str | None) -> None:
        self.num_retries += 1
        try:
            delay_s = float(retry_after) if retry_after is not None else self.backoff_s * 2 ** attempt
        except ValueError:
            delay_s = self.backoff_s * 2 ** attempt
        await asyncio.sleep(min(delay_s, 30.0) * (0.75 + 0.5 * random.random()))  # a deliberate sleep - backoff

    async def close(self) -> None:
        await self._client.aclose()


@dataclass
class Served:
    """An ASGI app served by uvicorn on a free loopback port, in this event loop."""

    url: str
    server: Any
    task: asyncio.Task[None]

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def serve(app: Any, host: str = "127.0.0.1") -> Served:
    """Serve ``app`` on a free port of ``host`` until :meth:`Served.stop`."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield  # Ctrl-C belongs to whoever runs the loop (it stops the eval, not just this server)

    server = Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            await task
            raise RuntimeError("the server stopped before it started")
        await asyncio.sleep(0.01)  # a deliberate sleep - uvicorn says it started only through this flag
    return Served(f"http://{host}:{port}", server, task)


# --- the eval -----------------------------------------------------------------------------


@dataclass
class EvalConfig:
    env: str  # environment id
    model: str  # the model name sent (a run id for the local inference service)
    base_url: str  # the OpenAI-compatible endpoint, ending in /v1
    out: Path  # results JSONL
    api_key: str | None = None
    num_tasks: int = 8
    num_rollouts: int = 1
    concurrency: int = 8
    resume: bool = False
    pass_threshold: float | None = None
    env_args: dict[str, Any] = field(default_factory=dict)
    harness: str | None = None  # a command line run as the harness (a program harness); None: the environment's own
    runtime: str | None = None  # where a program harness runs (subprocess, sandbox); None: the environment's own
    seed: int = 0
    max_retries: int = 5
    timeout_s: float = 600.0  # one model call
    record: bool = False
    run_id: str | None = None
    rollout_timeout_s: float = ROLLOUT_TIMEOUT_S  # one harness run, as inference's
    reward_timeout_s: float = REWARD_TIMEOUT_S  # one reward, as the scorer's
    sampling: dict[str, Any] = field(default_factory=dict)  # over the environment's own (eval_sampling)
    # False: calls go as the harness sent them, the endpoint's defaults deciding (an API that
    # refuses sampling parameters, as some reasoning models' do); nothing is recorded as sent.
    send_sampling: bool = True
    # An eval during training: {"train_run": RUN, "step": STEP, "eval": NAME}, recorded in the
    # eval run's config, which links it to the training run and the step it evaluated.
    during: dict[str, Any] = field(default_factory=dict)
    # The eval run's tenant (record); None: the evaluated run's, else "default" (see the module).
    tenant: str | None = None
    # These rows instead of num_tasks drawn from the task set (flywheel optimize's minibatches).
    tasks: list[dict[str, Any]] | None = None
    # Every call's system message is this one (put first where a harness sends none): the
    # prompt flywheel optimize tries, whatever the harness. None: as the harness sends it.
    system_prompt: str | None = None
    # The name the endpoint knows the model by, where it is not ``model``: the run the local
    # stack's inference serves a model no training run trained as (flywheel.ops.evalmodel).
    served_as: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_tasks", "num_rollouts", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: at least 1")
        if self.max_retries < 0:
            raise ValueError(f"max_retries={self.max_retries}: not negative")


def read_results(path: Path) -> list[dict[str, Any]]:
    """The rollouts in a results file; a torn last line (an eval killed mid-write) is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "task_id" in record and "index" in record:
            out.append(record)
    return out


def scored_fields(scores: Sequence[events.Score]) -> dict[str, Any]:
    """A rollout's scores as results fields: ``rewards`` (values of those without an error),
    ``components`` (of those that have some) and ``reward_errors``."""
    return {"rewards": {s.scorer: s.value for s in scores if s.error is None},
            "components": {s.scorer: s.components for s in scores if s.error is None and s.components},
            "reward_errors": {s.scorer: s.error for s in scores if s.error is not None}}


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a task with ``c`` passing rollouts of ``n``."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_stderr(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(var / len(values))


MAX_EXAMPLE_CHARS = 500  # an error kind's example message, cut to this


def error_kind(message: str) -> str:
    """A rollout's (or reward's) error message as its kind, so that errors of one cause group
    together: its first clause (up to ``": "`` or ``"; "``), with the exception type after a
    prefix kept (``harness failed: NotFoundError``), quoted values, ``=values`` and numbers
    blanked (``the harness ran past rollout_timeout_s``)."""
    text = (message.strip().splitlines() or ["(no message)"])[0]
    parts = re.split(r": |; ", text)
    kind = parts[0]
    if len(parts) > 1 and re.fullmatch(r"[A-Z][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", parts[1]):
        kind += ": " + parts[1]  # an exception's type, after a prefix that says where it was raised
    kind = re.sub(r"'[^']*'|\"[^\"]*\"", "'...'", kind)
    kind = re.sub(r"=\S+", "", kind)
    kind = re.sub(r"\d+", "N", kind)
    return kind[:200] or "(no message)"


def error_kinds(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The errors of ``records`` by kind (:func:`error_kind`), most frequent first: each with its
    ``count`` and one ``example`` message (the first seen) and its ``rollout_id``. A rollout's
    error is ``rollout``'s; a reward's is ``reward NAME``'s."""
    kinds: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        found = [("rollout", r["error"])] if r.get("error") else []
        found += [(f"reward {name}", message) for name, message in (r.get("reward_errors") or {}).items()]
        for where, message in found:
            text = str(message)
            key = (where, error_kind(text))
            entry = kinds.setdefault(key, {"where": where, "kind": key[1], "count": 0,
                                           "example": text[:MAX_EXAMPLE_CHARS], "rollout_id": r.get("rollout_id")})
            entry["count"] += 1
    return sorted(kinds.values(), key=lambda e: (-e["count"], e["where"], e["kind"]))


def summarize(records: Sequence[Mapping[str, Any]], weights: Mapping[str, float], num_rollouts: int,
              pass_threshold: float) -> dict[str, Any]:
    """Reward mean and standard error (overall and per reward), pass@k, errors by kind, tokens.

    Every figure of the rewards (their means, standard errors and pass@k) is over the rollouts
    without an error (``num_scored``; an errored rollout's harness never finished, so what its
    rewards say of it is not the model's): ``reward_mean`` also leaves out a rollout one of whose
    rewards failed (its reward is not known), each reward's ``num`` says how many it is over."""
    scored = [r for r in records if not r.get("error")]
    rewards = [r["reward"] for r in scored if r.get("reward") is not None]
    mean, stderr = mean_stderr(rewards)
    per_reward = {}
    for name in weights:
        values = [r["rewards"][name] for r in scored if name in r.get("rewards", {})]
        m, s = mean_stderr(values)
        per_reward[name] = {"mean": m, "stderr": s, "weight": weights[name], "num": len(values)}
    by_task: dict[str, list[bool]] = {}
    for r in records:
        by_task.setdefault(r["task_id"], [])
    for r in scored:
        # A hair of tolerance: weighted sums of floats (0.1 + 0.2) should pass a threshold they meet.
        passed = r.get("reward") is not None and r["reward"] >= pass_threshold - 1e-9
        by_task[r["task_id"]].append(passed)
    pass_k = {}
    for k in range(1, num_rollouts + 1):
        groups = [g for g in by_task.values() if len(g) >= k]
        pass_k[f"pass@{k}"] = sum(pass_at_k(len(g), sum(g), k) for g in groups) / len(groups) if groups else None
    return {
        "num_tasks": len(by_task),
        "num_rollouts": len(records),
        "num_scored": len(scored),
        "num_rewarded": len(rewards),
        "reward_mean": mean,
        "reward_stderr": stderr,
        "pass_threshold": pass_threshold,
        **pass_k,
        "rewards": per_reward,
        "num_errors": len(records) - len(scored),
        "num_reward_errors": sum(1 for r in records if r.get("reward_errors")),
        "errors": error_kinds(records),
        "num_truncated": sum(1 for r in records if r.get("status") == "truncated"),
        "prompt_tokens": sum(r.get("usage", {}).get("prompt_tokens", 0) for r in records),
        "completion_tokens": sum(r.get("usage", {}).get("completion_tokens", 0) for r in records),
    }


def format_summary(summary: Mapping[str, Any]) -> str:
    """The summary as a table: one row per figure, reward rows with their standard error."""

    def num(v: Any) -> str:
        return "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)

    rows: list[list[str]] = [["reward", num(summary["reward_mean"]), num(summary["reward_stderr"])]]
    for name, r in summary["rewards"].items():
        rows.append([f"  {name} (weight {r['weight']:g})", num(r["mean"]), num(r["stderr"])])
    rows += [[k, num(v), ""] for k, v in summary.items() if k.startswith("pass@")]
    rows += [[k, num(summary[k]), ""] for k in ("num_tasks", "num_rollouts", "num_errors", "num_reward_errors",
                                                 "num_truncated", "prompt_tokens", "completion_tokens")]
    text = table(rows, ["", "mean", "stderr"]) + f"\npass: reward >= {summary['pass_threshold']:g}"
    if "num_scored" in summary:
        text += (f"\nrewards and pass@k are over the {summary['num_scored']} of {summary['num_rollouts']} rollouts "
                 f"without an error" + (f" ({summary['num_errors']} errored, left out)" if summary["num_errors"]
                                        else "")
                 + (f"; reward over the {summary['num_rewarded']} whose every reward was computed"
                    if summary.get("num_rewarded", summary["num_scored"]) != summary["num_scored"] else ""))
    if summary.get("errors"):
        text += "\nerrors by kind:"
        for e in summary["errors"]:
            text += f"\n  {e['count']:>5} x {e['where']}: {e['kind']}\n        e.g. {e['example']}"
    if summary.get("sampling"):
        given = {k: v for k, v in summary["sampling"].items() if v not in (None, [])}
        text += "\nsampled with: " + ", ".join(f"{k} {v}" for k, v in given.items())
    return text


class ProgressLine:
    """One status line on stderr, redrawn in place on a terminal, every few seconds otherwise."""

    def __init__(self, total: int, out: TextIO = sys.stderr) -> None:
        self.total = total
        self.done = 0
        self.errors = 0
        self.out = out
        self.started_s = time.monotonic()
        self._shown_s = 0.0
        self._tty = out.isatty()

    def add(self, num: int, num_errors: int) -> None:
        self.done += num
        self.errors += num_errors
        now = time.monotonic()
        if self._tty or now - self._shown_s > 5.0 or self.done == self.total:
            self._shown_s = now
            self.show()

    def show(self) -> None:
        width = 30
        filled = width * self.done // max(self.total, 1)
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} rollouts  "
                f"{self.errors} errors  {time.monotonic() - self.started_s:.0f}s")
        self.out.write(("\r" + line) if self._tty else line + "\n")
        if self._tty and self.done == self.total:
            self.out.write("\n")
        self.out.flush()


class Evaluation:
    """One ``flywheel eval``: the environment (in its workers), the proxy, the results file,
    optionally the bus."""

    def __init__(self, cfg: EvalConfig, env: WorkerEnvironment, progress_out: TextIO = sys.stderr) -> None:
        self.cfg = cfg
        self.env = env
        self.env_name = subject_name(cfg.env, env.name)
        self.run_id = cfg.run_id or f"eval-{self.env_name}-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}"
        self.progress_out = progress_out
        self.weights = required_scorers(None, env)  # the reward: every reward of the environment, at its weight
        self.sampling = eval_sampling(env.info, cfg.sampling)  # sent with every call, recorded on every rollout
        self.proxy = RecordingProxy(cfg.base_url, cfg.api_key, max_retries=cfg.max_retries, timeout_s=cfg.timeout_s,
                                    system_prompt=cfg.system_prompt)
        self.bus: Bus | None = None
        self.sandbox: SandboxClient | None = None  # for sandbox tools and rewards, where NATS answers
        self._client: httpx.AsyncClient | None = None  # how the workers' rollouts reach the proxy
        self._sandbox_bus: Bus | None = None
        self._slots = asyncio.Semaphore(cfg.concurrency)
        self._write = asyncio.Lock()

    @property
    def pass_threshold(self) -> float:
        if self.cfg.pass_threshold is not None:
            return self.cfg.pass_threshold
        return sum(w for w in self.weights.values() if w > 0)

    async def run(self, nats_url: str | None = None) -> dict[str, Any]:
        cfg = self.cfg
        rows = cfg.tasks if cfg.tasks is not None else await self.env.load_tasks(cfg.num_tasks, seed=cfg.seed)
        previous = read_results(cfg.out) if cfg.resume else []
        if previous:
            self.run_id = self._resumed_run(previous)
        # Ids as every producer makes them (a task's position is its place in the task set,
        # from 1), so a recorded eval's tasks and rollouts are named as a training run's are.
        tasks = [(events.task_id(self.run_id, self.env_name, i, row), row) for i, row in enumerate(rows, 1)]
        wanted = {tid for tid, _ in tasks}
        counts: dict[str, int] = {}
        for r in previous:
            counts[r["task_id"]] = counts.get(r["task_id"], 0) + 1
        done = {tid for tid, n in counts.items() if n >= cfg.num_rollouts}
        # Keep only complete groups of this task set; a torn group is run again whole.
        kept = [r for r in previous if r["task_id"] in done and r["task_id"] in wanted]
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text("".join(json.dumps(r) + "\n" for r in kept))
        todo = [(tid, row) for tid, row in tasks if tid not in done]
        progress = ProgressLine(len(todo) * cfg.num_rollouts, self.progress_out)
        if cfg.resume:
            print(f"resume: {len(tasks) - len(todo)} of {len(tasks)} tasks done in {cfg.out}", file=self.progress_out)
        if cfg.record:
            await self._open_bus(nats_url)
        await self._open_sandbox(nats_url)
        served = await serve(self.proxy.app())
        self.proxy.url = served.url
        import httpx  # the workers' rollouts reach the proxy through this process

        self._client = httpx.AsyncClient(timeout=None)
        started = time.monotonic()
        try:
            with cfg.out.open("a") as out:
                await asyncio.gather(*(self._group(tid, row, out, progress) for tid, row in todo))
        finally:
            await served.stop()
            await self._client.aclose()
            await self.proxy.close()
            if self.bus is not None:
                await self._close_bus()
            if self._sandbox_bus is not None:
                await self._sandbox_bus.close()
        records = [r for r in read_results(cfg.out) if r["task_id"] in wanted]
        summary = {"env": cfg.env, "model": cfg.model, "served_as": cfg.served_as,
                   "run": self.run_id if cfg.record else None,
                   **summarize(records, self.weights, cfg.num_rollouts, self.pass_threshold),
                   "elapsed_s": time.monotonic() - started, "num_upstream_retries": self.proxy.num_retries,
                   "sampling": msgspec.structs.asdict(self.sampling) if cfg.send_sampling else None,
                   "harness": " ".join(self.env.info.argv) or self.env.info.harness,
                   "runtime": self.env.info.runtime or "process",
                   "results": str(cfg.out)}
        return summary

    def _resumed_run(self, previous: list[dict[str, Any]]) -> str:
        """The eval run the results file holds, which a resume goes on with (its ids derive from
        it); ValueError, before anything is rewritten, for a file of another or of several runs."""
        runs = {r.get("run") for r in previous}
        if None in runs:
            raise ValueError(f"{self.cfg.out} holds results without their eval run's id (written by an older "
                             "version): run this eval again into a new --out, without --resume")
        if len(runs) > 1:
            raise ValueError(f"{self.cfg.out} holds the results of several eval runs "
                             f"({', '.join(sorted(map(str, runs)))}): resume one results file per run")
        (run,) = runs
        if self.cfg.run_id is not None and self.cfg.run_id != run:
            raise ValueError(f"run_id={self.cfg.run_id!r}, but {self.cfg.out} holds the results of eval run "
                             f"{run!r}: resume without --run-id, or write this run to another --out")
        return str(run)

    async def _group(self, tid: str, row: dict[str, Any], out: TextIO, progress: ProgressLine) -> None:
        cfg = self.cfg
        results = await asyncio.gather(*(self._rollout(tid, row, i) for i in range(cfg.num_rollouts)))
        rollouts = [r for r, _ in results]
        scored = await self._scored(rollouts)
        records = []
        for (rollout, recording), scores in zip(results, scored, strict=True):
            records.append({"run": self.run_id, "task_id": tid, "index": rollout.index, "rollout_id": rollout.id,
                            "env": cfg.env, "model": cfg.model, "task": row, "messages": messages_of(rollout),
                            "state": rollout.state, "status": rollout.status, "error": rollout.error,
                            **scored_fields(scores),
                            "usage": recording.tokens(), "calls": recording.calls,
                            "flags": recording.hooks.flags if recording.hooks else {},
                            "sampling": msgspec.structs.asdict(rollout.sampling) if rollout.sampling else None,
                            "reward": rollout_reward(rollout.status, scores, self.weights)})
        async with self._write:
            out.write("".join(json.dumps(r, default=str) + "\n" for r in records))
            out.flush()
        if self.bus is not None:
            await self._publish(rollouts, scored)
        progress.add(len(records), sum(1 for r in records if r["error"] or r["reward_errors"]))

    async def _scored(self, rollouts: list[events.Rollout]) -> list[list[events.Score]]:
        """Every reward of the environment on a group, in its workers, as the scorer scores it: per
        rollout, one Score per reward in the environment's order (a worker that fails gives each an error)."""
        info = self.env.info
        timeout_s = self.cfg.reward_timeout_s
        outcomes: dict[str, list[RewardOutcome]] = {r.id: [] for r in rollouts}
        for run, names in ((self.env.score, info.rollout_rewards), (self.env.score_group, info.group_rewards)):
            try:
                got = await run(rollouts, names, timeout_s, [RolloutLink(r.id, r.run, sandbox=self.sandbox)
                                                             for r in rollouts])
            except WorkerError as exc:
                got = [[RewardOutcome(name=n, error=f"its environment worker failed: {exc}") for n in names]
                       for _ in rollouts]
            for rollout, row in zip(rollouts, got, strict=True):
                outcomes[rollout.id] += row
        order = {r.name: i for i, r in enumerate(info.rewards)}
        return [[score_event(r, o.name, self.weights.get(o.name, 0.0),
                             o.error if o.error is not None else Value(o.value or 0.0, dict(o.components)))
                 for o in sorted(outcomes[r.id], key=lambda o: order[o.name])] for r in rollouts]

    async def _rollout(self, tid: str, row: dict[str, Any], index: int) -> tuple[events.Rollout, Recording]:
        """One rollout, its harness run in the environment's worker as inference runs it (the
        rules of :mod:`flywheel.sdk.rollout`), its calls recorded by the proxy."""
        rid = events.rollout_id(self.run_id, tid, index)
        # As inference seeds a group's rollouts; None: the endpoint's own defaults (send_sampling off).
        sampling = self.sampling.with_seed_offset(index) if self.cfg.send_sampling else None
        async with self._slots:
            link = RolloutLink(rid, self.run_id, base_url=self.proxy.base_url(rid), api_key=HARNESS_API_KEY,
                               http_client=self._client, sandbox=self.sandbox)
            try:
                running = await self.env.start_rollout(link)
            except WorkerError as exc:
                recording = self.proxy.open(rid, sampling)
                ran = Ran(f"environment worker failed: {exc}", {}, False, 0.0)
            else:
                recording = self.proxy.open(rid, sampling, running.hooks if running.hooks else None)
                ran = await running.run(row, model=self.cfg.served_as or self.cfg.model, index=index,
                                        timeout_s=self.cfg.rollout_timeout_s)
            self.proxy.take(rid)  # the rollout is over: calls that still come are not its own
        outcome = conclude(ran, recording, rid, index)
        metrics = {k: float(v) for k, v in recording.tokens().items()} | {"rollout_s": outcome.elapsed_s}
        rollout = events.Rollout(id=rid, run=self.run_id, env=self.env_name, task_id=tid, group_id=tid, index=index,
                                 task_data=row, nodes=recording.graph.ordered(), status=outcome.status,
                                 error=outcome.error, group_size=self.cfg.num_rollouts, state=outcome.state,
                                 metrics=metrics, sampling=sampling)
        return rollout, recording

    # --- recording on the bus -----------------------------------------------------------

    async def _open_bus(self, nats_url: str | None) -> None:
        from flywheel.contract.bus import Bus
        from flywheel.contract.runs import register_run

        if nats_url is None:
            raise ValueError("--record needs NATS: set FLYWHEEL_NATS_URL or start `flywheel up`")
        self.bus = await Bus.connect(nats_url, "flywheel-eval")
        await register_run(self.bus, self.run_id, await self._tenant(), kind="eval", config={
            "eval": {"env": self.cfg.env, "model": self.cfg.model, "served_as": self.cfg.served_as,
                     "base_url": self.cfg.base_url,
                     "num_tasks": self.cfg.num_tasks, "num_rollouts": self.cfg.num_rollouts, **self.cfg.during}},
                           scorers=self.weights)

    async def _tenant(self) -> str:
        """The eval run's tenant: the evaluated run's (the training run ``during`` names, else the
        run the model names, where the bus holds one), else the config's, else ``default``.
        BadRunState when the evaluated run's state does not decode; ValueError for a config's
        tenant that is not the evaluated run's."""
        from flywheel.contract.runs import get_run, is_key  # imported here: with the bus, as above

        assert self.bus is not None
        trained = self.cfg.during.get("train_run")
        evaluated = str(trained) if trained else (self.cfg.served_as or self.cfg.model).partition("@")[0]
        state = await get_run(self.bus, evaluated) if is_key(evaluated) else None
        if state is None:
            if trained:
                raise ValueError(f"the training run {evaluated!r} this eval is of is not in the runs bucket")
            return self.cfg.tenant or "default"
        if self.cfg.tenant is not None and self.cfg.tenant != state.tenant:
            raise ValueError(f"tenant={self.cfg.tenant!r}, but the run this eval is of ({evaluated!r}) is tenant "
                             f"{state.tenant!r}'s: an eval of a run belongs to the run's tenant")
        return state.tenant

    async def _open_sandbox(self, nats_url: str | None) -> None:
        """The sandbox service's client, over the recording bus or a connection of its own, where
        NATS answers at ``nats_url``; without one a sandbox tool fails its rollout saying what to start."""
        if self.bus is not None:
            self.sandbox = SandboxClient(self.bus)
        elif nats_url is not None:
            with contextlib.suppress(SandboxUnavailable):  # no NATS: environments without a sandbox run as ever
                self._sandbox_bus, self.sandbox = await connect_sandbox(nats_url, timeout_s=1.0)

    async def _publish(self, rollouts: list[events.Rollout], scored: list[list[events.Score]]) -> None:
        assert self.bus is not None
        await self.bus.publish_many(rollouts, events.MSGPACK, together=True)
        await self.bus.publish_many([s for scores in scored for s in scores], together=True)

    async def _close_bus(self) -> None:
        from flywheel.contract.runs import update_run

        assert self.bus is not None
        try:
            await update_run(self.bus, self.run_id, status="finished")
        finally:
            await self.bus.close()


async def resolve_model(base_url: str, api_key: str | None) -> str:
    """The first model an endpoint lists (for ``--model URL``)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30.0) as client:
        try:
            response = await client.get(base_url.rstrip("/") + "/models", headers=headers)
        except httpx.TransportError as exc:
            raise ValueError(f"--model {base_url}: cannot reach it ({exc})") from exc
    if response.status_code != 200 or not response.json().get("data"):
        raise ValueError(f"--model {base_url}: GET /models answered {response.status_code} with no model; name one "
                         f"with --model NAME and --base-url {base_url}")
    return str(response.json()["data"][0]["id"])


# The eval's config (the model as served) and NATS URL (a stack started for it: its login), from its given config.
Serving = Callable[["EvalConfig"], contextlib.AbstractAsyncContextManager[tuple["EvalConfig", str | None]]]


async def run_eval(cfg: EvalConfig, nats_url: str | None = None, progress_out: TextIO = sys.stderr,
                   pool: WorkerPool | None = None, serving: Serving | None = None,
                   settings: Settings | None = None) -> dict[str, Any]:
    """Load the environment in a worker of the eval's tenant (``cfg.tenant``, else ``default``;
    in ``pool``, or a pool of this eval's own, of ``settings``' workers section and data dir
    (default: :meth:`Settings.load`)), run the eval,
    return the summary (also written beside the results). ``serving``: entered once the
    environment loaded and the sampling is checked, it gives the config the eval runs with (the
    model served for it: :mod:`flywheel.ops.evalmodel`) and its NATS URL (instead of
    ``nats_url``), and is left when the eval ends."""
    own = pool is None
    if pool is None:
        from flywheel.contract.settings import Settings

        settings = settings or Settings.load()
        pool = WorkerPool(settings.workers, settings.data_dir, name="eval")
    try:
        overrides = EnvironmentOverrides(args=dict(cfg.env_args), harness=cfg.harness, runtime=cfg.runtime)
        env = await load_environment(pool, cfg.env, overrides, cfg.tenant or "default")
        evaluation = Evaluation(cfg, env, progress_out)
        if serving is None:
            summary = await evaluation.run(nats_url)
        else:
            async with serving(cfg) as (served, served_nats_url):
                evaluation.cfg = served
                summary = await evaluation.run(served_nats_url)
    finally:
        if own:
            await pool.close()
    cfg.out.with_suffix(".summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
