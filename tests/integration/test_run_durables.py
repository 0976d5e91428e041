"""A run's durables on a real nats-server: whose each consumer is (by its filter subjects), and
an ended run's durables let go (the server deletes them once no one pulls them), made again
only while their run goes on."""

from __future__ import annotations

import asyncio

from nats.js.api import AckPolicy, ConsumerConfig

from flywheel.contract.bus import Bus, Consumer, Delivery, let_durable_expire
from flywheel.contract.runs import RUN_STREAMS, consumer_row, consumer_run, trainer_durables
from tests.helpers import until


async def test_a_consumer_is_a_runs_when_every_filter_names_that_run(bus: Bus) -> None:
    made = {
        "trainer-team%2Fa-rollouts": ConsumerConfig(filter_subject="rollouts.team/a.>"),
        "teacher-a-t": ConsumerConfig(filter_subjects=["rollouts.a.env1.*", "rollouts.a.env2.*"]),
        "mixed": ConsumerConfig(filter_subjects=["rollouts.a.env1.*", "rollouts.b.env1.*"]),
        "scorer-mine-p3": ConsumerConfig(filter_subject="rollouts.*.env1.3"),
        "every": ConsumerConfig(),
    }
    for name, config in made.items():
        await bus.js.add_consumer("ROLLOUTS", config, durable_name=name, ack_policy=AckPolicy.EXPLICIT)
    rows = {c.name: consumer_row("ROLLOUTS", c) for c in await bus.js.consumers_info("ROLLOUTS")}
    assert {name: row["run"] for name, row in rows.items()} == {
        "trainer-team%2Fa-rollouts": "team/a", "teacher-a-t": "a", "mixed": None, "scorer-mine-p3": None,
        "every": None}
    assert not any(row["pulled"] for row in rows.values())  # nobody pulls them
    assert consumer_run(ConsumerConfig(filter_subject="rollouts.a")) == "a" and "ROLLOUTS" in RUN_STREAMS


async def test_an_ended_runs_durable_goes_once_its_reader_stops_and_is_not_made_again(bus: Bus) -> None:
    durable = trainer_durables("r")["ROLLOUTS"]
    ended = False

    async def handle(delivery: Delivery) -> None:
        return None

    consumer = Consumer(bus, stream="ROLLOUTS", durable=durable, filter_subject="rollouts.r.>", handler=handle,
                        inactive_threshold_s=3600.0, fetch_timeout_s=0.5, recreate_if=lambda: not ended)
    running = asyncio.ensure_future(consumer.run())
    await until(lambda: _exists(bus, durable), what="the durable made")
    ended = True
    assert await let_durable_expire(bus, "ROLLOUTS", durable, 1.0)
    assert (await bus.js.consumer_info("ROLLOUTS", durable)).config.inactive_threshold == 1.0
    consumer.stop()
    await running
    await until(lambda: _gone(bus, durable), timeout_s=15, what="the server to delete the durable")
    assert consumer.stats.recreated == 0
    assert not await let_durable_expire(bus, "ROLLOUTS", durable, 1.0)  # gone already: nothing to do


async def _exists(bus: Bus, durable: str) -> bool:
    return durable in {c.name for c in await bus.js.consumers_info("ROLLOUTS")}


async def _gone(bus: Bus, durable: str) -> bool:
    return not await _exists(bus, durable)
