"""Inference replicas share one admission bound per run, kept on the bus (a real nats-server).

Two :class:`Admission` objects stand for two replicas of one run (batch 4, no staleness: 4
rollouts may be issued per weights version), each with its :class:`SharedIssued` on the same
bus. What one holds or published counts against the other; a group the shared total refuses
waits and is admitted once the bound moves; a replica that dies holding a group stops
counting once its lease runs out; and many groups racing from both replicas never issue more
than the bound (compare-and-set on one entry).
"""

from __future__ import annotations

import asyncio

import pytest

from flywheel.contract.bus import Bus
from flywheel_inference import admission as admission_module
from flywheel_inference.admission import Admission, SharedIssued
from tests.helpers import until

RUN = "shared-run"


async def published(_: str) -> int:
    return 0  # the run's ROLLOUTS stream holds nothing yet


def replica(bus: Bus, name: str, batch_size: int = 4) -> Admission:
    return Admission(batch_size=batch_size, max_off_policy_steps=0, max_in_flight=64,
                     shared=SharedIssued(bus, RUN, name, published))


async def hold(admission: Admission, n: int, stored: int, release: asyncio.Event,
               admitted: asyncio.Event | None = None) -> None:
    async with admission.slot(n) as slot:
        if admitted is not None:
            admitted.set()
        await release.wait()
        slot.num_stored = stored


async def test_what_one_replica_holds_or_published_counts_for_the_other(bus: Bus) -> None:
    a, b = replica(bus, "a"), replica(bus, "b")
    await a.advance(0)
    await b.advance(0)
    release_a, release_b, b_in = asyncio.Event(), asyncio.Event(), asyncio.Event()
    a_in = asyncio.Event()
    first = asyncio.ensure_future(hold(a, 4, 4, release_a, a_in))
    await a_in.wait()
    second = asyncio.ensure_future(hold(b, 4, 4, release_b, b_in))
    await asyncio.sleep(2 * admission_module.RETRY_S)  # noqa: sleep - b's refused asks, a few retries long
    assert not b_in.is_set() and b.num_waiting == 4  # a holds the version's 4
    assert await a.shared.total() == 4  # type: ignore[union-attr]
    release_a.set()
    await first
    assert await b.shared.total() == 4  # type: ignore[union-attr]  # a's 4 are published now
    assert not b_in.is_set()
    await a.advance(1)
    await b.advance(1)  # version 1: 8 may be issued
    await until(b_in.is_set, what="b admitted once the bound moved")
    release_b.set()
    await second
    assert await b.shared.total() == 8  # type: ignore[union-attr]
    await a.shared.close()  # type: ignore[union-attr]
    await b.shared.close()  # type: ignore[union-attr]


async def test_a_dead_replicas_holding_stops_counting_when_its_lease_runs_out(
        bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission_module, "LEASE_S", 1.5)
    a, b = replica(bus, "a"), replica(bus, "b")
    await a.advance(0)
    await b.advance(0)
    a_in, b_in = asyncio.Event(), asyncio.Event()
    dying = asyncio.ensure_future(hold(a, 4, 4, asyncio.Event(), a_in))
    await a_in.wait()
    await a.shared.close()  # type: ignore[union-attr]  # killed: no more renewals, never released
    dying.cancel()
    a.shared = None  # its process is gone: nothing of it runs the slot's release
    with pytest.raises(asyncio.CancelledError):
        await dying
    waiting = asyncio.ensure_future(hold(b, 4, 4, asyncio.Event(), b_in))
    await until(b_in.is_set, timeout_s=10, what="b admitted once a's lease ran out")
    waiting.cancel()
    await b.shared.close()  # type: ignore[union-attr]


async def test_racing_replicas_never_issue_more_than_the_bound(bus: Bus) -> None:
    replicas = [replica(bus, f"r{i}", batch_size=8) for i in range(3)]
    for r in replicas:
        await r.advance(0)
    issued: list[int] = []
    stop = asyncio.Event()

    async def one(r: Admission) -> None:
        async with r.slot(2) as slot:
            issued.append(2)
            await stop.wait()
            slot.num_stored = 2

    tasks = [asyncio.ensure_future(one(r)) for r in replicas for _ in range(4)]  # 12 groups of 2 race for 8
    await until(lambda: sum(issued) == 8, what="the bound's 8 rollouts admitted")
    await asyncio.sleep(2 * admission_module.RETRY_S)  # noqa: sleep - room for a wrong extra admission
    assert sum(issued) == 8
    assert await replicas[0].shared.total() == 8  # type: ignore[union-attr]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for r in replicas:
        await r.shared.close()  # type: ignore[union-attr]



async def test_a_replica_writes_on_the_entry_it_saw_and_refuses_only_on_a_fresh_read(bus: Bus) -> None:
    a, b = SharedIssued(bus, "cached-run", "a", published), SharedIssued(bus, "cached-run", "b", published)
    reads = 0
    read = a._read

    async def counted() -> tuple[dict, int | None]:
        nonlocal reads
        reads += 1
        return await read()

    a._read = counted  # type: ignore[method-assign]  # counts a's reads of the entry, each a round trip
    for _ in range(3):  # alone: each change is one compare-and-set on the entry a saw last
        assert await a.reserve(2, 16)
        await a.release(2, 2)
    assert reads == 1
    assert await b.reserve(6, 16)  # b holds 6: 12 issued
    assert not await a.reserve(6, 16)  # a's write fails (b wrote since), a reads: 18 > 16, refused
    assert reads == 2
    await b.release(6, 0)  # b gives its 6 back (the bus stored none): 6 issued
    assert await a.reserve(6, 16)  # a saw 18: it reads again before refusing, and fits
    assert reads == 3
    assert await b.total() == 12
    await a.close()
    await b.close()
