"""Admission control: the bound on issued rollouts per trainer step, and on rollouts in flight."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import nats.js.errors
import pytest

from flywheel.contract.config import RunConfig
from flywheel_inference.admission import Admission, RunEnded, SharedIssued, TenantPlaces
from tests.helpers import until


def test_the_bound_follows_the_trainer_step() -> None:
    cfg = RunConfig.parse({"run": "r", "env": "e", "group_size": 4,
                           "trainer": {"batch_size": 8, "max_off_policy_steps": 2},
                           "inference": {"max_rollouts_in_flight": 16}})
    a = Admission.for_run(cfg, num_issued=20)
    assert a.max_issued == (0 + 2 + 1) * 8 == 24
    assert not a.fits(1)  # nothing before the first weights are loaded
    a.weights_loaded = True
    assert a.fits(4) and not a.fits(5)
    a.trainer_step = 3
    assert a.max_issued == 48 and a.fits(28) and not a.fits(29)  # in flight is bounded rollout by rollout


def test_spare_rollouts_are_admitted_beyond_the_staleness_budget() -> None:
    cfg = RunConfig.parse({"run": "r", "env": "e", "group_size": 4,
                           "trainer": {"batch_size": 8, "max_off_policy_steps": 1},
                           "inference": {"max_rollouts_in_flight": 16, "spare_rollouts": 8}})
    a = Admission.for_run(cfg, num_issued=16)
    a.weights_loaded = True
    assert a.max_issued == (0 + 1 + 1) * 8 + 8 == 24 and a.fits(8) and not a.fits(9)
    a.num_unused = 4  # groups the trainer consumed untrained (stale spares): their allowance comes back
    assert a.max_issued == 28 and a.counters()["max_issued"] == 28
    with pytest.raises(ValueError, match="spare_rollouts"):
        RunConfig.parse({"run": "r", "env": "e", "inference": {"spare_rollouts": -1}})


def test_groups_that_could_never_be_admitted_are_refused_naming_the_field() -> None:
    a = Admission(batch_size=8, max_off_policy_steps=0, max_in_flight=32)
    with pytest.raises(ValueError, match="max_off_policy_steps"):
        a.check(9)
    Admission(batch_size=8, max_off_policy_steps=0, max_in_flight=4).check(5)  # its rollouts take turns


async def test_a_group_waits_for_the_next_weight_version() -> None:
    a = Admission(batch_size=8, max_off_policy_steps=0, max_in_flight=64, weights_loaded=True)
    admitted: list[int] = []
    release = asyncio.Event()

    async def group(i: int) -> None:
        async with a.slot(4):
            admitted.append(i)
            await release.wait()

    tasks = [asyncio.ensure_future(group(i)) for i in range(3)]
    await until(lambda: len(admitted) == 2 and a.num_waiting == 4, what="two groups in, one waiting")
    assert a.counters() == {"trainer_step": 0, "num_unused": 0, "max_issued": 8, "num_issued": 8, "num_in_flight": 0,
                            "num_waiting": 4, "num_skipped": 0, "ended": None}
    release.set()
    await until(lambda: len([t for t in tasks if t.done()]) == 2, what="the first two done")
    assert len(admitted) == 2  # done is not enough: the trainer has not stepped
    await a.advance(1)
    await asyncio.gather(*tasks)
    assert len(admitted) == 3 and a.num_issued == 12 and a.num_waiting == 0


async def test_waiting_groups_are_admitted_first_come_first_served() -> None:
    # Room that frees up goes to the groups already waiting, in the order they came, not to
    # a group arriving just then: a seeded run samples the same tasks in the same steps.
    a = Admission(batch_size=8, max_off_policy_steps=0, max_in_flight=64, weights_loaded=True)
    admitted: list[int] = []

    async def group(i: int) -> None:
        async with a.slot(4):
            admitted.append(i)

    first = [asyncio.ensure_future(group(i)) for i in range(4)]
    await until(lambda: admitted == [0, 1] and a.num_waiting == 8, what="two groups in, two waiting")
    late = asyncio.ensure_future(group(4))  # arrives as room for two more frees up, before the waiters wake
    await a.advance(1)
    await until(lambda: len(admitted) == 4, what="the two waiting groups in")
    assert admitted == [0, 1, 2, 3] and a.num_waiting == 4
    await a.advance(2)
    await asyncio.gather(*first, late)
    assert admitted == [0, 1, 2, 3, 4]


async def test_rollouts_in_flight_are_bounded_one_by_one_and_a_failed_group_gives_its_allowance_back() -> None:
    # Places are taken and given back rollout by rollout: a group's rollouts that ended early
    # let the next group's start while their slow sibling still runs.
    a = Admission(batch_size=100, max_off_policy_steps=0, max_in_flight=4, weights_loaded=True)
    release = {(g, i): asyncio.Event() for g in range(2) for i in range(4)}
    running: list[tuple[int, int]] = []

    async def one(g: int, i: int) -> None:
        async with a.rollout():
            running.append((g, i))
            await release[g, i].wait()

    async def group(g: int) -> None:
        async with a.slot(4):
            await asyncio.gather(*(one(g, i) for i in range(4)))

    groups = [asyncio.ensure_future(group(g)) for g in range(2)]
    await until(lambda: len(running) == 4 and a.num_waiting == 4, what="four running, four waiting for a place")
    assert running == [(0, 0), (0, 1), (0, 2), (0, 3)] and a.num_in_flight == 4 and a.num_issued == 8
    for i in range(3):  # three of the first group end; its fourth is slow
        release[0, i].set()
    await until(lambda: len(running) == 7, what="three of the second group started")
    assert running[4:] == [(1, 0), (1, 1), (1, 2)] and a.num_in_flight == 4
    for event in release.values():
        event.set()
    await asyncio.gather(*groups)
    assert a.num_in_flight == 0 and a.num_waiting == 0
    with pytest.raises(RuntimeError):
        async with a.slot(4):
            raise RuntimeError("publish failed")
    assert a.num_issued == 8 and a.num_in_flight == 0


async def test_when_the_run_ends_waiting_tasks_are_released_and_new_ones_refused_until_it_resumes() -> None:
    a = Admission(batch_size=4, max_off_policy_steps=0, max_in_flight=8, weights_loaded=True)
    async with a.slot(4):
        pass
    outcome: list[str] = []

    async def wait_for_room() -> None:
        try:
            async with a.slot(4):
                outcome.append("sampled")
        except RunEnded as exc:
            outcome.append(str(exc))

    waiting = asyncio.ensure_future(wait_for_room())
    await until(lambda: a.num_waiting == 4, what="the task to wait for room")
    assert not waiting.done()
    await a.set_ended("run 'r' is abandoned")
    await waiting
    assert outcome == ["run 'r' is abandoned"] and a.num_skipped == 4 and a.num_waiting == 0
    with pytest.raises(RunEnded, match="abandoned"):
        async with a.slot(1):
            pass
    await a.set_ended(None)  # its owner resumed it
    await a.advance(1)
    async with a.slot(4):
        pass
    assert a.num_issued == 8


async def test_nothing_is_admitted_before_the_first_weights_load() -> None:
    a = Admission(batch_size=8, max_off_policy_steps=0, max_in_flight=8)
    entered = asyncio.Event()

    async def group() -> None:
        async with a.slot(4):
            entered.set()

    waiting = asyncio.ensure_future(group())
    await until(lambda: a.num_waiting == 4, what="the group to wait for weights")
    assert not entered.is_set()
    await a.advance(0)  # version 0 loaded: the step stays 0, the weights are there
    await waiting
    assert a.weights_loaded and a.num_issued == 4


async def test_a_group_keeps_only_the_rollouts_the_bus_stored() -> None:
    a = Admission(batch_size=8, max_off_policy_steps=0, max_in_flight=8, weights_loaded=True)
    async with a.slot(4) as slot:
        slot.num_stored = 0  # every rollout was on the bus already: an earlier delivery's
    assert a.num_issued == 0 and a.num_in_flight == 0
    async with a.slot(4) as slot:
        slot.num_stored = 3
    async with a.slot(4):
        pass  # not told: all of it counts
    assert a.num_issued == 7
    with pytest.raises(RuntimeError):
        async with a.slot(1) as slot:
            slot.num_stored = 1
            raise RuntimeError("failed after the publish")
    assert a.num_issued == 8  # published is published


async def test_groups_the_trainer_consumed_untrained_give_their_allowance_back() -> None:
    a = Admission(batch_size=8, max_off_policy_steps=1, max_in_flight=64)
    assert a.max_issued == 16
    await a.advance(1, num_unused=8)  # a whole batch went stale
    assert a.max_issued == (1 + 1 + 1) * 8 + 8
    await a.advance(1, num_unused=4)  # an older report never takes allowance away
    assert a.num_unused == 8


async def test_a_rollout_waiting_for_a_place_is_released_when_the_run_ends() -> None:
    a = Admission(batch_size=8, max_off_policy_steps=0, max_in_flight=1, weights_loaded=True)
    hold = asyncio.Event()

    async def one() -> None:
        async with a.rollout():
            await hold.wait()

    running = asyncio.ensure_future(one())
    waiting = asyncio.ensure_future(one())
    await until(lambda: a.num_in_flight == 1 and a.num_waiting == 1, what="one running, one waiting")
    await a.set_ended("stopped")
    with pytest.raises(RunEnded, match="stopped"):
        await waiting
    hold.set()
    await running
    assert a.num_in_flight == 0 and a.num_waiting == 0


async def test_a_tenant_s_runs_share_its_places_and_leave_the_other_tenants_theirs() -> None:
    # Mallory's two runs are slow (their rollouts hold their places): together they take her
    # quota of 3, and wait beyond it, holding only their own runs' places; Alice's run, on
    # the same process, starts every rollout at once.
    mallory, alice = TenantPlaces("mallory", 3), TenantPlaces("alice", 3)
    slow = [Admission(batch_size=8, max_off_policy_steps=0, max_in_flight=4, weights_loaded=True, tenant=mallory)
            for _ in range(2)]
    fast = Admission(batch_size=8, max_off_policy_steps=0, max_in_flight=4, weights_loaded=True, tenant=alice)
    hold = asyncio.Event()
    started: list[str] = []

    async def one(a: Admission, name: str) -> None:
        async with a.rollout():
            started.append(name)
            await hold.wait()

    rollouts = [asyncio.ensure_future(one(a, f"slow{r}")) for r, a in enumerate(slow) for _ in range(2)]
    await until(lambda: len(started) == 3 and mallory.num_waiting == 1, what="mallory's quota taken, one waiting")
    assert [a.num_in_flight for a in slow] == [2, 1] and slow[1].num_waiting_tenant == 1
    assert slow[1].counters() | {"tenant": "mallory", "num_waiting_tenant": 1, "tenant_in_flight": 3,
                                 "tenant_max_in_flight": 3} == slow[1].counters()
    rollouts += [asyncio.ensure_future(one(fast, "fast")) for _ in range(3)]
    await until(lambda: started.count("fast") == 3, what="alice's rollouts, all started")
    assert alice.num_waiting == 0 and mallory.num_waiting == 1

    await slow[1].set_ended("stopped by mallory")  # the waiting one leaves, with its run's place
    with pytest.raises(RunEnded, match="stopped by mallory"):
        await rollouts[3]
    assert slow[1].num_waiting_tenant == 0 and mallory.num_waiting == 0
    hold.set()
    await asyncio.gather(*rollouts[:3], *rollouts[4:])
    assert mallory.num_in_flight == alice.num_in_flight == 0
    assert all(a.num_in_flight == 0 and a._num_placed == 0 for a in (*slow, fast))


class RefusingBound:
    """A shared bound (the other replicas hold everything): refuses every group, counting asks."""

    def __init__(self) -> None:
        self.asks = 0

    async def reserve(self, n: int, max_issued: int) -> bool:
        self.asks += 1
        return False

    async def release(self, n: int, stored: int) -> None:
        raise AssertionError("nothing was reserved")


async def test_a_group_the_shared_bound_refuses_stops_when_cancelled_as_the_bound_moves() -> None:
    shared = RefusingBound()
    a = Admission(batch_size=4, max_off_policy_steps=0, max_in_flight=8, shared=shared)  # type: ignore[arg-type]
    await a.advance(0)

    async def enter() -> None:
        async with a.slot(2):
            raise AssertionError("admitted past a refusing bound")

    waiting = asyncio.ensure_future(enter())
    await until(lambda: shared.asks >= 1, what="the shared bound asked")
    await asyncio.sleep(0)  # noqa: sleep - one turn: the refused group is in its retry wait
    await a.advance(1)  # the bound moves: the retry wait ends in this turn ...
    waiting.cancel()  # ... and the task is cancelled in the same one (shutdown, or a lost consumer)
    with pytest.raises(asyncio.CancelledError):  # not TimeoutError: a swallowed cancel retries forever
        async with asyncio.timeout(10):
            await waiting
    assert a.num_waiting == 0 and a.num_issued == 0


class YieldingBucket:
    """The admission bucket's compare-and-set, in memory; every write yields to the loop once it
    is stored (as the bus's reply does), so other tasks of the replica run in between."""

    def __init__(self) -> None:
        self.value: bytes | None = None
        self.revision = 0

    async def get(self, key: str) -> Any:
        if self.value is None:
            raise nats.js.errors.KeyNotFoundError
        return SimpleNamespace(value=self.value, revision=self.revision)

    async def create(self, key: str, value: bytes) -> int:
        return await self.update(key, value, last=0)

    async def update(self, key: str, value: bytes, last: int) -> int:
        if last != self.revision:
            raise nats.js.errors.KeyWrongLastSequenceError
        self.value, self.revision = value, self.revision + 1
        await asyncio.sleep(0)  # noqa: sleep - the reply's turn: the write is stored, its caller not yet resumed
        return self.revision


async def test_a_release_between_a_reservations_write_and_its_count_loses_nothing() -> None:
    """A group's release that runs while another group's reservation waits for its reply must not
    write the replica's holding back without that reservation (the others would admit past the bound)."""
    async def published(_: str) -> int:
        return 0

    shared = SharedIssued(None, "r", "a", published)  # type: ignore[arg-type]
    shared._bucket = YieldingBucket()  # type: ignore[assignment]
    assert await shared.reserve(4, 8)
    await asyncio.gather(shared.reserve(4, 8), shared.release(4, 4))  # the second group in, the first published
    assert shared.held == 4 and await shared.total() == 8  # 4 published, 4 held: not 4 with the holding lost
    assert not await shared.reserve(1, 8)
    await shared.close()
