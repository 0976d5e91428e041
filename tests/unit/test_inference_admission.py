"""Admission control: the bound on issued rollouts per trainer step, and on rollouts in flight."""

from __future__ import annotations

import asyncio

import pytest

from flywheel.config import RunConfig
from flywheel_inference.admission import Admission
from tests.helpers import until


def test_the_bound_follows_the_trainer_step() -> None:
    cfg = RunConfig.parse({"run": "r", "env": "e", "group_size": 4,
                           "trainer": {"batch_size": 8, "max_off_policy_steps": 2},
                           "inference": {"max_rollouts_in_flight": 16}})
    a = Admission.for_run(cfg, num_issued=20)
    assert a.max_issued == (0 + 2 + 1) * 8 == 24
    assert a.fits(4) and not a.fits(5)
    a.trainer_step = 3
    assert a.max_issued == 48 and a.fits(16) and not a.fits(17)  # 17 > max_rollouts_in_flight


def test_groups_that_could_never_be_admitted_are_refused_naming_the_field() -> None:
    a = Admission(batch_size=8, max_off_policy_steps=0, max_in_flight=32)
    with pytest.raises(ValueError, match="max_off_policy_steps"):
        a.check(9)
    with pytest.raises(ValueError, match="max_rollouts_in_flight=4"):
        Admission(batch_size=8, max_off_policy_steps=0, max_in_flight=4).check(5)


async def test_a_group_waits_for_the_next_weight_version() -> None:
    a = Admission(batch_size=8, max_off_policy_steps=0, max_in_flight=64)
    admitted: list[int] = []
    release = asyncio.Event()

    async def group(i: int) -> None:
        async with a.slot(4):
            admitted.append(i)
            await release.wait()

    tasks = [asyncio.ensure_future(group(i)) for i in range(3)]
    await until(lambda: len(admitted) == 2 and a.num_waiting == 4, what="two groups in, one waiting")
    assert a.counters() == {"trainer_step": 0, "num_dropped": 0, "max_issued": 8, "num_issued": 8, "num_in_flight": 8,
                            "num_waiting": 4, "num_skipped": 0}
    release.set()
    await until(lambda: a.num_in_flight == 0, what="the first two done")
    assert len(admitted) == 2  # done is not enough: the trainer has not stepped
    await a.advance(1)
    await asyncio.gather(*tasks)
    assert len(admitted) == 3 and a.num_issued == 12 and a.num_waiting == 0


async def test_in_flight_is_bounded_and_a_failed_group_gives_its_allowance_back() -> None:
    a = Admission(batch_size=100, max_off_policy_steps=0, max_in_flight=4)
    release = asyncio.Event()

    async def hold() -> None:
        async with a.slot(4):
            await release.wait()

    first = asyncio.ensure_future(hold())
    second = asyncio.ensure_future(hold())
    await until(lambda: a.num_in_flight == 4 and a.num_waiting == 4, what="one in flight, one waiting")
    release.set()
    await asyncio.gather(first, second)
    with pytest.raises(RuntimeError):
        async with a.slot(4):
            raise RuntimeError("publish failed")
    assert a.num_issued == 8 and a.num_in_flight == 0


async def test_when_the_run_ends_waiting_tasks_are_released_and_new_ones_refused() -> None:
    import asyncio

    import pytest

    from flywheel_inference.admission import Admission, RunEnded

    a = Admission(batch_size=4, max_off_policy_steps=0, max_in_flight=8)
    async with a.slot(4):
        pass
    outcome: list[str] = []

    async def wait_for_room() -> None:
        try:
            async with a.slot(4):
                outcome.append("sampled")
        except RunEnded:
            outcome.append("ended")

    waiting = asyncio.ensure_future(wait_for_room())
    await until(lambda: a.num_waiting == 4, what="the task to wait for room")
    assert a.num_waiting == 4 and not waiting.done()
    await a.end()
    await waiting
    assert outcome == ["ended"] and a.num_skipped == 4 and a.num_waiting == 0
    with pytest.raises(RunEnded):
        async with a.slot(1):
            pass


async def test_rollouts_the_trainer_dropped_give_their_allowance_back() -> None:
    a = Admission(batch_size=8, max_off_policy_steps=1, max_in_flight=64)
    assert a.max_issued == 16
    await a.advance(1, num_dropped=8)  # a whole batch went stale
    assert a.max_issued == (1 + 1 + 1) * 8 + 8
    await a.advance(1, num_dropped=4)  # an older report never takes allowance away
    assert a.num_dropped == 8
