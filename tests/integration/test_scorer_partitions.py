"""Scorer replicas split the rollout partitions (a real nats-server): every group reaches one replica.

Two replicas of the built-in scorer, each on its own connection, score an environment with a
group reward (``shortest``, groups of three). A partition has one owner at a time; a replica
that joins takes its share, and the group members the other held in those partitions are
handed back and form their groups whole at the new owner; a replica whose connection dies
stops renewing its leases, and its partitions pass to the other once they lapse. A group split
between replicas would be scored incomplete after ``group_timeout_s``: every group reward here
must come without an error.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from flywheel.contract import events
from flywheel.contract.bus import MAX_DELIVER, PARTITION_LEASE_S, Bus
from flywheel.contract.config import RunConfig
from flywheel.contract.settings import ScorerSettings
from flywheel.runtime.natsserver import NatsServer
from flywheel_scorer import scorer
from flywheel_scorer.partitions import HANDBACK_ALLOWANCE, Partitions
from flywheel_scorer.scorer import EnvironmentRewards
from tests.helpers import until, worker_pool
from tests.integration.test_scorer_bus import put_run, stored
from tests.unit.test_scorer_rewards import group_of

ALL = set(range(events.ROLLOUT_PARTITIONS))


def groups_over_every_partition(prefix: str) -> list[list[events.Rollout]]:
    """One group of three (answers of lengths 3, 2, 1) in each partition."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < events.ROLLOUT_PARTITIONS:
        found.setdefault(events.partition_of(f"{prefix}{i}"), f"{prefix}{i}")
        i += 1
    return [group_of(3, ["cba", "cb", "c"], group=g) for _, g in sorted(found.items())]


@asynccontextmanager
async def replica(url: str, name: str) -> AsyncIterator[tuple[Partitions, scorer.Scorer, Bus]]:
    bus = await Bus.connect(url, name=name)
    async with worker_pool(name) as workers:
        rewards = EnvironmentRewards()
        await rewards.start(bus, workers)
        # A group split between replicas would be scored incomplete after 20 s, well within the test.
        partitions, scoring = scorer.build(bus, rewards, ScorerSettings(group_timeout_s=20.0), replica=name)
        running = asyncio.ensure_future(partitions.run())
        try:
            yield partitions, scoring, bus
        finally:
            partitions.stop()
            await asyncio.gather(running, return_exceptions=True)  # a "dead" replica's fails on its closed bus
            await bus.close()


def owned(*replicas: Partitions) -> list[set[int]]:
    return [set(r.owned) for r in replicas]


async def group_scores(bus: Bus) -> dict[str, events.Score]:
    return {sc.rollout_id: sc for sc in await stored(bus, "SCORES", events.Score) if sc.scorer == "shortest"}


@pytest.mark.long
async def test_replicas_split_the_partitions_hand_over_held_members_and_take_a_dead_ones(
        bus: Bus, nats_server: NatsServer) -> None:
    await put_run(bus, "r1", RunConfig(run="r1", env="reverse_text", rewards={
        "shortest": {"function": "tests.unit.test_scorer_rewards:shortest", "group": True}}).model_dump())
    first, second, third = (groups_over_every_partition(p) for p in ("a", "b", "c"))
    async with replica(nats_server.url, "replica-a") as (a, a_scorer, _):
        await until(lambda: owned(a) == [ALL], what="the one replica owning every partition")
        await bus.publish_many([g[0] for g in first])  # each partition: one member held at a

        await until(lambda: a_scorer.num_held == 8, what="a holding one member of each group")
        async with replica(nats_server.url, "replica-b") as (b, _, b_bus):
            await until(lambda: owned(a, b) == [{0, 2, 4, 6}, {1, 3, 5, 7}], timeout_s=15,
                        what="the partitions split between the two replicas")
            assert a.stats.handed_back == 4  # the members a held in b's partitions went back, for b
            # a hand-back is a delivery on the server: partition consumers allow a few beyond the usual
            assert {c.max_deliver for c in a._consumers} == {MAX_DELIVER + HANDBACK_ALLOWANCE}
            await bus.publish_many([r for g in first for r in g[1:]] + [r for g in second for r in g])

            async def scored(n: int) -> bool:
                return len(await group_scores(bus)) == n

            await until(lambda: scored(6 * 8), timeout_s=30, what="both rounds of groups scored")
            assert b.stats.acked == 2 * 4 * 3 and a.stats.acked == 2 * 4 * 3

            await b_bus.nc.close()  # b's process dies: its leases are no longer renewed
            await until(lambda: owned(a) == [ALL], timeout_s=PARTITION_LEASE_S + 10,
                        what="a taking the dead replica's partitions once their leases lapse")
            await bus.publish_many([r for g in third for r in g])
            await until(lambda: scored(9 * 8), timeout_s=30, what="the third round scored at a")
    scores = await group_scores(bus)
    assert all(sc.error is None for sc in scores.values()), [sc.error for sc in scores.values() if sc.error]
    assert {rid for rid, sc in scores.items() if sc.value == 1.0} == {g[2].id for g in first + second + third}
