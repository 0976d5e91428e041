"""Throughput of the bus layer against raw nats-py, and of the recorder into SQLite.

    python benchmarks/bus.py --json out/bus.json [--messages 20000] [--rollouts 10000]

One run, one machine, one fresh nats-server: compare the ratios, not the absolute figures
(these machines are shared and noisy). For each payload size it measures

- raw: nats-py JetStream publish (publish_async, all acknowledged) then a durable pull
  consumer that fetches in batches and acks each message;
- bus: the same messages as Flywheel events through ``Bus.publish_many`` and a
  ``Consumer`` (decode, trace context, bounded in-flight, ack);

and reports messages/s for publish-and-consume together. The recorder figure is rollout
events/s from a full ROLLOUTS stream into a fresh SQLite trace store.

Keys: ``raw_msgs_per_s``, ``bus_msgs_per_s``, ``ratio`` (for the 1 KB payload, the
headline), ``by_size`` (every size), ``recorder_events_per_s``.
Targets: ratio at least 0.7; recorder at least 2,000 rollout events/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nats

from flywheel.contract import events
from flywheel.contract.bus import Bus, BusConfig, Consumer, Delivery
from flywheel.ops.natsserver import NatsServer

SIZES = {"1KB": 1024, "64KB": 64 * 1024}


def make_tasks(n: int, size: int, run: str) -> list[events.Task]:
    envelope = len(events.encode(events.Task(id=f"{run}-0", run=run, env="bench", data={"text": ""})))
    filler = "x" * max(0, size - envelope)
    return [events.Task(id=f"{run}-{i}", run=run, env="bench", data={"text": filler}) for i in range(n)]


async def raw_round(url: str, batch: list[events.Task]) -> float:
    """Plain nats-py on the same stream: bytes encoded beforehand, one header, fetch and ack."""
    payloads = [(t.subject(), events.encode(t), t.id) for t in batch]
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.purge_stream("TASKS")
    t0 = time.perf_counter()
    futures = [await js.publish_async(subject, payload, headers={"Nats-Msg-Id": msg_id})
               for subject, payload, msg_id in payloads]
    await asyncio.gather(*futures)
    psub = await js.pull_subscribe("tasks.>", durable=f"raw-{batch[0].run}", stream="TASKS")
    got = 0
    while got < len(payloads):
        for m in await psub.fetch(256, timeout=5):
            await m.ack()
            got += 1
    elapsed = time.perf_counter() - t0
    await nc.close()
    return len(payloads) / elapsed


async def bus_round(url: str, batch: list[events.Task]) -> float:
    """The same through Flywheel: events encoded on the way, decoded, acked by the loop."""
    bus = await Bus.connect(url, "bench", BusConfig())
    await bus.js.purge_stream("TASKS")
    done = asyncio.Event()
    count = 0

    async def handle(d: Delivery) -> None:
        nonlocal count
        count += 1
        if count == len(batch):
            done.set()

    t0 = time.perf_counter()
    await bus.publish_many(batch)
    consumer = Consumer(bus, stream="TASKS", durable=f"bus-{batch[0].run}", handler=handle,
                        event_type=events.Task, max_in_flight=512, batch_size=256)
    task = asyncio.ensure_future(consumer.run())
    await done.wait()
    elapsed = time.perf_counter() - t0
    consumer.stop()
    await task
    await bus.close()
    return len(batch) / elapsed


async def measure_bus(url: str, num_messages: int, rounds: int = 3) -> dict[str, dict[str, float]]:
    await (await Bus.connect(url, "bench-setup")).close()  # the streams both sides use
    by_size: dict[str, dict[str, float]] = {}
    for label, size in SIZES.items():
        n = num_messages if size <= 4096 else max(500, num_messages // 20)
        raws, ours = [], []
        # Alternate the two so drift on a shared machine hits both alike; report medians.
        for r in range(rounds):
            raws.append(await raw_round(url, make_tasks(n, size, run=f"raw{label}{r}")))
            ours.append(await bus_round(url, make_tasks(n, size, run=f"bus{label}{r}")))
        raw, bus = statistics.median(raws), statistics.median(ours)
        by_size[label] = {"messages": n, "payload_bytes": len(events.encode(make_tasks(1, size, "x")[0])),
                          "raw_msgs_per_s": raw, "bus_msgs_per_s": bus, "ratio": bus / raw}
        print(f"{label:>5}: raw {raw:9.0f} msg/s   bus {bus:9.0f} msg/s   ratio {bus / raw:.2f}   "
              f"(median of {rounds} rounds of {n} messages)")
    return by_size


def make_rollout(i: int, run: str) -> events.Rollout:
    """A rollout shaped like a real one: system and question nodes shared by its group of 8,
    an answer with its sampled tokens, a closing user turn."""

    def add(parent: events.Node | None, role: str, content: str, tokens: list[int], version: int | None = None) -> events.Node:
        message = events.Message(role=role, content=content)  # type: ignore[arg-type]
        span = events.TokenSpan(token_ids=tokens, logprobs=[-0.5 if version else 0.0] * len(tokens),
                                loss_mask=[version is not None] * len(tokens), policy_version=version)
        parent_id = parent.id if parent else None
        return events.Node(id=events.node_id(parent_id, message, span), parent_id=parent_id, message=message, tokens=span)

    g = i // 8
    system = add(None, "system", "You solve arithmetic.", list(range(8)))
    user = add(system, "user", f"What is {g} + {g}?", list(range(12)))
    answer = add(user, "assistant", f"Let me think. {g} + {g} = {2 * g}. (sample {i})", list(range(24)), 1)
    done = add(answer, "user", "Thanks.", [5, 6])
    return events.Rollout(run=run, env="math", task_id=f"t{g}", group_id=f"g{g}", index=i % 8,
                          policy_version=1, nodes=[system, user, answer, done])


async def measure_recorder(url: str, data_dir: Path, num_rollouts: int) -> float:
    """Rollout events/s from a ROLLOUTS backlog into a fresh SQLite store, the recorder's
    own consumer running in this process (nats-server and SQLite on the same machine)."""
    import sqlalchemy as sa

    from flywheel_gateway import schema
    from flywheel_gateway.migrate import migrate
    from flywheel_gateway.recorder import RecorderConfig
    from flywheel_gateway.store import Store

    database_url = f"sqlite+aiosqlite:///{data_dir / 'bench.db'}"
    await migrate(database_url)
    store = Store.open(database_url)
    bus = await Bus.connect(url, "bench-recorder")
    await bus.js.purge_stream("ROLLOUTS")
    backlog = [make_rollout(i, "rec") for i in range(num_rollouts)]
    for start in range(0, num_rollouts, 2000):
        await bus.publish_many(backlog[start:start + 2000])
    (consumer,) = RecorderConfig(streams=("ROLLOUTS",)).build(bus, store)
    t0 = time.perf_counter()
    running = asyncio.ensure_future(consumer.run())
    count_rows = sa.select(sa.func.count()).select_from(schema.rollouts)
    while True:
        async with store.engine.connect() as conn:
            if await conn.scalar(count_rows) >= num_rollouts:
                break
        await asyncio.sleep(0.02)
    elapsed = time.perf_counter() - t0
    consumer.stop()
    await running
    await bus.close()
    await store.close()
    rate = num_rollouts / elapsed
    print(f"recorder: {rate:9.0f} rollout events/s into SQLite ({num_rollouts} rollouts of 4 nodes)")
    return rate


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--messages", type=int, default=20000, help="messages per round for the 1 KB payload")
    parser.add_argument("--rollouts", type=int, default=10000, help="rollout events for the recorder figure")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(Path(tmp) / "nats").start()
        try:
            by_size = await measure_bus(server.url, args.messages)
            recorder = await measure_recorder(server.url, Path(tmp), args.rollouts)
        finally:
            server.stop()
    head = by_size["1KB"]
    result = {
        "raw_msgs_per_s": head["raw_msgs_per_s"],
        "bus_msgs_per_s": head["bus_msgs_per_s"],
        "ratio": head["ratio"],
        "by_size": by_size,
        "recorder_events_per_s": recorder,
        "targets": {"ratio": 0.7, "recorder_events_per_s": 2000},
    }
    ok = min(s["ratio"] for s in by_size.values()) >= 0.7 and recorder >= 2000
    print(f"targets {'met' if ok else 'NOT met'}: ratio >= 0.7 at every size, recorder >= 2000 events/s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
