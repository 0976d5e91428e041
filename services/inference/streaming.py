"""OpenAI answers, whole or token by token in server-sent events, for the plain API and the
interception endpoint alike.

The policy calls back with each sampled token as its batch produces it
(:meth:`flywheel_inference.policy.Policy.sample`'s ``on_token``); :class:`TokenQueue` carries
those calls to the response, and :class:`TextStream` turns one choice's tokens into the text a
client may already be shown. It holds back what may still change: the bytes of a character
not complete yet, the start of a stop string (the answer is cut before it), and, when tools are
offered, everything from ``<tool_call>`` on (a call is sent whole, as ``tool_calls``, once the
answer is done) and whitespace that would be stripped around a call. The deltas of a choice
concatenate to its answer's text; each carries the logprobs of the tokens sampled since the
previous one, so a client sees every token's logprob once.

Chunks are ``chat.completion.chunk`` (``/v1/chat/completions``) or ``text_completion``
(``/v1/completions``) objects, one ``data:`` line each, then ``data: [DONE]``; with
``stream_options.include_usage`` a last chunk carries the usage, as OpenAI sends it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import StreamingResponse

TOOL_CALL_START = "<tool_call>"

# (choice index, token id, logprob)
TokenEvent = tuple[int, int, float]


def _held_suffix(text: str, holds: Sequence[str]) -> int:
    """How many characters at the end of ``text`` could begin one of ``holds``."""
    longest = 0
    for hold in holds:
        for size in range(min(len(hold) - 1, len(text)), longest, -1):
            if text.endswith(hold[:size]):
                longest = size
                break
    return longest


def decode(tokenizer: Any, token_ids: list[int], skip_special_tokens: bool = True) -> str:
    text = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str)  # one sequence of ids decodes to one string (a batch to a list)
    return text


@dataclass
class TextStream:
    """One choice's sampled tokens so far, and how much of their text was sent."""

    tokenizer: Any
    stop: Sequence[str] = ()
    tools: bool = False
    token_ids: list[int] = field(default_factory=list)
    pending: list[tuple[int, float]] = field(default_factory=list)  # tokens whose logprobs are not sent yet
    sent: str = ""
    cut: bool = False  # a stop string or a tool call began: nothing more is sent before the end

    def push(self, token_id: int, logprob: float) -> str:
        """Add a token; returns the text that may be sent now ('' when none)."""
        self.token_ids.append(token_id)
        self.pending.append((token_id, logprob))
        if self.cut:
            return ""
        text = decode(self.tokenizer, self.token_ids)
        holds = [*self.stop, *([TOOL_CALL_START] if self.tools else [])]
        found = [i for i in (text.find(h) for h in holds) if i >= 0]
        if found:
            text, self.cut = text[:min(found)], True
        else:
            text = text[:len(text) - _held_suffix(text, holds)]
        text = text.rstrip("\ufffd")  # the first bytes of a character whose last have not come
        if self.tools:
            text = text.rstrip() if self.sent or text.strip() else ""
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        new, self.sent = text[len(self.sent):], text
        return new

    def finish(self, final_text: str) -> str:
        """The rest of the answer's text, ``final_text`` being all of it."""
        rest = final_text[len(self.sent):] if final_text.startswith(self.sent) else ""
        self.sent += rest
        return rest

    def take_logprobs(self) -> list[tuple[int, float]]:
        taken, self.pending = self.pending, []
        return taken


class TokenQueue:
    """Token events from the policy's batch to one response; ``None`` ends them."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[TokenEvent | None] = asyncio.Queue()
        self._first = asyncio.Event()

    def on_token(self, index: int, token_id: int, logprob: float) -> None:
        self._queue.put_nowait((index, token_id, logprob))
        self._first.set()

    async def started(self, job: asyncio.Future[Any]) -> None:
        """Wait for the first token or the end of ``job``, raising what the job raised: a
        request the policy refuses gets an error response, not a stream that breaks off."""
        first = asyncio.ensure_future(self._first.wait())
        try:
            await asyncio.wait([job, first], return_when=asyncio.FIRST_COMPLETED)
        finally:
            first.cancel()
        if job.done() and job.exception() is not None:
            raise job.exception()  # type: ignore[misc]  # checked not None just above

    async def drain(self, job: asyncio.Future[Any]) -> AsyncIterator[TokenEvent]:
        """Every token event until ``job`` (the sampling) is done. Its tokens are all queued
        before its end marker: the policy hands them to the event loop before it ends the job."""
        job.add_done_callback(lambda _: self._queue.put_nowait(None))
        try:
            while (item := await self._queue.get()) is not None:
                yield item
        finally:
            if not job.done():  # the client went away: the sampling's result is not wanted
                job.cancel()


@dataclass(frozen=True)
class Ending:
    """How one choice ended: its whole text (content), tool calls, and finish reason."""

    text: str
    finish_reason: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def chat_message(ending: Ending) -> dict[str, Any]:
    """The ``message`` of a chat choice: content (None beside tool calls when there is none)."""
    message: dict[str, Any] = {"role": "assistant",
                               "content": (ending.text or None) if ending.tool_calls else ending.text}
    if ending.tool_calls:
        message["tool_calls"] = ending.tool_calls
    return message


def chat_logprobs(texts: Sequence[str], logprobs: Sequence[float]) -> dict[str, Any]:
    """A chat choice's ``logprobs``: each token's text, logprob and bytes."""
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(texts, logprobs, strict=True)]}


async def respond(writer: ChunkWriter, streams: list[TextStream], tokens: TokenQueue, job: asyncio.Future[Any],
                  endings: Callable[[], Awaitable[tuple[list[Ending], dict[str, int], str]]],
                  include_usage: bool) -> StreamingResponse:
    """The response to a streamed request whose sampling ``job`` calls ``tokens.on_token``:
    an error (what the job raised) if it fails before its first token, else the event stream."""
    await tokens.started(job)
    return StreamingResponse(stream_answers(writer, streams, tokens.drain(job), endings, include_usage),
                             media_type="text/event-stream")


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


@dataclass
class ChunkWriter:
    """OpenAI chunks of one response: ``chat`` (chat.completion.chunk) or text_completion."""

    chat: bool
    ident: str
    created: int
    model: str
    tokenizer: Any
    fingerprint: str | None = None

    def _base(self) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.ident, "object": "chat.completion.chunk" if self.chat else "text_completion",
                                "created": self.created, "model": self.model}
        if self.fingerprint is not None:
            body["system_fingerprint"] = self.fingerprint
        return body

    def _logprobs(self, tokens: list[tuple[int, float]]) -> dict[str, Any] | None:
        if not tokens:
            return None
        texts = [decode(self.tokenizer, [t], False) for t, _ in tokens]
        if self.chat:
            return chat_logprobs(texts, [lp for _, lp in tokens])
        return {"tokens": texts, "token_logprobs": [lp for _, lp in tokens], "top_logprobs": None}

    def choice(self, index: int, text: str | None = None, tokens: Sequence[tuple[int, float]] = (),
               finish_reason: str | None = None, role: bool = False,
               tool_calls: list[dict[str, Any]] | None = None) -> str:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason,
                                  "logprobs": self._logprobs(list(tokens))}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return sse({**self._base(), "choices": [choice]})

    def usage(self, usage: dict[str, int]) -> str:
        return sse({**self._base(), "choices": [], "usage": usage})


async def stream_answers(writer: ChunkWriter, streams: list[TextStream], tokens: AsyncIterator[TokenEvent],
                         endings: Callable[[], Awaitable[tuple[list[Ending], dict[str, int], str]]],
                         include_usage: bool) -> AsyncIterator[str]:
    """The whole event stream of a response: a first chunk per choice (the role, for chat),
    text as it may be shown, then each choice's rest, tool calls and finish reason, the usage
    when asked, and ``[DONE]``. ``endings()`` (called once the tokens are drained) gives how
    each choice ended, the usage and the fingerprint; should it fail, an ``error`` event in
    OpenAI's shape ends the stream instead."""
    if writer.chat:
        for i in range(len(streams)):
            yield writer.choice(i, "", role=True)
    async for index, token_id, logprob in tokens:
        stream = streams[index]
        text = stream.push(token_id, logprob)
        if text:
            yield writer.choice(index, text, stream.take_logprobs())
    try:
        ended, usage, fingerprint = await endings()
    except Exception as exc:  # the sampling failed after the first token: the client hears why
        yield sse({"error": {"message": f"{type(exc).__name__}: {exc}", "type": "api_error", "param": None,
                             "code": None}})
        return
    writer.fingerprint = fingerprint
    for i, (stream, ending) in enumerate(zip(streams, ended, strict=True)):
        rest = stream.finish(ending.text)
        yield writer.choice(i, rest or None if writer.chat else rest, stream.take_logprobs(), ending.finish_reason,
                            tool_calls=ending.tool_calls)
    if include_usage:
        yield writer.usage(usage)
    yield "data: [DONE]\n\n"
