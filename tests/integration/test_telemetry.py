"""Observability across processes (a real nats-server): Prometheus figures served over HTTP by
a service process, the bus layer's counts, and one trace following a rollout through the scorer.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import sys
from pathlib import Path

import httpx

from flywheel.contract import events, metrics
from flywheel.contract.bus import Bus, Consumer, Delivery, Reject
from flywheel.contract.service import read_heartbeats
from flywheel.contract.settings import ScorerSettings
from flywheel.runtime.natsserver import NatsServer
from flywheel_scorer import scorer
from flywheel_scorer.scorer import EnvironmentRewards
from tests.helpers import until, worker_pool
from tests.unit.test_scorer_rewards import rollout

REPO = Path(__file__).parents[2]


def figure(text: str, name: str, **labels: str) -> float | None:
    """The value of sample ``name{labels}`` in a Prometheus exposition, None when absent."""
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head == (f"{name}{{{wanted}}}" if labels else name):
            return float(value)
    return None


async def test_a_consumers_outcomes_lag_and_publishes_are_served_at_metrics(bus: Bus) -> None:
    async def handle(d: Delivery) -> None:
        if d.event.data.get("bad"):
            raise Reject("a bad task")

    await bus.publish_many([events.Task(id=f"t{i}", run="tel", env="echo", data={"bad": i == 2}) for i in range(3)])
    consumer = Consumer(bus, stream="TASKS", durable="telemetry-test", handler=handle, batch_size=1)
    running = asyncio.ensure_future(consumer.run())
    await until(lambda: consumer.stats.acked + consumer.stats.dead_lettered == 3, what="three tasks finished")
    consumer.stop()
    await running
    port = metrics.serve(0)
    assert port is not None and metrics.serve(0) == port  # once a process
    text = (await httpx.AsyncClient().get(f"http://127.0.0.1:{port}/metrics")).text
    assert figure(text, "flywheel_consumer_messages_total", durable="telemetry-test", outcome="acked") == 2
    assert figure(text, "flywheel_consumer_messages_total", durable="telemetry-test", outcome="dead_lettered") == 1
    assert figure(text, "flywheel_consumer_in_flight", durable="telemetry-test") == 0
    assert figure(text, "flywheel_consumer_pending", durable="telemetry-test") == 0  # the last fetch left none
    assert figure(text, "flywheel_consumer_handle_seconds_count", durable="telemetry-test") == 3
    assert (figure(text, "flywheel_published_events_total", stream="TASKS") or 0) >= 3


async def test_a_service_process_serves_its_figures_on_the_port_its_heartbeat_names(
        bus: Bus, nats_server: NatsServer, tmp_path: Path) -> None:
    log_path = tmp_path / "scorer.log"
    with log_path.open("w") as log:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "flywheel_scorer", cwd=REPO, stdout=log, stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "FLYWHEEL_NATS_URL": nats_server.url, "FLYWHEEL_METRICS_PORT": "0"})
    try:
        async def port() -> int | None:
            assert process.returncode is None, log_path.read_text()
            beats = [b for b in await read_heartbeats(bus) if b.service == "scorer"]
            return beats[0].info.get("metrics_port") if beats else None

        async def announced() -> bool:
            return await port() is not None

        await until(announced, what="the scorer's heartbeat naming its metrics port")
        url = f"http://127.0.0.1:{await port()}/metrics"

        async def every_partition() -> bool:
            text = (await httpx.AsyncClient().get(url)).text
            return figure(text, "flywheel_scorer_partitions", durable="scorer") == events.ROLLOUT_PARTITIONS

        await until(every_partition, what="the one scorer counting every partition as its own")
        await bus.publish(rollout("ro1"))

        async def scored() -> bool:
            text = (await httpx.AsyncClient().get(url)).text
            return (figure(text, "flywheel_reward_seconds_count", reward="exact") == 1
                    and (figure(text, "flywheel_published_events_total", stream="SCORES") or 0) >= 2)

        await until(scored, what="the rollout's rewards timed and its scores counted")
    finally:
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0, log_path.read_text()


async def test_one_trace_follows_a_rollout_from_its_publish_through_its_rewards_to_its_scores(
        nats_server: NatsServer) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    inference = await Bus.connect(nats_server.url, "inference", tracer_provider=provider)
    scoring_bus = await Bus.connect(nats_server.url, "scorer", tracer_provider=provider)
    with provider.get_tracer("test").start_as_current_span("a rollout") as root:
        await inference.publish(rollout("ro1"))
    async with worker_pool("scorer") as workers:
        rewards = EnvironmentRewards()
        await rewards.start(scoring_bus, workers)
        partitions, _ = scorer.build(scoring_bus, rewards, ScorerSettings())
        running = asyncio.ensure_future(partitions.run())
        await until(lambda: partitions.stats.acked == 1, what="the rollout scored")
        partitions.stop()
        await running
    scores = [await inference.js.get_msg("SCORES", seq) for seq in (1, 2)]  # exact, similarity
    await inference.close()
    await scoring_bus.close()
    spans = exporter.get_finished_spans()
    by_name = {s.name: s for s in spans}
    subject = rollout("ro1").subject()
    chain = [by_name["a rollout"], by_name[f"publish {subject}"], by_name[f"process {subject}"],
             by_name["rewards similarity, exact"]]
    assert {s.context.trace_id for s in chain} == {root.get_span_context().trace_id}
    for parent, child in itertools.pairwise(chain):
        assert child.parent is not None and child.parent.span_id == parent.context.span_id, child.name
    # The scores carry the trace on (to the trainer and the recorder): traceparent 00-<trace id>-<span id>-<flags>.
    assert {(m.headers or {})["traceparent"].split("-")[1] for m in scores} == {
        format(root.get_span_context().trace_id, "032x")}
