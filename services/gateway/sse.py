"""Server-sent events, as the gateway's live routes send them (``/v1/traces/{rollout}/stream``,
``/v1/runs/{run}/stream``).

A route makes an async iterator of ``(event, data)`` pairs (data: anything msgspec encodes
as JSON), None for a keep-alive, and answers :func:`event_stream` of it: ``event:`` and
``data:`` lines per event, a ``: keepalive`` comment for None (every ``KEEPALIVE_S`` of
quiet keeps proxies from closing the stream), no caching and no proxy buffering. A client
that leaves cancels the iterator (Starlette's StreamingResponse), so a ``finally`` in it
releases what it holds.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi.responses import StreamingResponse

KEEPALIVE_S = 15.0
EVENT_STREAM = "text/event-stream"

Events = AsyncIterator[tuple[str, Any] | None]


def responses(description: str) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of a route that answers server-sent events."""
    return {200: {"content": {EVENT_STREAM: {}}, "description": f"Server-sent events: {description}"}}


def event_stream(stream: Events) -> StreamingResponse:
    return StreamingResponse(_server_sent(stream), media_type=EVENT_STREAM,
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _server_sent(stream: Events) -> AsyncIterator[bytes]:
    """SSE framing: ``event:`` and ``data:`` (JSON) per event; None is a keep-alive comment."""
    encoder = msgspec.json.Encoder()
    async for item in stream:
        if item is None:
            yield b": keepalive\n\n"
        else:
            name, data = item
            yield b"event: " + name.encode() + b"\ndata: " + encoder.encode(data) + b"\n\n"
