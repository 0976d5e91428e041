"""Who owns a run, against a real nats-server: claims by compare-and-set (of two orchestrators one
wins), leases that run out, release, stop and resume, and the owner's notes."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from flywheel.contract import events
from flywheel.contract.bus import Bus
from flywheel.contract.runs import (
    RunNotFound,
    add_note,
    claim_run,
    claimable,
    get_run,
    new_notes,
    register_run,
    release_run,
    renew_lease,
    resume_run,
    stop_run,
    update_run,
)

CONFIG = {"run": "r", "env": "reverse_text"}


async def test_of_two_orchestrators_one_claims_a_run_and_a_lapsed_lease_lets_another_take_it(bus: Bus) -> None:
    await register_run(bus, "r", config=CONFIG)
    await register_run(bus, "no-config")  # published to straight, by tasks: nobody trains it
    assert not claimable(await get_run(bus, "no-config"))  # type: ignore[arg-type]
    claims = await asyncio.gather(*(claim_run(bus, "r", f"orchestrator {i}", 60.0) for i in range(2)))
    winners = [c for c in claims if c is not None]
    assert len(winners) == 1, claims
    owner = winners[0].owner
    assert owner is not None and not claimable(winners[0])
    assert await claim_run(bus, "r", "orchestrator 9", 60.0) is None  # held
    assert await renew_lease(bus, "r", "orchestrator 9", 60.0) is None  # not the owner's
    renewed = await renew_lease(bus, "r", owner, 60.0)
    assert renewed is not None and renewed.lease_expires_at > winners[0].lease_expires_at  # type: ignore[operator]
    # Its owner died: the lease lapsed; another orchestrator takes the run, the old one cannot renew.
    await update_run(bus, "r", lease_expires_at=events.utc_now() - timedelta(seconds=1))
    taken = await claim_run(bus, "r", "orchestrator 9", 60.0)
    assert taken is not None and taken.owner == "orchestrator 9"
    assert await renew_lease(bus, "r", owner, 60.0) is None
    assert await release_run(bus, "r", owner) is None  # not its own any more: left as it is
    released = await release_run(bus, "r", "orchestrator 9")
    assert released is not None and released.owner is None and claimable(released)


async def test_a_stopped_run_is_not_claimed_until_resumed(bus: Bus) -> None:
    await register_run(bus, "r", config=CONFIG)
    await claim_run(bus, "r", "orchestrator 1", 60.0)
    stopped = await stop_run(bus, "r", "the test")
    assert stopped.status == "stopped" and stopped.reason == "stopped by the test at step 0"
    assert not claimable(stopped) and await claim_run(bus, "r", "orchestrator 2", 60.0) is None
    with pytest.raises(ValueError, match="its owner orchestrator 1 is still stopping it"):
        await resume_run(bus, "r")  # two trainers of one run, the old one checkpointing: refused
    released = await release_run(bus, "r", "orchestrator 1")  # its owner stopped the trainer and let go
    assert released is not None and released.status == "stopped"
    resumed = await resume_run(bus, "r")
    assert (resumed.status, resumed.ended_at, resumed.reason, resumed.owner) == ("created", None, None, None)
    assert claimable(resumed)
    with pytest.raises(ValueError, match="is still created"):
        await resume_run(bus, "r")
    await update_run(bus, "r", status="finished")
    with pytest.raises(ValueError, match="finished already"):
        await resume_run(bus, "r")
    with pytest.raises(RunNotFound, match="'nope' is not in the flywheel-runs"):
        await resume_run(bus, "nope")


async def test_notes_are_kept_bounded_and_read_once(bus: Bus) -> None:
    await register_run(bus, "r", config=CONFIG)
    state = await get_run(bus, "r")
    assert state is not None and new_notes(state, 0) == []
    await add_note(bus, "r", "trainer pid 7")
    state = await get_run(bus, "r")
    assert state is not None and new_notes(state, 0) == ["trainer pid 7"]
    seen = state.num_notes
    for i in range(events.MAX_NOTES + 5):
        await add_note(bus, "r", f"note {i}")
    state = await get_run(bus, "r")
    assert state is not None and state.num_notes == events.MAX_NOTES + 6 and len(state.notes) == events.MAX_NOTES
    # A reader that fell behind gets what is still kept, newest last; one up to date gets nothing.
    assert new_notes(state, seen) == [f"note {i}" for i in range(5, events.MAX_NOTES + 5)]
    assert new_notes(state, state.num_notes - 2) == [f"note {events.MAX_NOTES + 3}", f"note {events.MAX_NOTES + 4}"]
    assert new_notes(state, state.num_notes) == []


async def test_a_paused_run_stays_with_its_owner_and_goes_on_when_resumed(bus: Bus) -> None:
    from flywheel.contract.runs import end_of, pause_run, trainer_started

    await register_run(bus, "r", config=CONFIG)
    await claim_run(bus, "r", "orchestrator 1", 60.0)
    paused = await pause_run(bus, "r", "the test")
    assert paused.status == "paused" and paused.reason == "paused by the test at step 0"
    assert end_of(paused) is None and paused.owner == "orchestrator 1"  # not ended: its owner holds it
    assert (await pause_run(bus, "r", "someone else")).reason == paused.reason  # paused already: as it is
    await trainer_started(bus, "r", trainer_step=0, policy_version=0)  # a trainer starting meanwhile
    assert (await get_run(bus, "r")).status == "paused"  # type: ignore[union-attr]  # registered above
    resumed = await resume_run(bus, "r")
    assert (resumed.status, resumed.reason, resumed.owner) == ("created", None, "orchestrator 1")
    await trainer_started(bus, "r", trainer_step=0, policy_version=0)
    assert (await get_run(bus, "r")).status == "running"  # type: ignore[union-attr]  # registered above
    await stop_run(bus, "r", "the test")
    with pytest.raises(ValueError, match=r"stopped at .*: only a run that goes on can be paused"):
        await pause_run(bus, "r", "the test")
    with pytest.raises(RunNotFound):
        await pause_run(bus, "nope", "the test")
