"""Calls from environment code to the endpoints its run's config names: a user simulator's
model, a judge. An environment worker has no network; inside one, such a call goes to the
worker's host over its channel, and the host makes it only when the URL is under one that an
argument of the environment gives (``[envs.args]``: ``user_base_url``, ``judge_url``, ...; see
:class:`flywheel.runtime.environments.WorkerProcess`). Anywhere else (``flywheel eval`` of a
module in this process, tests) calls go out as usual.

Environment code asks :func:`http_client` for an httpx client and hands it to its library
(``openai.AsyncOpenAI(http_client=...)``); None means "your library's own".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_transports: list[Callable[[], Any]] = []  # set by the environment worker: its channel's httpx transport


def use_transport(factory: Callable[[], Any] | None) -> None:
    """Send environment code's outside calls through ``factory()``'s httpx transport (the worker's)."""
    _transports[:] = [factory] if factory is not None else []


def http_client(timeout_s: float) -> Any | None:
    """An ``httpx.AsyncClient`` for a call to an endpoint the run's config names, inside an
    environment worker; None elsewhere."""
    if not _transports:
        return None
    import httpx

    return httpx.AsyncClient(transport=_transports[0](), timeout=timeout_s)
