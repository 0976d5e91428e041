"""A load started once per key, however many callers ask for it meanwhile.

The worker's parts load things by key on first use (a run's policy, a snapshot, a shared base,
an environment): the callers that ask while one loads all wait for that one load.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

K = TypeVar("K")
T = TypeVar("T")


async def once(pending: dict[K, asyncio.Future[T]], key: K, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``make()`` started once for ``key`` however many callers ask meanwhile; each waits for it
    (shielded: a caller that gives up does not cancel it for the others)."""
    if key not in pending:
        pending[key] = asyncio.ensure_future(make())
    future = pending[key]
    try:
        return await asyncio.shield(future)
    finally:
        if future.done():
            pending.pop(key, None)
