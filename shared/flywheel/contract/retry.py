"""Trying again: the one schedule type for every wait-and-retry of the platform.

A :class:`Backoff` is a schedule as data. The wait after the ``n``-th failure in a row is
``first_s * factor ** (n - 1)``, capped at ``max_s``, or, given a ``table``, its ``n``-th entry
(the last one repeating); ``jitter`` spreads each wait over ``[1 - jitter, 1 + jitter]`` times
itself, so many clients that failed together do not come back together. :func:`retry` runs an
operation under a schedule while its failures are transient, within a time budget or a count of
tries. Every loop that waits and tries again uses these two, with its schedule named beside
it, so the schedules can be read in one place:

- a bus operation (:meth:`flywheel.contract.bus.Bus.retry`): :data:`BUS_OPS`, within ``publish_timeout_s``;
- a first connection to NATS: :data:`BUS_CONNECT`, within ``connect_timeout_s``;
- an event delivered again by a consumer: its ``backoff_s`` table (setting ``backoff_s``);
- a sandbox service at its cap of sandboxes: :data:`SANDBOX_CAPACITY`, within ``CAPACITY_WAIT_S``;
- an environment worker that died at start: :data:`WORKER_RESTART`;
- a process that exited (``flywheel up``'s services, a run's trainer): the schedule of its
  :class:`flywheel.runtime.supervise.RestartBackoff`;
- weights inference fetches: its ``retry_s`` table;
- an eval's upstream (the recording proxy): doubling from its ``backoff_s`` up to 30 s, jittered,
  or the upstream's Retry-After.

A test (``tests/unit/test_retry.py``) finds any other schedule kept on the side.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

MAX_EXPONENT = 62  # factor ** 62 is past any cap


@dataclass(frozen=True)
class Backoff:
    """How long to wait after each failure in a row (see the module)."""

    first_s: float = 0.05
    max_s: float = 1.0
    factor: float = 2.0
    jitter: float = 0.0
    table: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.first_s < 0 or self.max_s < 0 or any(t < 0 for t in self.table):
            raise ValueError(f"{self}: a wait cannot be negative")
        if self.factor < 1:
            raise ValueError(f"{self}: factor {self.factor} below 1 would wait less after each failure")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"{self}: jitter {self.jitter} is a fraction from 0 to 1")

    @classmethod
    def of(cls, waits_s: Sequence[float], jitter: float = 0.0) -> Backoff:
        """A schedule given as its waits, the last one repeating (none given: 1 s)."""
        return cls(table=tuple(waits_s) or (1.0,), jitter=jitter)

    def delay_s(self, num_failed: int) -> float:
        """The wait after the ``num_failed``-th failure in a row (1 for the first)."""
        n = max(num_failed, 1)
        if self.table:
            base = self.table[min(n, len(self.table)) - 1]
        else:
            base = min(self.first_s * self.factor ** min(n - 1, MAX_EXPONENT), self.max_s)
        if self.jitter:
            base *= 1.0 - self.jitter + 2.0 * self.jitter * random.random()
        return base


# The schedules of the bus (each named where it is used; see the table above).
BUS_OPS = Backoff(first_s=0.05, max_s=2.0)
BUS_CONNECT = Backoff(first_s=0.05, max_s=1.0)
SANDBOX_CAPACITY = Backoff(first_s=0.05, max_s=1.0)
WORKER_RESTART = Backoff(first_s=0.5, max_s=30.0)


def always(exc: BaseException) -> bool:
    """Every failure is worth another try."""
    return True


async def retry(op: Callable[[], Awaitable[T]], backoff: Backoff, *,
                transient: Callable[[BaseException], bool] = always, timeout_s: float | None = None,
                max_retries: int | None = None, wait: Callable[[float], Awaitable[object]] = asyncio.sleep,
                delay_of: Callable[[BaseException, float], float] | None = None,
                on_retry: Callable[[BaseException, float, int], object] | None = None) -> T:
    """``op()``, tried again after each transient failure, waiting as ``backoff`` says; the
    failure propagates once it is not ``transient``, after ``max_retries`` retries, or when the
    next wait would end past ``timeout_s`` from the start. ``delay_of(exc, delay_s)`` may
    change a wait (a server's Retry-After); ``wait(delay_s)`` waits (one that returns early, on an
    event, is fine: ``transient`` decides after it); ``on_retry(exc, delay_s, num_failed)`` is told
    before each wait (to log it)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    num_failed = 0
    while True:
        try:
            return await op()
        except Exception as exc:
            num_failed += 1
            if not transient(exc) or (max_retries is not None and num_failed > max_retries):
                raise
            delay_s = backoff.delay_s(num_failed)
            if delay_of is not None:
                delay_s = delay_of(exc, delay_s)
            if deadline is not None and time.monotonic() + delay_s > deadline:
                raise
            if on_retry is not None:
                on_retry(exc, delay_s, num_failed)
            await wait(delay_s)
