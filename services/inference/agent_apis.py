"""The OpenAI Responses API and the Anthropic Messages API on the interception endpoint.

``POST /intercept/<key>/v1/responses`` and ``POST /intercept/<key>/v1/messages`` (or the same
paths without the prefix, with the rollout key as ``Authorization: Bearer`` or ``x-api-key``)
answer agents written for those APIs, so an agent configured only by base URL and key runs
unchanged: ``OPENAI_BASE_URL=<...>/intercept/<key>/v1`` for the ``openai`` SDK,
``ANTHROPIC_BASE_URL=<...>/intercept/<key>`` for the ``anthropic`` SDK. Each request becomes the
session's chat call (:mod:`flywheel.sdk.wire` translates), so it is sampled with the run's
policy and recorded into the rollout's trace graph with its token layer exactly as a chat
completion is; only the shapes of the request and the answer differ.

- **Responses**: ``input`` (text or message, ``function_call`` and ``function_call_output``
  items), ``instructions``, function ``tools``, ``max_output_tokens``, ``previous_response_id``
  (the rollout keeps the responses it gave unless ``store`` is false; instructions are not
  carried over, as the API says), ``include: ["message.output_text.logprobs"]``, and ``stream``
  (``response.*`` events: text deltas as sampled, each function call whole once the answer is
  done, then ``response.completed``, or ``response.incomplete`` at the token limit). Errors are
  OpenAI's shape.
- **Messages**: ``system``, ``messages`` with text, ``tool_use`` and ``tool_result`` blocks,
  client ``tools`` (``input_schema``), ``max_tokens`` (required, as the API has it), and
  ``stream`` (``message_start``, ``content_block_*`` with ``text_delta`` and
  ``input_json_delta``, ``message_delta``, ``message_stop``). Errors are Anthropic's shape
  (``{"type": "error", "error": {"type", "message"}}``).

Sampling parameters in the request (temperature, top_p, stop sequences, tool choice) are the
run's and ignored, as on the chat route; a request may only lower the token limit.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from flywheel.contract import events
from flywheel.sdk import wire
from flywheel_inference.interception import InterceptionError, Session, openai_error
from flywheel_inference.streaming import TextStream, TokenQueue, chat_logprobs, decode

router = APIRouter()

LOGPROBS = "message.output_text.logprobs"


def install(app: FastAPI) -> None:
    """The Responses and Messages routes on ``app``, answering from ``app.state.interception``."""
    app.include_router(router)


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise wire.WireError(f"the request body is not JSON: {exc}", "body") from exc


def _recorded(session: Session) -> Any:
    return lambda: wire.recorded_tool_calls(session.graph.nodes.values())


def _sse(kind: str, data: Mapping[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


class _Events(Protocol):
    """The server-sent events of one streamed answer, in one API's shape."""

    def start(self) -> str: ...
    def text(self, delta: str) -> str: ...
    def end(self, answer: events.Node, completion: Any, num_prompt: int) -> str: ...
    def error(self, message: str) -> str: ...


async def _streamed(session: Session, call: wire.ChatCall, writer: _Events) -> StreamingResponse:
    """Sample ``call`` token by token into ``writer``'s events. A failure before the first token
    raises (an error response); after it, the stream ends with the API's error event."""
    tokens = TokenQueue()
    job = asyncio.ensure_future(session.chat(call.messages, call.tools, call.max_tokens, on_token=tokens.on_token))
    await tokens.started(job)
    shown = TextStream(session.policy.backend.tokenizer, session.sampling.stop, bool(call.tools))

    async def stream() -> AsyncIterator[str]:
        yield writer.start()
        async for _, token_id, logprob in tokens.drain(job):
            delta = shown.push(token_id, logprob)
            if delta:
                yield writer.text(delta)
        try:
            answer, completion, num_prompt = await job
        except Exception as exc:  # the sampling failed after the first token: the client hears why
            yield writer.error(f"{type(exc).__name__}: {exc}")
            return
        rest = shown.finish(answer.message.content)
        if rest:
            yield writer.text(rest)
        yield writer.end(answer, completion, num_prompt)

    return StreamingResponse(stream(), media_type="text/event-stream")


# --- Responses ------------------------------------------------------------------------------


@dataclass
class _ResponseTurn:
    """One Responses request being answered: what it continues and how to store its answer."""

    session: Session
    body: Mapping[str, Any]
    conversation: list[events.Message]
    ident: str = field(default_factory=wire.response_id)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model(self) -> str:
        model = self.body.get("model")
        return model if isinstance(model, str) else self.session.run

    def response(self, output: list[dict[str, Any]], finish_reason: str | None = None,
                 usage: tuple[int, int] | None = None) -> dict[str, Any]:
        return wire.response_body(self.body, ident=self.ident, created=self.created, model=self.model, output=output,
                                  finish_reason=finish_reason, usage=usage, sampling=self.session.sampling)

    def keep(self, answer: events.Message) -> None:
        if self.body.get("store") is not False:
            self.session.responses[self.ident] = [*self.conversation, answer]

    def logprobs(self, completion: Any) -> list[dict[str, Any]] | None:
        include = self.body.get("include") or []
        if not isinstance(include, list) or LOGPROBS not in include:
            return None
        tok = self.session.policy.backend.tokenizer
        texts = [decode(tok, [i], False) for i in completion.token_ids]
        content: list[dict[str, Any]] = chat_logprobs(texts, completion.logprobs)["content"]
        return content


@dataclass
class _ResponseEvents:
    """``response.*`` server-sent events of one streamed response."""

    turn: _ResponseTurn
    seq: int = 0
    item: dict[str, Any] | None = None  # the message item whose text is being streamed

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return _sse(kind, data)

    def start(self) -> str:
        response = self.turn.response([])
        return self._event("response.created", response=response) + self._event("response.in_progress",
                                                                                 response=response)

    def text(self, delta: str) -> str:
        head = ""
        if self.item is None:
            self.item = wire.response_message_item("", status="in_progress")
            head = (self._event("response.output_item.added", output_index=0, item=self.item)
                    + self._event("response.content_part.added", item_id=self.item["id"], output_index=0,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return head + self._event("response.output_text.delta", item_id=self.item["id"], output_index=0,
                                  content_index=0, delta=delta, logprobs=[])

    def end(self, answer: events.Node, completion: Any, num_prompt: int) -> str:
        out, output = "", []
        message = answer.message
        if self.item is not None:
            done = wire.response_message_item(message.content, logprobs=self.turn.logprobs(completion),
                                              item_id=self.item["id"])
            part = done["content"][0]
            out += (self._event("response.output_text.done", item_id=done["id"], output_index=0, content_index=0,
                                text=message.content, logprobs=part.get("logprobs", []))
                    + self._event("response.content_part.done", item_id=done["id"], output_index=0,
                                  content_index=0, part=part)
                    + self._event("response.output_item.done", output_index=0, item=done))
            output.append(done)
        for call in message.tool_calls:
            index, item = len(output), wire.response_call_item(call)
            out += (self._event("response.output_item.added", output_index=index,
                                item=wire.response_call_item(call, "in_progress"))
                    + self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                  delta=call.arguments)
                    + self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=call.name, arguments=call.arguments)
                    + self._event("response.output_item.done", output_index=index, item=item))
            output.append(item)
        response = self.turn.response(output, completion.finish_reason, (num_prompt, len(completion.token_ids)))
        self.turn.keep(message)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return out + self._event(kind, response=response)

    def error(self, message: str) -> str:
        return self._event("error", code="server_error", message=message, param=None)


async def respond(session: Session, body: Any) -> Response:
    """A Responses request's answer, whole or streamed."""
    call, conversation = wire.responses_call(body, session.responses.get, _recorded(session))
    turn = _ResponseTurn(session, body, conversation)
    if call.stream:
        return await _streamed(session, call, _ResponseEvents(turn))
    answer, completion, num_prompt = await session.chat(call.messages, call.tools, call.max_tokens)
    turn.keep(answer.message)
    output = wire.response_output(answer.message, turn.logprobs(completion))
    return JSONResponse(turn.response(output, completion.finish_reason, (num_prompt, len(completion.token_ids))))


@router.post("/intercept/{key}/v1/responses", response_model=None)
async def intercepted_responses(key: str, request: Request) -> Response:
    try:
        return await respond(request.app.state.interception.get(key), await _json(request))
    except wire.WireError as exc:
        return openai_error(exc.status, exc.message, exc.param, exc.code)


# --- Messages -------------------------------------------------------------------------------


@dataclass
class _MessageEvents:
    """Anthropic's server-sent events of one streamed message."""

    model: str
    ident: str = field(default_factory=wire.message_id)
    blocks: int = 0  # content blocks started
    text_open: bool = False

    def start(self) -> str:
        message = wire.message_body(ident=self.ident, model=self.model, content=[], stop=None, usage=(0, 0))
        return _sse("message_start", {"type": "message_start", "message": message})

    def _close_text(self) -> str:
        if not self.text_open:
            return ""
        self.text_open = False
        return _sse("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})

    def text(self, delta: str) -> str:
        head = ""
        if not self.text_open:
            head = _sse("content_block_start", {"type": "content_block_start", "index": self.blocks,
                                                "content_block": {"type": "text", "text": ""}})
            self.text_open, self.blocks = True, self.blocks + 1
        return head + _sse("content_block_delta", {"type": "content_block_delta", "index": self.blocks - 1,
                                                   "delta": {"type": "text_delta", "text": delta}})

    def end(self, answer: events.Node, completion: Any, num_prompt: int) -> str:
        out = self._close_text()
        for call in answer.message.tool_calls:
            index, self.blocks = self.blocks, self.blocks + 1
            block = wire.tool_use_block(call)
            out += (_sse("content_block_start", {"type": "content_block_start", "index": index,
                                                 "content_block": wire.tool_use_block(call, whole=False)})
                    + _sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
                    + _sse("content_block_stop", {"type": "content_block_stop", "index": index}))
        stop = wire.stop_reason(answer.message, completion.finish_reason)
        usage = {"input_tokens": num_prompt, "output_tokens": len(completion.token_ids)}
        return (out + _sse("message_delta", {"type": "message_delta", "usage": usage,
                                             "delta": {"stop_reason": stop, "stop_sequence": None}})
                + _sse("message_stop", {"type": "message_stop"}))

    def error(self, message: str) -> str:
        return _sse("error", wire.anthropic_error(500, message))


def anthropic_error(status: int, message: str) -> JSONResponse:
    return JSONResponse(wire.anthropic_error(status, message), status_code=status)


@router.post("/intercept/{key}/v1/messages", response_model=None)
async def intercepted_messages(key: str, request: Request) -> Response:
    try:
        session: Session = request.app.state.interception.get(key)
        body = await _json(request)
        call = wire.messages_call(body, _recorded(session))
        if call.stream:
            return await _streamed(session, call, _MessageEvents(body["model"]))
        answer, completion, num_prompt = await session.chat(call.messages, call.tools, call.max_tokens)
    except (wire.WireError, InterceptionError) as exc:
        return anthropic_error(exc.status, exc.message)
    return JSONResponse(wire.message_body(
        ident=wire.message_id(), model=body["model"], content=wire.message_content(answer.message),
        stop=wire.stop_reason(answer.message, completion.finish_reason),
        usage=(num_prompt, len(completion.token_ids))))
