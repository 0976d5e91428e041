"""Framed two-way calls over a pair of byte streams: how an environment worker and its host talk.

Each frame is a 4-byte big-endian length and a msgpack body, one of three messages:
``Call(id, op, args)``, ``Reply(id, value | error)`` and ``Cancel(id)``. Either side may call
the other; each numbers its own calls, and a reply carries the number of the call it answers.
A call runs as a task of its own on the receiving side, so many are in flight at once (a
worker rolls out many rollouts; each one's model calls go back to the host while it runs), and
a :class:`Cancel` cancels that task.

What a side serves is a table of handlers, ``op -> async fn(args) -> value``; a handler that
raises answers with the error's type name and message, raised on the caller's side as
:class:`RemoteError`. Frames are bounded (``max_frame_bytes``): a peer that sends a bigger one,
or bytes that do not decode, is a broken peer, and the channel closes. When the streams end
(the peer exited or was killed), every call waiting for an answer fails with
:class:`ChannelClosed`, saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import struct
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 256 * 1024 * 1024  # a rollout with long token arrays, a large task batch
_HEADER = struct.Struct(">I")


class Call(msgspec.Struct, tag="call", array_like=True):
    id: int
    op: str
    args: Any = None


class Reply(msgspec.Struct, tag="reply", array_like=True):
    id: int
    value: Any = None
    error: str | None = None  # the message of what the handler raised
    kind: str | None = None  # its type's name


class Cancel(msgspec.Struct, tag="cancel", array_like=True):
    id: int


Frame = Call | Reply | Cancel
Handler = Callable[[Any], Awaitable[Any]]


class RemoteError(Exception):
    """The other side's handler raised: ``kind`` is its exception's type name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class ChannelClosed(ConnectionError):
    """The other side is gone (exited, killed, or sent what no peer sends)."""


def _retrieved(done: asyncio.Future[None]) -> None:
    if not done.cancelled():
        done.exception()


class Channel:
    """One end of a channel: ``read_exactly(n)`` and ``write(data)`` are the streams, ``handlers``
    what this end serves. :meth:`serve` reads until the streams end; :meth:`call` asks the other end."""

    def __init__(self, read_exactly: Callable[[int], Awaitable[bytes]], write: Callable[[bytes], Awaitable[None]],
                 handlers: Mapping[str, Handler], max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._read_exactly = read_exactly
        self._write = write
        self.handlers = dict(handlers)
        self.max_frame_bytes = max_frame_bytes
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._serving: dict[int, asyncio.Task[None]] = {}
        self._lock = asyncio.Lock()  # one write at a time
        # Frames sent in one turn of the event loop go out in one write (a rollout's model calls
        # and answers come in bursts: one system call and one wake-up of the peer for each burst).
        self._outbox: list[bytes] = []
        self._flush: asyncio.Future[None] | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Frame)
        self.closed: str | None = None  # why, once closed

    @property
    def num_waiting(self) -> int:
        """Calls of this end not answered yet."""
        return len(self._waiting)

    async def call(self, op: str, args: Any = None) -> Any:
        """Ask the other end; its handler's value, or :class:`RemoteError`. Cancelling this call
        cancels the handler on the other end."""
        if self.closed is not None:
            raise ChannelClosed(self.closed)
        call_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = future
        try:
            await self._send(Call(call_id, op, args))
            return await future
        except asyncio.CancelledError:
            if self.closed is None and not future.done():
                with contextlib.suppress(ConnectionError, OSError, ChannelClosed):
                    await asyncio.shield(self._send(Cancel(call_id)))
            raise
        finally:
            self._waiting.pop(call_id, None)

    async def _send(self, frame: Frame) -> None:
        """Returns once the frame is written (with the others of its turn of the loop)."""
        body = self._encoder.encode(frame)
        if len(body) > self.max_frame_bytes:
            raise ValueError(f"a {type(frame).__name__.lower()} of {len(body)} bytes is over the channel's "
                             f"{self.max_frame_bytes} bytes a frame")
        if self.closed is not None:
            raise ChannelClosed(self.closed)
        self._outbox += (_HEADER.pack(len(body)), body)
        flush = self._flush
        if flush is None:
            flush = self._flush = asyncio.ensure_future(self._write_outbox())
            flush.add_done_callback(_retrieved)  # its senders may all be cancelled meanwhile
        await asyncio.shield(flush)

    async def _write_outbox(self) -> None:
        await asyncio.sleep(0)  # the rest of this turn's frames join
        async with self._lock:
            data, self._outbox, self._flush = b"".join(self._outbox), [], None  # later frames: the next write
            if self.closed is not None:
                raise ChannelClosed(self.closed)
            await self._write(data)

    async def serve(self) -> None:
        """Read frames until the streams end or break; then close (see :meth:`close`)."""
        why = "the other end closed the channel"
        try:
            while True:
                try:
                    header = await self._read_exactly(_HEADER.size)
                except (asyncio.IncompleteReadError, ConnectionError, OSError):
                    break
                (size,) = _HEADER.unpack(header)
                if size > self.max_frame_bytes:
                    why = f"the other end sent a frame of {size} bytes, over {self.max_frame_bytes}"
                    break
                try:
                    body = await self._read_exactly(size)
                except (asyncio.IncompleteReadError, ConnectionError, OSError):
                    break
                try:
                    frame = self._decoder.decode(body)
                except msgspec.DecodeError as exc:
                    why = f"the other end sent a frame that does not decode ({exc})"
                    break
                self._take(frame)
        finally:
            self.close(why)

    def _take(self, frame: Frame) -> None:
        if isinstance(frame, Reply):
            future = self._waiting.get(frame.id)
            if future is not None and not future.done():
                if frame.error is not None:
                    future.set_exception(RemoteError(frame.kind or "Exception", frame.error))
                else:
                    future.set_result(frame.value)
        elif isinstance(frame, Call):
            self._serving[frame.id] = asyncio.ensure_future(self._answer(frame))
        else:
            task = self._serving.get(frame.id)
            if task is not None:
                task.cancel()

    async def _answer(self, call: Call) -> None:
        handler = self.handlers.get(call.op)
        try:
            if handler is None:
                raise LookupError(f"no operation {call.op!r} here (there are {', '.join(sorted(self.handlers))})")
            reply = Reply(call.id, value=await handler(call.args))
        except asyncio.CancelledError:
            reply = Reply(call.id, error="cancelled by the caller", kind="CancelledError")
        except Exception as exc:
            reply = Reply(call.id, error=str(exc) or repr(exc), kind=type(exc).__name__)
        finally:
            self._serving.pop(call.id, None)
        try:
            await self._send(reply)
        except ValueError as exc:  # the value is too big to send: the caller hears that instead
            with contextlib.suppress(ConnectionError, OSError, ChannelClosed):
                await self._send(Reply(call.id, error=str(exc), kind="ValueError"))
        except (ConnectionError, OSError, ChannelClosed):
            pass  # the other end is gone: nobody waits for this answer

    def close(self, why: str) -> None:
        """Fail every call waiting for an answer with :class:`ChannelClosed` (``why``), and cancel
        the calls being served. Idempotent; the first reason stays."""
        if self.closed is None:
            self.closed = why
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(ChannelClosed(self.closed))
        for task in list(self._serving.values()):
            task.cancel()
