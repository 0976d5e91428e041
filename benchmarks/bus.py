"""Throughput of the bus layer against raw nats-py, and of the recorder into SQLite.

    python benchmarks/bus.py --json out/bus.json [--messages 20000] [--rounds 5] [--rollouts 10000]

One run, one machine, one fresh nats-server: compare the ratios, not the absolute figures
(these machines are shared and noisy). For each payload size it measures, in alternating
rounds, the same work done two ways, and a floor:

- raw: what any program must do to use these events over nats-py: encode each event,
  JetStream publish with ``Nats-Msg-Id`` (publish_async, all acknowledged), then a durable
  pull consumer that fetches batches of 256, decodes each payload with a typed msgspec
  decoder and acks it;
- bus: the same events through ``Bus.publish_many`` and a ``Consumer`` with the same
  bound on unacknowledged messages (256) and batch size: what the bus layer adds on top
  (Content-Type, bounded waits for lost acks, the subject check, dead-letter and retry
  bookkeeping, in-progress tracking, the Delivery) is what the ratio prices;
- bytes: raw with the payloads encoded before the clock starts and never decoded (what
  moving the bytes alone costs; the bus's ratio to it, ``ratio_vs_bytes``, is reported
  beside the headline, which compares like work with like);

and reports messages/s for publish-and-consume together (timed from the first encode to
the last ack), the median of the rounds, and this process's CPU time per message (less
noisy than wall time where other work shares the cores; nats-server's CPU is not in it).
The recorder figure is rollout events/s from a full ROLLOUTS stream into a fresh SQLite
trace store. The weights figure is a weight blob's trip through the object store, MB/s: put as
the trainer does, then read as inference does (``flywheel.contract.weights.get``, checked), against
a plain ``nats-server`` read of the same object (nats-py's ``ObjectStore.get``, which joins chunks
by copying: quadratic in the blob's size).

Keys: ``raw_msgs_per_s``, ``bus_msgs_per_s``, ``ratio`` (for the 1 KB payload, the
headline), ``by_size`` (every size, with ``*_cpu_us_per_msg``), ``recorder_events_per_s``,
``weights_get_mb_per_s`` and ``weights_get_vs_nats_py`` (at ``--weights-mb``, 128 by default).
Targets: ratio at least 0.85 at 1 KB (larger payloads are dominated by the server and
the socket, and vary more from round to round); recorder at least 2,000 rollout events/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import nats

from flywheel.contract import events, weights
from flywheel.contract.bus import Bus, BusConfig, Consumer, Delivery
from flywheel.runtime.natsserver import NatsServer

SIZES = {"1KB": 1024, "64KB": 64 * 1024}
# Unacknowledged messages at most, and messages per fetch, on both sides.
MAX_UNACKED = 256
TARGET_RATIO = 0.85
TARGET_RECORDER_EVENTS_PER_S = 2000


def make_tasks(n: int, size: int, run: str) -> list[events.Task]:
    envelope = len(events.encode(events.Task(id=f"{run}-0", run=run, env="bench", data={"text": ""})))
    filler = "x" * max(0, size - envelope)
    return [events.Task(id=f"{run}-{i}", run=run, env="bench", data={"text": filler}) for i in range(n)]


async def raw_round(url: str, batch: list[events.Task], codec: bool = True) -> tuple[float, float]:
    """Plain nats-py on the same stream: encode, publish with the dedup header, fetch, decode
    (a typed decoder, as the bus has), ack. Messages/s and this process's CPU us a message.
    ``codec=False``: bytes encoded before the clock starts and never decoded, the floor of
    moving these payloads at all (the ``bytes`` baseline)."""
    decoder = msgspec.json.Decoder(events.Task)
    encoded = None if codec else [events.encode(t) for t in batch]
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.purge_stream("TASKS")
    t0, cpu0 = time.perf_counter(), time.process_time()
    futures = [await js.publish_async(t.subject(), encoded[i] if encoded else events.encode(t),
                                      headers={"Nats-Msg-Id": t.msg_id})
               for i, t in enumerate(batch)]
    await asyncio.gather(*futures)
    psub = await js.pull_subscribe("tasks.>", durable=f"raw-{batch[0].run}", stream="TASKS")
    got = 0
    while got < len(batch):
        for m in await psub.fetch(MAX_UNACKED, timeout=5):
            if codec:
                decoder.decode(m.data)
            await m.ack()
            got += 1
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    await nc.close()
    return len(batch) / elapsed, cpu / len(batch) * 1e6


async def bus_round(url: str, batch: list[events.Task]) -> tuple[float, float]:
    """The same through Flywheel: events encoded on the way, decoded and checked, acked by
    the loop. Messages/s and this process's CPU us a message."""
    bus = await Bus.connect(url, "bench", BusConfig())
    await bus.js.purge_stream("TASKS")
    done = asyncio.Event()
    count = 0

    async def handle(d: Delivery) -> None:
        nonlocal count
        count += 1
        if count == len(batch):
            done.set()

    t0, cpu0 = time.perf_counter(), time.process_time()
    await bus.publish_many(batch)
    consumer = Consumer(bus, stream="TASKS", durable=f"bus-{batch[0].run}", handler=handle,
                        event_type=events.Task, max_in_flight=MAX_UNACKED, batch_size=MAX_UNACKED)
    task = asyncio.ensure_future(consumer.run())
    await done.wait()  # the last handler returned; its ack follows in the same step
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    consumer.stop()
    await task
    await bus.close()
    return len(batch) / elapsed, cpu / len(batch) * 1e6


async def measure_bus(url: str, num_messages: int, rounds: int) -> dict[str, dict[str, Any]]:
    await (await Bus.connect(url, "bench-setup")).close()  # the streams both sides use
    by_size: dict[str, dict[str, Any]] = {}
    for label, size in SIZES.items():
        n = num_messages if size <= 4096 else max(500, num_messages // 20)
        raws, ours, floors = [], [], []
        # Alternate the three so drift on a shared machine hits them alike; report medians.
        for r in range(rounds):
            raws.append(await raw_round(url, make_tasks(n, size, run=f"raw{label}{r}")))
            ours.append(await bus_round(url, make_tasks(n, size, run=f"bus{label}{r}")))
            floors.append(await raw_round(url, make_tasks(n, size, run=f"bytes{label}{r}"), codec=False))
        raw, bus = (statistics.median(rate for rate, _ in rs) for rs in (raws, ours))
        floor = statistics.median(rate for rate, _ in floors)
        raw_cpu, bus_cpu = (statistics.median(cpu for _, cpu in rs) for rs in (raws, ours))
        round_ratios = sorted(b / a for (a, _), (b, _) in zip(raws, ours, strict=True))
        by_size[label] = {"messages": n, "payload_bytes": len(events.encode(make_tasks(1, size, "x")[0])),
                          "raw_msgs_per_s": raw, "bus_msgs_per_s": bus, "ratio": bus / raw,
                          "round_ratios": round_ratios,
                          "bytes_msgs_per_s": floor, "ratio_vs_bytes": bus / floor,
                          "raw_cpu_us_per_msg": raw_cpu, "bus_cpu_us_per_msg": bus_cpu}
        print(f"{label:>5}: raw {raw:9.0f} msg/s   bus {bus:9.0f} msg/s   ratio {bus / raw:.2f}   "
              f"(median of {rounds} rounds of {n} messages; each round's ratio "
              f"{' '.join(f'{x:.2f}' for x in round_ratios)})\n"
              f"       client CPU {raw_cpu:6.1f} us/msg raw, {bus_cpu:6.1f} us/msg bus "
              f"(ratio {raw_cpu / bus_cpu:.2f})\n"
              f"       bytes only (pre-encoded, not decoded) {floor:9.0f} msg/s: bus/bytes {bus / floor:.2f}")
    return by_size


def make_rollout(i: int, run: str) -> events.Rollout:
    """A rollout shaped like a real one: system and question nodes shared by its group of 8,
    an answer with its sampled tokens, a closing user turn."""

    def add(parent: events.Node | None, role: str, content: str, tokens: list[int],
            version: int | None = None) -> events.Node:
        message = events.Message(role=role, content=content)  # type: ignore[arg-type]  # callers pass Message roles
        span = events.TokenSpan(token_ids=tokens, logprobs=[-0.5 if version else 0.0] * len(tokens),
                                loss_mask=[version is not None] * len(tokens), policy_version=version)
        parent_id = parent.id if parent else None
        return events.Node(id=events.node_id(parent_id, message, span), parent_id=parent_id, message=message,
                           tokens=span)

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

    from flywheel.contract.settings import RecorderSettings
    from flywheel_gateway import recorder, schema
    from flywheel_gateway.migrate import migrate
    from flywheel_gateway.store import Store

    database_url = f"sqlite+aiosqlite:///{data_dir / 'bench.db'}"
    await migrate(database_url)
    store = Store.open(database_url)
    bus = await Bus.connect(url, "bench-recorder")
    await bus.js.purge_stream("ROLLOUTS")
    backlog = [make_rollout(i, "rec") for i in range(num_rollouts)]
    for start in range(0, num_rollouts, 2000):
        await bus.publish_many(backlog[start:start + 2000])
    (consumer,) = recorder.build(bus, store, RecorderSettings(), streams=("ROLLOUTS",))
    t0 = time.perf_counter()
    running = asyncio.ensure_future(consumer.run())
    count_rows = sa.select(sa.func.count()).select_from(schema.rollouts)
    while True:
        async with store.engine.connect() as conn:
            if (await conn.scalar(count_rows) or 0) >= num_rollouts:  # a count is never None
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


async def measure_weights(url: str, megabytes: int) -> dict[str, float]:
    """Put a blob of ``megabytes`` as the trainer does; get it back as inference does, and with
    nats-py's own get; MB/s of each (the blob is random, so nothing compresses)."""
    bus = await Bus.connect(url, name="bench-weights")
    blob = os.urandom(megabytes * 2**20)
    started = time.perf_counter()
    uri, sha, size = await weights.put(bus, "bench", 0, blob)
    put_s = time.perf_counter() - started
    update = events.WeightUpdate(run="bench", version=0, uri=uri, sha256=sha, size_bytes=size)
    started = time.perf_counter()
    assert await weights.get(bus, update) == blob
    get_s = time.perf_counter() - started
    store = await bus.weights_store()
    started = time.perf_counter()
    assert (await store.get(uri.split("/", 3)[3])).data == blob
    plain_s = time.perf_counter() - started
    await bus.close()
    figures = {"weights_mb": megabytes, "weights_put_mb_per_s": megabytes / put_s,
               "weights_get_mb_per_s": megabytes / get_s, "nats_py_get_mb_per_s": megabytes / plain_s,
               "weights_get_vs_nats_py": plain_s / get_s}
    print(f"weights: {megabytes} MB put {figures['weights_put_mb_per_s']:.0f} MB/s, get "
          f"{figures['weights_get_mb_per_s']:.0f} MB/s ({figures['weights_get_vs_nats_py']:.1f}x nats-py's get, "
          f"{figures['nats_py_get_mb_per_s']:.1f} MB/s)")
    return figures


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--messages", type=int, default=20000, help="messages per round for the 1 KB payload")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of each side per payload size")
    parser.add_argument("--rollouts", type=int, default=10000, help="rollout events for the recorder figure")
    parser.add_argument("--weights-mb", type=int, default=128, help="size of the weight blob sent through the "
                        "object store")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(Path(tmp) / "nats").start()
        try:
            by_size = await measure_bus(server.url, args.messages, args.rounds)
            recorder = await measure_recorder(server.url, Path(tmp), args.rollouts)
            blob = await measure_weights(server.url, args.weights_mb)
        finally:
            server.stop()
    head = by_size["1KB"]
    result = {
        "raw_msgs_per_s": head["raw_msgs_per_s"],
        "bus_msgs_per_s": head["bus_msgs_per_s"],
        "ratio": head["ratio"],
        "by_size": by_size,
        "recorder_events_per_s": recorder,
        **blob,
        "targets": {"ratio": TARGET_RATIO, "recorder_events_per_s": TARGET_RECORDER_EVENTS_PER_S},
    }
    ok = head["ratio"] >= TARGET_RATIO and recorder >= TARGET_RECORDER_EVENTS_PER_S
    print(f"targets {'met' if ok else 'NOT met'}: ratio >= {TARGET_RATIO} at 1 KB, "
          f"recorder >= {TARGET_RECORDER_EVENTS_PER_S} events/s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
