"""Past one process: the bus on a three-node JetStream cluster against one node, and two
inference replicas against one, on this machine.

    python benchmarks/scale.py --json out/scale.json [--messages 20000] [--rounds 5] [--replica-rounds 2]
                               [--replica-off-policy 5 [2 ...]]

Publish and consume rate through Flywheel's bus layer (``benchmarks/bus.py``'s ``bus`` side:
``Bus.publish_many`` then a ``Consumer`` acking every event, 1 KB events) on one nats-server
and on a cluster of three (``NatsCluster``, streams with three replicas, as ``flywheel up
--cluster 3`` runs them), in alternating rounds; the medians and their ratio. A replicated
write is acknowledged once a majority of the nodes stored it, so each publish waits on a
second node; all three nodes share this machine's cores here.

Key: ``cluster_vs_single`` (cluster msgs/s ÷ one node's; target at least 0.5), with
``single_msgs_per_s``, ``cluster_msgs_per_s`` and each round's figures.

Then ``replicas_2_vs_1``: the asynchronous run of ``benchmarks/async_vs_sync.py`` (its
heavy-tailed workload, settings and figures) on a stack with one inference replica and on one
with two, each replica pinned to a core of its own (``sched_setaffinity``: core ``i`` mod
the cores there are), in alternating rounds; each round is a fresh stack and run. The
replicas share the run's admission bound and each has ``max_rollouts_in_flight`` places (32).

The runs' staleness bound (``trainer.max_off_policy_steps``, ``--replica-off-policy``) decides
what the figure measures. A rollout may arrive that many trainer steps after it was sampled;
the environment's turn is heavy-tailed (the slowest of a group's 8 waits: median 0.9 s, one
group in ten past 3.3 s), and two replicas make the steps shorter, so the same number of steps
is fewer seconds and more of the tail is stopped or dropped as stale: at 2 steps, two replicas
dropped 24-27% of their rollouts against one replica's 17-20%, and the ratio was 1.32 to 1.46.
At 5 steps the window covers most of the tail for both (drops 9-10% against 6%) and the ratio
was 1.73 to 1.83. The first setting given is the one ``replicas_2_vs_1`` reports (5 by
default); every setting given is measured, its ratio in ``replicas_2_vs_1_by_off_policy``. Key:
``replicas_2_vs_1`` (one replica's seconds a step ÷ two replicas', medians; target at least
1.7), with each round's figures and the setting. On a machine of two cores the trainer, scorer
and nats-server share the replicas' cores. ``--replica-rounds 0`` skips it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import async_vs_sync  # type: ignore[import-not-found]  # benchmarks/async_vs_sync.py, on sys.path when run
from bus import bus_round, make_tasks  # type: ignore[import-not-found]  # benchmarks/bus.py, on sys.path when run

from flywheel.contract.bus import Bus, BusConfig
from flywheel.runtime.natsserver import NatsCluster, NatsServer

TARGET = 0.5
TARGET_REPLICAS = 1.7
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


def serve_pinned(core: int, port: int) -> None:
    """``scale.py --serve-inference CORE PORT``: an inference replica on one core, as async_vs_sync serves it."""
    os.sched_setaffinity(0, {core % (os.cpu_count() or 1)})
    import flywheel.contract.service

    flywheel.contract.service.HEARTBEAT_INTERVAL_S = async_vs_sync.HEARTBEAT_S
    from flywheel_inference.__main__ import main

    main(["--port", str(port)])


async def replicas_round(num_replicas: int, round_: int, off_policy: int) -> dict[str, Any]:
    """One stack with ``num_replicas`` pinned inference replicas, one async run of async_vs_sync's workload."""
    from flywheel.contract.settings import Settings
    from flywheel.ops.stack import SERVICES, Stack
    from flywheel.runtime.natsserver import free_port
    from flywheel.runtime.supervise import ServiceSpec, heartbeat_of

    bench = argparse.Namespace(steps=16, batch_size=32, group_size=8, slots=32, max_tokens=48, sft_steps=30)
    if str(async_vs_sync.ENVS) not in sys.path:  # its environment: here (the run's tasks) and in the services
        sys.path.insert(0, str(async_vs_sync.ENVS))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(async_vs_sync.ENVS),
                                                               os.environ.get("PYTHONPATH")) if p)
    data_dir = Path(tempfile.mkdtemp(prefix=f"flywheel-scale-{num_replicas}-"))
    settings = Settings(data_dir=data_dir, nats_port=free_port(), gateway_port=free_port(),
                        inference_port=free_port())
    replicas = {f"inference-{i}": ServiceSpec((str(Path(__file__).resolve()), "--serve-inference", str(i),
                                               str(settings.inference_port if i == 0 else free_port())),
                                              heartbeat_of("inference")) for i in range(num_replicas)}
    out = (data_dir / "benchmark.log").open("a")
    stack = Stack(settings, out=out, services={"orchestrator": SERVICES["orchestrator"],
                                               "scorer": SERVICES["scorer"], **replicas})
    stack_task = asyncio.ensure_future(stack.run())
    await asyncio.wait([stack_task, asyncio.ensure_future(stack.ready.wait())], return_when=asyncio.FIRST_COMPLETED)
    if stack_task.done():
        await stack_task
        raise RuntimeError(f"the stack stopped before it was ready; see {data_dir}")
    bus = await Bus.connect(settings.resolved_nats_url, "benchmark-scale")
    try:
        cfg = async_vs_sync.run_config("async", off_policy, bench.batch_size, bench, f"{num_replicas}r{round_}")
        result: dict[str, Any] = await async_vs_sync.one_run(cfg, settings, bus, out)
    finally:
        await bus.close()
        stack.stopping.set()
        await stack_task
        out.close()
    print(f"round {round_ + 1}: {num_replicas} inference replica(s): {result['step_s']:.2f} s/step, "
          f"dropped {result['dropped_fraction']:.0%}, busy {result['inference_busy']:.2f} (of each replica's places)",
          flush=True)
    return result


async def measure_replicas(rounds: int, off_policy: int) -> dict[str, Any]:
    one: list[dict[str, Any]] = []
    two: list[dict[str, Any]] = []
    for r in range(rounds):  # alternated, so drift on a shared machine hits both alike
        one.append(await replicas_round(1, r, off_policy))
        two.append(await replicas_round(2, r, off_policy))
    one_s = statistics.median(x["step_s"] for x in one)
    two_s = statistics.median(x["step_s"] for x in two)
    print(f"max_off_policy_steps {off_policy}: replicas_2_vs_1 {one_s / two_s:.2f} (one replica {one_s:.2f} s/step, "
          f"two {two_s:.2f}; median of {rounds} rounds)", flush=True)
    return {"replicas_2_vs_1": one_s / two_s, "one_replica_step_s": one_s, "two_replicas_step_s": two_s,
            "replica_max_off_policy_steps": off_policy, "replica_rounds": {"one": one, "two": two}}


async def sweep_replicas(rounds: int, settings: list[int]) -> dict[str, Any]:
    """:func:`measure_replicas` at each staleness bound; the first one's figures are the result's own."""
    measured = [await measure_replicas(rounds, off_policy) for off_policy in settings]
    ratios = {str(m["replica_max_off_policy_steps"]): m["replicas_2_vs_1"] for m in measured}
    return {**measured[0], "replicas_2_vs_1_by_off_policy": ratios, "replica_sweep": measured[1:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--messages", type=int, default=20000, help="1 KB events per round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of each")
    parser.add_argument("--replica-rounds", type=int, default=2, help="alternating rounds of one and two inference "
                        "replicas (0: not measured)")
    parser.add_argument("--replica-off-policy", type=int, nargs="+", default=[5], help="trainer.max_off_policy_steps "
                        "of the replica runs, one or more (each measured; the first is the key's)")
    parser.add_argument("--serve-inference", nargs=2, type=int, metavar=("CORE", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_inference:
        serve_pinned(*args.serve_inference)
        return 0
    if min(args.replica_off_policy) < 0:
        parser.error(f"--replica-off-policy {' '.join(map(str, args.replica_off_policy))}: steps from 0 up")
    result = asyncio.run(measure(args.messages, args.rounds))
    ratio = result["cluster_vs_single"]
    assert isinstance(ratio, float)
    print(f"cluster_vs_single {ratio:.2f} (median of {args.rounds} rounds; target >= {TARGET}: "
          f"{'met' if ratio >= TARGET else 'NOT met'})")
    if args.replica_rounds:
        replicas = asyncio.run(sweep_replicas(args.replica_rounds, args.replica_off_policy))
        result.update(replicas)
        result["targets"]["replicas_2_vs_1"] = TARGET_REPLICAS  # type: ignore[index]
        r2 = replicas["replicas_2_vs_1"]
        print(f"replicas_2_vs_1 {r2:.2f} (one replica {replicas['one_replica_step_s']:.2f} s/step, two "
              f"{replicas['two_replicas_step_s']:.2f}; median of {args.replica_rounds} rounds; target >= "
              f"{TARGET_REPLICAS}: {'met' if r2 >= TARGET_REPLICAS else 'NOT met'}; max_off_policy_steps "
              f"{args.replica_off_policy[0]})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
