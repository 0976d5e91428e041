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
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from flywheel.contract import events
from flywheel.sdk import wire
from flywheel_inference.interception import InterceptionError, Session, openai_error
from flywheel_inference.streaming import TextStream, TokenQueue, chat_logprobs, decode

router = APIRouter()


def install(app: FastAPI) -> None:
    """The Responses and Messages routes on ``app``, answering from ``app.state.interception``."""
    app.include_router(router)


def _recorded(session: Session) -> Any:
    return lambda: wire.recorded_tool_calls(session.graph.nodes.values())


class _Events(Protocol):
    """The server-sent events of one streamed answer, in one API's shape (:mod:`flywheel.sdk.wire`)."""

    def start(self) -> str: ...
    def text(self, delta: str) -> str: ...
    def end(self, answer: events.Message, finish_reason: str, usage: tuple[int, int],
            logprobs: list[dict[str, Any]] | None = None) -> str: ...
    def error(self, message: str) -> str: ...


def logprobs(session: Session, completion: Any) -> list[dict[str, Any]]:
    """Each sampled token's text, logprob and bytes, as the Responses API gives them."""
    texts = [decode(session.policy.backend.tokenizer, [i], False) for i in completion.token_ids]
    content: list[dict[str, Any]] = chat_logprobs(texts, completion.logprobs)["content"]
    return content


async def _streamed(session: Session, call: wire.ChatCall, writer: _Events,
                    want_logprobs: bool = False) -> StreamingResponse:
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
        yield writer.end(answer.message, completion.finish_reason, (num_prompt, len(completion.token_ids)),
                         logprobs(session, completion) if want_logprobs else None)

    return StreamingResponse(stream(), media_type="text/event-stream")


# --- Responses ------------------------------------------------------------------------------


async def respond(session: Session, body: Any) -> Response:
    """A Responses request's answer, whole or streamed."""
    call, conversation = wire.responses_call(body, session.responses.get, _recorded(session))
    model = body.get("model")
    turn = wire.ResponseTurn(body, conversation, session.responses, model if isinstance(model, str) else session.run,
                             session.sampling)
    if call.stream:
        return await _streamed(session, call, wire.ResponseEvents(turn), turn.wants_logprobs)
    answer, completion, num_prompt = await session.chat(call.messages, call.tools, call.max_tokens)
    return JSONResponse(turn.answered(answer.message, completion.finish_reason, (num_prompt, len(completion.token_ids)),
                                      logprobs(session, completion) if turn.wants_logprobs else None))


@router.post("/intercept/{key}/v1/responses", response_model=None)
async def intercepted_responses(key: str, request: Request) -> Response:
    try:
        return await respond(request.app.state.interception.get(key), wire.parse_body(await request.body()))
    except wire.WireError as exc:
        return openai_error(exc.status, exc.message, exc.param, exc.code)


# --- Messages -------------------------------------------------------------------------------


def anthropic_error(status: int, message: str) -> JSONResponse:
    return JSONResponse(wire.anthropic_error(status, message), status_code=status)


@router.post("/intercept/{key}/v1/messages", response_model=None)
async def intercepted_messages(key: str, request: Request) -> Response:
    try:
        session: Session = request.app.state.interception.get(key)
        body = wire.parse_body(await request.body())
        call = wire.messages_call(body, _recorded(session))
        if call.stream:
            return await _streamed(session, call, wire.MessageEvents(body["model"]))
        answer, completion, num_prompt = await session.chat(call.messages, call.tools, call.max_tokens)
    except (wire.WireError, InterceptionError) as exc:
        return anthropic_error(exc.status, exc.message)
    return JSONResponse(wire.message_body(
        ident=wire.message_id(), model=body["model"], content=wire.message_content(answer.message),
        stop=wire.stop_reason(answer.message, completion.finish_reason),
        usage=(num_prompt, len(completion.token_ids))))


@router.post("/intercept/{key}/v1/messages/count_tokens", response_model=None)
async def intercepted_count_tokens(key: str, request: Request) -> Response:
    """The Messages API's token count: the prompt the model would be given for this request now."""
    try:
        session: Session = request.app.state.interception.get(key)
        body = wire.parse_body(await request.body())
        # count_tokens takes no max_tokens; the request is otherwise a message request's.
        call = wire.messages_call({"max_tokens": 1, **body} if isinstance(body, dict) else body, _recorded(session))
    except (wire.WireError, InterceptionError) as exc:
        return anthropic_error(exc.status, exc.message)
    return JSONResponse({"input_tokens": session.prompt_length(call.messages, call.tools)})
