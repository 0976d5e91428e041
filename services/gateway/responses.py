"""How the API answers errors: one shape, messages that name the field to fix.

FastAPI's own 422 lists pydantic's error objects; here each becomes ``field: message``
with the field written as a path a person reads (``tasks[2].run``, ``limit``), and all of
them joined in ``detail``. Errors from the parts map to statuses here, once: a bad cursor
is a 422 on ``cursor``; a run of another tenant, a run that has ended, or a run whose state
does not decode a 409; the bus or the database unreachable a 503. Anything else is a bug
and stays a 500 (the schema fuzzing test, tests/integration/test_schema_fuzz.py, looks for
them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import nats.errors
import sqlalchemy.exc
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from flywheel_gateway.models import ErrorPublic, ValidationErrorPublic
from flywheel_gateway.runs import BadRunState, RunConflict
from flywheel_gateway.store import InvalidCursor

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorPublic, "description": "Not found"},
    422: {"model": ValidationErrorPublic, "description": "Invalid request: every problem, naming its field"},
    503: {"model": ErrorPublic, "description": "NATS or the database is unreachable"},
}
CONFLICT_RESPONSE: dict[str, Any] = {
    "model": ErrorPublic,
    "description": "A run of another tenant, a run that has ended, or a run whose state in the run-state bucket does "
                   "not decode; the detail says which and what to do",
}
TOO_LARGE_RESPONSE: dict[str, Any] = {
    "model": ErrorPublic,
    "description": "The request body is above the gateway's limit (gateway_max_body_bytes), or a task is larger "
                   "than the bus takes; the detail names the limit (and the task)",
}
# The database did not answer (down, restarting, a connection dropped): worth a retry. Other
# database errors are bugs and are not hidden behind "retry later".
_DATABASE_DOWN = (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError, ConnectionError)
_SOURCES = ("body", "query", "path", "header", "cookie")
_MESSAGES = {"missing": "field required", "extra_forbidden": "unknown field (check its spelling)"}


def field_path(loc: Sequence[str | int]) -> str:
    """('body', 'tasks', 2, 'run') -> 'tasks[2].run'; ('query', 'limit') -> 'limit'."""
    parts = list(loc)
    if len(parts) > 1 and parts[0] in _SOURCES:
        parts = parts[1:]
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else f"{'.' if path else ''}{part}"
    return path


def field_message(error: dict[str, Any]) -> str:
    cause = (error.get("ctx") or {}).get("error")
    if error["type"] == "json_invalid":
        return f"not valid JSON ({cause}) at character {error['loc'][-1]}"
    message = _MESSAGES.get(error["type"]) or (str(cause) if cause is not None else error["msg"])
    return message[:1].lower() + message[1:]


def unprocessable(errors: Sequence[dict[str, Any]]) -> JSONResponse:
    fields = [{"field": "body" if e["type"] == "json_invalid" else field_path(e["loc"]), "message": field_message(e)}
              for e in errors]
    detail = "; ".join(f"{f['field']}: {f['message']}" for f in fields)
    return JSONResponse(ValidationErrorPublic.model_validate({"detail": detail, "errors": fields}).model_dump(),
                        status_code=422)


def refuse_field(source: str, name: str, message: str) -> RequestValidationError:
    """A 422 on one field (``source``: body, query, path, ...), in the API's one error shape."""
    return RequestValidationError([{"loc": (source, name), "type": "value_error", "msg": message}])


def refuse_inverted_range(low_name: str, low: Any, high_name: str, high: Any) -> None:
    """A 422 on ``low_name`` when both bounds are given and ``low`` is above ``high``."""
    if low is not None and high is not None and low > high:
        raise refuse_field("query", low_name, f"is greater than {high_name} ({low} > {high})")


def install_error_handlers(app: FastAPI) -> None:
    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return unprocessable(exc.errors())

    async def on_http(request: Request, exc: StarletteHTTPException) -> Response:
        # FastAPI answers a body that is not UTF-8 text, or a form it cannot parse, with a bare 400:
        # an invalid body, answered as any other (422, naming the body).
        cause = exc.__cause__
        if exc.status_code == 400 and isinstance(cause, UnicodeDecodeError):
            return unprocessable([{"loc": ("body", cause.start), "type": "json_invalid",
                                   "ctx": {"error": f"not UTF-8 text: {cause.reason}"}}])
        if exc.status_code == 400:  # a body the framework could not parse (malformed multipart, ...)
            return unprocessable([{"loc": ("body",), "type": "value_error",
                                   "msg": f"{exc.detail}; send a well-formed body"}])
        return await http_exception_handler(request, exc)

    async def on_cursor(_: Request, exc: InvalidCursor) -> JSONResponse:
        return unprocessable([{"loc": ("query", "cursor"), "type": "value_error", "msg": str(exc)}])

    async def on_conflict(_: Request, exc: RunConflict | BadRunState) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    async def on_bus_down(_: Request, exc: nats.errors.Error) -> JSONResponse:
        return JSONResponse({"detail": f"the bus is unavailable ({type(exc).__name__}: {exc}); retry later"},
                            status_code=503)

    async def on_database_down(_: Request, exc: Exception) -> JSONResponse:
        cause = getattr(exc, "orig", None) or exc
        return JSONResponse({"detail": f"the trace store is unavailable ({type(cause).__name__}: {cause}); "
                                       "retry later"}, status_code=503)

    app.add_exception_handler(RequestValidationError,
                              on_validation)  # type: ignore[arg-type]  # typed for Exception; gets only that class
    app.add_exception_handler(StarletteHTTPException,
                              on_http)  # type: ignore[arg-type]  # typed for Exception; gets only that class
    app.add_exception_handler(InvalidCursor,
                              on_cursor)  # type: ignore[arg-type]  # typed for Exception; gets only that class
    app.add_exception_handler(RunConflict,
                              on_conflict)  # type: ignore[arg-type]  # typed for Exception; gets only that class
    app.add_exception_handler(BadRunState,
                              on_conflict)  # type: ignore[arg-type]  # typed for Exception; gets only that class
    app.add_exception_handler(nats.errors.Error,
                              on_bus_down)  # type: ignore[arg-type]  # typed for Exception; gets only that class
    for error in _DATABASE_DOWN:
        app.add_exception_handler(error, on_database_down)
