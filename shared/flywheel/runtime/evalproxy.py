"""The recording proxy of an eval (:mod:`flywheel.runtime.evaluation`): in front of the endpoint
under evaluation, it forwards ``/chat/completions`` (streaming included), takes ``/responses``
and ``/messages`` (the OpenAI Responses and Anthropic Messages APIs, translated by
:mod:`flywheel.sdk.wire`) as chat completions upstream, imposes the eval's sampling, and records
each request's messages and the answer into a :class:`flywheel.sdk.tracegraph.TraceGraph` per
rollout, retrying transient upstream failures (429, 5xx, connection errors) with backoff before
anything reaches the harness."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import msgspec

from flywheel.contract import events
from flywheel.contract.retry import Backoff, retry
from flywheel.runtime.environments import Hooks
from flywheel.runtime.envworker import EnvironmentInfo
from flywheel.sdk import wire
from flywheel.sdk.hooks import Blocked
from flywheel.sdk.messages import message_dict, message_from_dict
from flywheel.sdk.tracegraph import TraceGraph

if TYPE_CHECKING:
    import httpx
    from starlette.applications import Starlette


RETRY_STATUS = (408, 409, 429, 500, 502, 503, 504)
MAX_BACKOFF_S = 30.0  # the longest wait between two tries of an upstream call
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


class _TryAgain(Exception):
    """An upstream answer worth another try (:data:`RETRY_STATUS`)."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"HTTP {response.status_code}")
        self.response = response


def _retry_after(exc: BaseException, delay_s: float) -> float:
    """The upstream's ``Retry-After`` (seconds, capped at MAX_BACKOFF_S) where it gave one, else ``delay_s``."""
    given = exc.response.headers.get("retry-after") if isinstance(exc, _TryAgain) else None
    try:
        return min(float(given), MAX_BACKOFF_S) if given is not None else delay_s
    except ValueError:
        return delay_s


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
        # Doubling from backoff_s up to 30 s, each wait spread by a quarter (or the upstream's Retry-After).
        self.backoff = Backoff(first_s=backoff_s, max_s=MAX_BACKOFF_S, jitter=0.25)
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
        """The upstream's answer, after up to ``max_retries`` retries of a transient failure (the last
        answer as it came; an upstream never reached: a 502 naming it)."""
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

        async def attempt() -> httpx.Response:
            request = self._client.build_request(method, self.upstream + path, json=body, headers=headers)
            response = await self._client.send(request, stream=True)
            if response.status_code in RETRY_STATUS or not stream:
                await response.aread()  # an error's body is small; read, the connection goes back
            if response.status_code in RETRY_STATUS:
                raise _TryAgain(response)
            return response

        def transient(exc: BaseException) -> bool:
            return isinstance(exc, (httpx.TransportError, _TryAgain))

        def count(exc: BaseException, delay_s: float, num_failed: int) -> None:
            self.num_retries += 1

        try:
            return await retry(attempt, self.backoff, transient=transient, max_retries=self.max_retries,
                               delay_of=_retry_after, on_retry=count)
        except _TryAgain as exc:
            return exc.response
        except httpx.TransportError as exc:
            return httpx.Response(502, json={"error": {
                "message": f"upstream {self.upstream} unreachable after {self.max_retries + 1} tries: "
                           f"{type(exc).__name__}: {exc}", "type": "upstream_error"}})

    async def close(self) -> None:
        await self._client.aclose()
