"""The one retry schedule (:mod:`flywheel.contract.retry`), and that no other place keeps one."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest

from flywheel.contract.retry import Backoff, retry

ROOT = Path(__file__).parents[2]


def test_a_schedule_doubles_up_to_its_cap_and_a_table_repeats_its_last_wait() -> None:
    assert [Backoff(first_s=1.0, max_s=8.0).delay_s(n) for n in range(1, 7)] == [1, 2, 4, 8, 8, 8]
    assert Backoff(first_s=1.0, max_s=60.0).delay_s(10_000) == 60  # no overflow however long it fails
    assert [Backoff.of((0.5, 2.0, 5.0)).delay_s(n) for n in range(1, 6)] == [0.5, 2.0, 5.0, 5.0, 5.0]
    assert Backoff.of(()).delay_s(3) == 1.0
    spread = [Backoff(first_s=1.0, max_s=1.0, jitter=0.25).delay_s(1) for _ in range(200)]
    assert all(0.75 <= d <= 1.25 for d in spread) and len(set(spread)) > 1


def test_a_schedule_that_makes_no_sense_is_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        Backoff(first_s=-1.0)
    with pytest.raises(ValueError, match=r"factor 0\.5"):
        Backoff(factor=0.5)
    with pytest.raises(ValueError, match=r"jitter 2\.0"):
        Backoff(jitter=2.0)


async def test_retry_tries_again_while_transient_and_stops_when_told() -> None:
    calls: list[float] = []

    async def flaky() -> str:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise ConnectionError("not yet")
        return "done"

    told: list[tuple[float, int]] = []
    assert await retry(flaky, Backoff(first_s=0.01, max_s=0.01), on_retry=lambda e, d, n: told.append((d, n))) == "done"
    assert len(calls) == 3 and told == [(0.01, 1), (0.01, 2)]

    calls.clear()
    with pytest.raises(ConnectionError):  # max_retries: one first try and two more
        await retry(lambda: flaky_forever(calls), Backoff(first_s=0.0), max_retries=2)
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(ConnectionError):  # not transient: at once
        await retry(lambda: flaky_forever(calls), Backoff(first_s=0.0), transient=lambda e: False)
    assert len(calls) == 1
    calls.clear()
    started = time.monotonic()
    with pytest.raises(ConnectionError):  # the next wait would end past the time budget
        await retry(lambda: flaky_forever(calls), Backoff(first_s=0.2, max_s=0.2), timeout_s=0.5)
    assert len(calls) == 3 and time.monotonic() - started < 0.5


async def flaky_forever(calls: list[float]) -> None:
    calls.append(time.monotonic())
    raise ConnectionError("never")


async def test_a_wait_may_be_changed_and_cut_short() -> None:
    calls: list[float] = []
    waited: list[float] = []
    woken = asyncio.Event()

    async def wait(delay_s: float) -> None:
        waited.append(delay_s)
        woken.set()

    with pytest.raises(ConnectionError):
        await retry(lambda: flaky_forever(calls), Backoff(first_s=5.0), max_retries=1, wait=wait,
                    delay_of=lambda exc, delay_s: 0.25)  # a server's Retry-After
    assert waited == [0.25] and woken.is_set()


# Arithmetic of a backoff schedule (doubling a wait, a power of an attempt count) or a table of
# waits indexed by attempt, anywhere but the retry module: a schedule kept on the side.
OWN_SCHEDULE = re.compile(r"\b\w*(delay|backoff|wait)\w*\s*\*=?\s*2\b"
                          r"|\b2(\.0)?\s*\*\*\s*\(?\s*(attempt|failures|num_\w+|exponent)\b|\b\w*(backoff|retry)_s\[")


def test_every_retry_loop_uses_the_one_schedule_type() -> None:
    sources = [p for folder in ("shared", "services", "environments") for p in (ROOT / folder).rglob("*.py")
               if "tests" not in p.parts and p.name != "retry.py" and "migrations" not in p.parts]
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in sources
             for i, line in enumerate(p.read_text().splitlines(), 1) if OWN_SCHEDULE.search(line)]
    assert not found, "a retry schedule of its own; use flywheel.contract.retry.Backoff:\n" + "\n".join(found)
    assert OWN_SCHEDULE.search("delay_s = min(delay_s * 2, 1.0)")
    assert OWN_SCHEDULE.search("self.backoff_s * 2 ** attempt")
    assert OWN_SCHEDULE.search("delay_s = self.backoff_s[min(n, 3)]")
    assert not OWN_SCHEDULE.search("batch_size * 2")
