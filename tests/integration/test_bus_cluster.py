"""The bus on a three-node JetStream cluster (``flywheel up --cluster 3``'s layout): every stream,
KV bucket and object store kept on each node, and a node's death, its stream leader's included,
loses nothing."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from flywheel.contract import events
from flywheel.contract.bus import Bus, BusConfig, Consumer, Delivery
from flywheel.runtime.natsserver import NatsCluster
from tests.helpers import until


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    nodes = NatsCluster(tmp_path / "nats", 3).start()
    try:
        yield nodes
    finally:
        nodes.stop()


async def all_current(bus: Bus, stream: str) -> bool:
    """Whether every peer of ``stream`` on the cluster is online and caught up."""
    placed = (await bus.retry(lambda: bus.js.stream_info(stream))).cluster
    peers = (placed.replicas or []) if placed is not None else []
    return len(peers) == 2 and all(p.current and not p.offline for p in peers)


def task(i: int) -> events.Task:
    return events.Task(id=f"t{i}", run="r1", env="echo", data={"i": i})


@pytest.mark.long
async def test_every_stream_is_on_each_node_and_a_leaders_death_loses_nothing(cluster: NatsCluster) -> None:
    # Streams and buckets made with one copy are brought to three by a bus asked for three.
    single = await Bus.connect(cluster.url, "single", BusConfig(replicas=1))
    assert (await single.js.stream_info("KV_flywheel-runs")).config.num_replicas == 1
    await single.close()
    producer = await Bus.connect(cluster.url, "producer", BusConfig(replicas=3, publish_timeout_s=60))
    # A service given no replica count and one node's URL keeps the cluster's (it would otherwise
    # bring every stream down to one copy).
    service = await Bus.connect(cluster.nodes[2].url, "service")
    try:
        # A stream brought from one copy to three is replicated in the background: the leader may
        # die only once its peers are current, or nothing holds the stream (that is the bound).
        await until(lambda: all_current(producer, "TASKS"), timeout_s=60, what="TASKS's new replicas to catch up")
        assert service.replicas == 3
        for stream in ("TASKS", "ROLLOUTS", "WEIGHTS", "KV_flywheel-runs", "KV_flywheel-services",
                       "OBJ_flywheel-weights"):
            assert (await producer.js.stream_info(stream)).config.num_replicas == 3, stream

        seen: Counter[str] = Counter()

        async def handle(d: Delivery) -> None:
            seen[d.event.id] += 1

        consumer = Consumer(service, stream="TASKS", durable="c1", handler=handle, max_in_flight=32)
        consuming = asyncio.ensure_future(consumer.run())

        async def produce() -> None:
            for i in range(600):
                await producer.publish(task(i))

        producing = asyncio.ensure_future(produce())
        await until(lambda: len(seen) >= 150, timeout_s=30, what="some tasks consumed before a node dies")
        placed = (await producer.js.stream_info("TASKS")).cluster
        assert placed is not None
        leader = placed.leader
        killed = next(node for node in cluster.nodes if node.server_name == leader)
        assert killed.process is not None
        killed.process.kill()  # SIGKILL: no goodbye to its peers
        await asyncio.wait_for(producing, 90)
        await until(lambda: len(seen) == 600, timeout_s=60, what="every task after the leader's death")
        info = await producer.retry(lambda: producer.js.stream_info("TASKS"))
        assert info.state.messages == 600  # each publish stored once, retries deduplicated
        assert info.cluster is not None and info.cluster.leader != leader

        # Back on its store, the node catches up with what it missed.
        await asyncio.to_thread(killed.start)
        node_bus = await Bus.connect(killed.url, "rejoined", ensure=False)
        try:
            await until(lambda: all_current(node_bus, "TASKS"), timeout_s=30, what="the restarted node to catch up")
        finally:
            await node_bus.close()
        consumer.stop()
        await consuming
    finally:
        await service.close()
        await producer.close()
