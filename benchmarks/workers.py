"""What running an environment in its worker costs per rollout, against running it in the host.

    python benchmarks/workers.py --json out/workers.json [--rollouts 4000] [--concurrency 64] [--rounds 3]

One process, the reverse_text environment, a model endpoint that answers at once (a canned
chat completion: the model's own cost is left out, so what is measured is the platform's). Two
ways, alternated round by round so the machine's load lands on both:

- ``in_host``: the environment loaded in this process; each rollout's harness run here
  (:func:`flywheel.sdk.rollout.run_only`), its model call a function call: how rollouts ran
  before environment workers;
- ``worker``: the environment in an environment worker (a bubblewrap sandbox, this machine's
  ``workers`` settings), each rollout asked of it over its channel
  (:meth:`flywheel.runtime.environments.WorkerRollout.run`), its model call coming back to
  this process over the same channel: how inference runs rollouts.

``--concurrency`` rollouts are in flight at once, as inference holds them. Keys, per way (the
median over rounds): ``host_cpu_ms`` (this process's CPU a rollout), ``worker_cpu_ms`` (the
worker's), ``cpu_ms`` (both), ``rollouts_per_s``; and ``cpu_ratio`` (worker over in_host,
``cpu_ms``), the tax isolation adds a rollout.
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

from flywheel.contract.settings import WorkersSettings
from flywheel.runtime.environments import RolloutLink, WorkerPool
from flywheel.runtime.envworker import LoadSpec
from flywheel.sdk.environment import load_environment
from flywheel.sdk.harness import RolloutContext
from flywheel.sdk.rollout import run_only

ENV = "reverse_text"
BASE_URL = "http://model/v1"
ANSWER = json.dumps({"id": "c", "object": "chat.completion", "model": "m", "choices": [
    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "olleh"}}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 4, "total_tokens": 16}}).encode()
TICKS = os.sysconf("SC_CLK_TCK")


async def answer(url: str, body: bytes) -> tuple[int, bytes]:
    return 200, ANSWER


def cpu_s(pid: int) -> float:
    """User and system CPU seconds of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


async def bounded(num: int, concurrency: int, one: Any) -> float:
    """``num`` rollouts, ``concurrency`` at a time; the wall seconds."""
    gate = asyncio.Semaphore(concurrency)

    async def run(i: int) -> None:
        async with gate:
            await one(i)

    started = time.perf_counter()
    await asyncio.gather(*(run(i) for i in range(num)))
    return time.perf_counter() - started


async def in_host(num: int, concurrency: int, tasks: list[dict[str, Any]]) -> dict[str, float]:
    env = load_environment(ENV)

    async def one(i: int) -> None:
        ctx = RolloutContext(task=tasks[i % len(tasks)], base_url=BASE_URL, api_key="k", model="m", index=i,
                             post=answer, rollout_id=f"r{i}", run="bench")
        ran = await run_only(env, ctx, 60.0)
        assert ran.error is None, ran.error

    before = time.process_time()
    wall = await bounded(num, concurrency, one)
    host = time.process_time() - before
    return {"host_cpu_ms": 1000 * host / num, "worker_cpu_ms": 0.0, "cpu_ms": 1000 * host / num,
            "rollouts_per_s": num / wall}


async def in_worker(pool: WorkerPool, num: int, concurrency: int, tasks: list[dict[str, Any]]) -> dict[str, float]:
    env = await pool.load(LoadSpec.of(ENV), "bench")
    await env.load_tasks(1)  # started and loaded before the clock
    (pid,) = [w["pid"] for w in pool.info()]
    worker_pid = inner_python(pid)

    async def one(i: int) -> None:
        rollout = await env.start_rollout(RolloutLink(f"r{i}", "bench", BASE_URL, "k", post=answer))
        ran = await rollout.run(tasks[i % len(tasks)], model="m", index=i, timeout_s=60.0)
        assert ran.error is None, ran.error

    before, worker_before = time.process_time(), cpu_s(worker_pid)
    wall = await bounded(num, concurrency, one)
    host, worker = time.process_time() - before, cpu_s(worker_pid) - worker_before
    return {"host_cpu_ms": 1000 * host / num, "worker_cpu_ms": 1000 * worker / num,
            "cpu_ms": 1000 * (host + worker) / num, "rollouts_per_s": num / wall}


def inner_python(pid: int) -> int:
    """The worker's Python: the process at the bottom of its sandbox's tree (bubblewrap forks)."""
    while True:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if not children:
            return pid
        pid = int(children[0])


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    tasks = [{"text": f"word{i}"} for i in range(64)]  # reverse_text's rows
    rounds: dict[str, list[dict[str, float]]] = {"in_host": [], "worker": []}
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-workers-") as data:
        pool = WorkerPool(WorkersSettings(), Path(data), name="bench")
        try:
            await in_host(200, args.concurrency, tasks)  # warm: imports, caches
            await in_worker(pool, 200, args.concurrency, tasks)
            for n in range(args.rounds):
                order = ["in_host", "worker"] if n % 2 == 0 else ["worker", "in_host"]
                for way in order:
                    got = (await in_host(args.rollouts, args.concurrency, tasks) if way == "in_host" else
                           await in_worker(pool, args.rollouts, args.concurrency, tasks))
                    rounds[way].append(got)
                    print(f"round {n} {way:8s} " + "  ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)
        finally:
            await pool.close()
    out: dict[str, Any] = {way: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                           for way, runs in rounds.items()}
    out["cpu_ratio"] = out["worker"]["cpu_ms"] / out["in_host"]["cpu_ms"]
    out.update(rollouts=args.rollouts, concurrency=args.concurrency, rounds=rounds)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--rollouts", type=int, default=4000, help="rollouts a round and way")
    parser.add_argument("--concurrency", type=int, default=64, help="rollouts in flight at once")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    out = asyncio.run(main_async(args))
    print(json.dumps({k: v for k, v in out.items() if k != "rounds"}, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
