"""The bus on a three-node JetStream cluster against one node, on this machine.

    python benchmarks/scale.py --json out/scale.json [--messages 20000] [--rounds 5]

Publish and consume rate through Flywheel's bus layer (``benchmarks/bus.py``'s ``bus`` side:
``Bus.publish_many`` then a ``Consumer`` acking every event, 1 KB events) on one nats-server
and on a cluster of three (``NatsCluster``, streams with three replicas, as ``flywheel up
--cluster 3`` runs them), in alternating rounds; the medians and their ratio. A replicated
write is acknowledged once a majority of the nodes stored it, so each publish waits on a
second node; all three nodes share this machine's cores here.

Key: ``cluster_vs_single`` (cluster msgs/s ÷ one node's; target at least 0.5), with
``single_msgs_per_s``, ``cluster_msgs_per_s`` and each round's figures.

Not measured here yet: ``replicas_2_vs_1`` (two inference replicas against one on the async
benchmark's workload, each pinned to a core of its own): the replicas now share one
admission bound (``tests/e2e/test_inference_replicas.py``), but this script does not start
them yet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bus import bus_round, make_tasks  # type: ignore[import-not-found]  # benchmarks/bus.py, on sys.path when run

from flywheel.contract.bus import Bus, BusConfig
from flywheel.ops.natsserver import NatsCluster, NatsServer

TARGET = 0.5
PAYLOAD_BYTES = 1024


async def measure(messages: int, rounds: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        single = NatsServer(Path(tmp) / "single").start()
        cluster = NatsCluster(Path(tmp) / "cluster", 3).start()
        try:
            await (await Bus.connect(single.url, "setup", BusConfig(replicas=1))).close()
            await (await Bus.connect(cluster.url, "setup", BusConfig(replicas=3))).close()
            singles, clustered = [], []
            for r in range(rounds):  # alternated, so drift on a shared machine hits both alike
                # bus.py's bus side: its bus keeps the replicas the streams were made with
                singles.append((await bus_round(single.url, make_tasks(messages, PAYLOAD_BYTES, f"single{r}")))[0])
                clustered.append((await bus_round(cluster.url, make_tasks(messages, PAYLOAD_BYTES, f"cluster{r}")))[0])
                print(f"round {r + 1}: one node {singles[-1]:8.0f} msg/s   three nodes {clustered[-1]:8.0f} msg/s")
        finally:
            cluster.stop()
            single.stop()
    one, three = statistics.median(singles), statistics.median(clustered)
    return {"single_msgs_per_s": one, "cluster_msgs_per_s": three, "cluster_vs_single": three / one,
            "rounds": {"single": singles, "cluster": clustered}, "messages": messages,
            "payload_bytes": PAYLOAD_BYTES, "replicas": 3, "targets": {"cluster_vs_single": TARGET}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--messages", type=int, default=20000, help="1 KB events per round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of each")
    args = parser.parse_args()
    result = asyncio.run(measure(args.messages, args.rounds))
    ratio = result["cluster_vs_single"]
    assert isinstance(ratio, float)
    print(f"cluster_vs_single {ratio:.2f} (median of {args.rounds} rounds; target >= {TARGET}: "
          f"{'met' if ratio >= TARGET else 'NOT met'})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
