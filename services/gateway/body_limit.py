"""A bound on request bodies: a body above ``max_body_bytes`` is refused with 413, naming the limit.

A plain ASGI middleware (not Starlette's ``BaseHTTPMiddleware``, which would buffer and
re-wrap every request and break streaming responses). A request that declares a larger
``Content-Length`` is answered at once, without reading its body; a body without one
(chunked) is counted as the route reads it, and the read that goes over the limit raises
the 413 (an ``HTTPException``, which FastAPI lets through its body parsing and answers as
JSON). Not covered: bounds on headers or on the time a client takes to send its body (the
server's, uvicorn's, job).
"""

from __future__ import annotations

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def too_large_detail(max_body_bytes: int) -> str:
    return (f"the request body is larger than the gateway's limit of {max_body_bytes} bytes "
            "(setting gateway_max_body_bytes); send fewer tasks per request, or push a smaller package")


class BodyLimit:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await JSONResponse({"detail": too_large_detail(self.max_body_bytes)}, status_code=413)(scope, receive, send)
            return
        num_bytes = 0

        async def counted() -> Message:
            nonlocal num_bytes
            message = await receive()
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > self.max_body_bytes:
                    raise HTTPException(413, too_large_detail(self.max_body_bytes))
            return message

        await self.app(scope, counted, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed one before the app sees it
    return None
