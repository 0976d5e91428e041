"""A bound on request bodies, for every service's HTTP API: a body above ``max_body_bytes`` is
refused with 413, naming the limit and the setting that raises it.

A plain ASGI middleware (not Starlette's ``BaseHTTPMiddleware``, which would buffer and
re-wrap every request and break streaming responses). A request that declares a larger
``Content-Length`` is answered at once, without reading its body; a body without one
(chunked) is counted as the route reads it, and the read that goes over the limit raises
:class:`BodyTooLarge`, an ``HTTPException`` (FastAPI lets those through its body parsing), which
each service answers in its own error shape. Not covered: bounds on headers or on the time a
client takes to send its body (the server's, uvicorn's, job).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def too_large_detail(service: str, max_body_bytes: int, setting: str, advice: str) -> str:
    return f"the request body is larger than {service}'s limit of {max_body_bytes} bytes (setting {setting}); {advice}"


class BodyTooLarge(HTTPException):
    """A body without a ``Content-Length`` went over the limit as it was read: a 413 saying so."""

    def __init__(self, detail: str) -> None:
        super().__init__(413, detail)


class BodyLimit:
    """Refuses bodies above ``max_body_bytes`` with 413 and ``detail``: one that declares its
    size with ``refuse(detail)`` before it is read, one that does not with :class:`BodyTooLarge`
    once the read goes over."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, detail: str, refuse: Callable[[str], Response]) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.detail = detail
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self.refuse(self.detail)(scope, receive, send)
            return
        num_bytes = 0

        async def counted() -> Message:
            nonlocal num_bytes
            message = await receive()
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > self.max_body_bytes:
                    raise BodyTooLarge(self.detail)
            return message

        await self.app(scope, counted, send)


def content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed one before the app sees it
    return None
