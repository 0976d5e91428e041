"""CPU the recorder spends per training rollout: a training run's events recorded into a fresh trace store.

    python benchmarks/recorder.py --json out/recorder.json [--steps 50] [--seed 0] [--database-url URL]

The load is the embedded training run's (``benchmarks/vs_trl.py``: reverse-text, 128
rollouts a step in 8 groups of 16, one chat turn of 16 sampled tokens), written straight
through :meth:`flywheel_gateway.store.Store.record` in the batches the recorder's consumers
hand it, one ``record`` call per batch. Per step, in this order per group: the group's live
trace nodes (``TraceNode``: system, user and assistant per rollout, as inference publishes
them when each model call completes) in batches of 3 to 48, then its 16 rollouts (each
carrying the same 3 nodes) in one batch, then scores (``similarity`` and ``exact`` per
rollout) in batches of 16 to 64 as the scorer catches up; the step's 8 tasks before its
groups and one weight update after them. The run's scorers are registered first
(:meth:`Store.upsert_runs`), as the recorder's run mirror does, so rewards take the path of
a run whose scorers are known. Batch sizes are drawn from ``--seed``.

No NATS: the consumers' side (fetching, decoding, acking) is the bus layer's and is measured
by ``benchmarks/bus.py``; this measures the store alone. CPU is ``time.process_time()`` of
this process, every thread of it (the store's SQLite writes and aiosqlite's reads run on
threads; SQLite runs in process, a PostgreSQL server's CPU is not in it). The first
``--warmup`` steps (default 2) are recorded but not timed; at the end every rollout must
have its reward, or the run fails. The default database is a SQLite file in a temporary
folder; ``--database-url`` takes any store URL (an empty PostgreSQL database, say),
migrated first.

Keys: ``cpu_ms_per_rollout`` (the headline: CPU of every event of a step, over its
rollouts), ``cpu_s_per_step``, ``events_per_s`` (wall clock), ``events_per_step``,
``cpu_ms_by_kind`` (CPU per rollout spent in batches of each event kind), ``steps``,
``rollouts``, ``wall_s``, ``database``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from flywheel.contract import events
from flywheel_gateway import schema
from flywheel_gateway.migrate import migrate
from flywheel_gateway.store import Store

RUN = "bench-run"
ENV = "reverse_text"
GROUPS_PER_STEP = 8
GROUP_SIZE = 16
COMPLETION_TOKENS = 16
SCORERS = {"similarity": 1.0, "exact": 0.0}
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _span(token_ids: list[int], sampled: int = 0, version: int | None = None) -> events.TokenSpan:
    """Tokens of a node: the prompt's with logprob 0 and no loss, the last ``sampled`` sampled."""
    prompt = len(token_ids) - sampled
    return events.TokenSpan(token_ids=token_ids, logprobs=[0.0] * prompt + [-0.7] * sampled,
                            loss_mask=[False] * prompt + [True] * sampled, policy_version=version)


def _node(parent: str | None, message: events.Message, tokens: events.TokenSpan) -> events.Node:
    return events.Node(id=events.node_id(parent, message, tokens), parent_id=parent, message=message, tokens=tokens)


class Load:
    """The events of a training run, step by step, in the batches the recorder sees them."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        system = events.Message(role="system", content="Reverse the text.")
        self.system = _node(None, system, _span(list(range(1, 12))))

    def step(self, step: int) -> list[tuple[str, list[events.Event]]]:
        """(kind, batch) pairs of one step, in recording order."""
        rng = self.rng
        created = T0 + timedelta(seconds=step)
        texts = ["".join(rng.choice("abcdefghijkl") for _ in range(rng.randint(3, 6))) for _ in range(GROUPS_PER_STEP)]
        tasks = [events.Task(id=f"task-{step}-{g}", run=RUN, env=ENV, data={"text": text}, num_rollouts=GROUP_SIZE,
                             sampling=events.Sampling(temperature=1.0, max_tokens=COMPLETION_TOKENS),
                             created_at=created) for g, text in enumerate(texts)]
        out: list[tuple[str, list[events.Event]]] = [("task", list(tasks))]
        pending_scores: list[events.Event] = []
        for task in tasks:
            rollouts = [self._rollout(task, index, step, created) for index in range(GROUP_SIZE)]
            live: list[events.Event] = [events.TraceNode(run=RUN, rollout_id=r.id, node=n, created_at=created)
                                        for r in rollouts for n in r.nodes]
            out += [("trace_node", batch) for batch in _batches(rng, live, 3, 48, multiple=3)]
            out.append(("rollout", list(rollouts)))
            for r in rollouts:
                similarity = rng.random()
                pending_scores += [
                    events.Score(id=f"{r.id}.{name}", run=RUN, env=ENV, rollout_id=r.id, group_id=r.group_id,
                                 scorer=name, value=similarity if name == "similarity" else float(similarity > 0.9),
                                 weight=weight, created_at=created)
                    for name, weight in SCORERS.items()]
            ready = rng.randint(0, len(pending_scores)) // 16 * 16  # the scorer lags behind, by whole rollouts
            out += [("score", batch) for batch in _batches(rng, pending_scores[:ready], 16, 64, multiple=2)]
            del pending_scores[:ready]
        out += [("score", batch) for batch in _batches(rng, pending_scores, 16, 64, multiple=2)]
        out.append(("weight_update", [events.WeightUpdate(
            id=f"weights-{step}", run=RUN, version=step + 1, uri=f"file:///weights/{step + 1}", sha256="0" * 64,
            size_bytes=1_900_000, trainer_step=step + 1, created_at=created,
            metrics={"loss": 0.1, "reward_mean": 0.5, "staleness": 1.0, "tokens_per_s": 10000.0})]))
        return out

    def _rollout(self, task: events.Task, index: int, version: int, created: datetime) -> events.Rollout:
        """A reverse-text rollout as inference builds it: the system and user nodes the group
        shares, then the sampled answer on the assistant's node (generation prompt + completion)."""
        rng = self.rng
        user_message = events.Message(role="user", content=task.data["text"])
        user = _node(self.system.id, user_message, _span([20, *(ord(c) for c in task.data["text"]), 21]))
        answer = "".join(rng.choice("abcdefghijkl ") for _ in range(COMPLETION_TOKENS - 1))
        completion = [ord(c) for c in answer] + [2]
        assistant = _node(user.id, events.Message(role="assistant", content=answer),
                          _span([22, 23, 24, *completion], sampled=len(completion), version=version))
        rid = events.rollout_id(RUN, task.id, index)
        sampling = events.Sampling(temperature=1.0, max_tokens=COMPLETION_TOKENS, seed=index)
        return events.Rollout(
            id=rid, run=RUN, env=ENV, task_id=task.id, group_id=task.id, index=index, policy_version=version,
            task_data=task.data, nodes=[self.system, user, assistant], group_size=GROUP_SIZE, sampling=sampling,
            metrics={"num_calls": 1.0, "num_rerenders": 0.0, "num_completion_tokens": float(len(completion)),
                     "num_prompt_tokens": 21.0, "generation_s": 0.05, "rollout_s": 0.06},
            created_at=created)


def _batches(rng: random.Random, items: Sequence[events.Event], low: int, high: int,
             multiple: int) -> list[list[events.Event]]:
    """``items`` cut into consecutive batches of ``low`` to ``high`` (multiples of ``multiple``)."""
    out, start = [], 0
    while start < len(items):
        size = rng.randint(low // multiple, high // multiple) * multiple
        out.append(list(items[start:start + size]))
        start += size
    return out


async def measure(database_url: str, steps: int, warmup: int, seed: int) -> dict[str, Any]:
    """Record ``warmup`` steps, then ``steps`` timed ones, into the empty store at ``database_url``."""
    await migrate(database_url)
    store = Store.open(database_url)
    load = Load(seed)
    cpu_by_kind: dict[str, float] = defaultdict(float)
    num_events = 0
    try:
        await store.upsert_runs([events.RunState(id=RUN, scorers=SCORERS, created_at=T0)])
        for step in range(warmup):
            for _, batch in load.step(step):
                await store.record(batch)
        plan = [load.step(step) for step in range(warmup, warmup + steps)]  # built before the clock starts
        t0, cpu0 = time.perf_counter(), time.process_time()
        for batches in plan:
            for kind, batch in batches:
                before = time.process_time()
                await store.record(batch)
                cpu_by_kind[kind] += time.process_time() - before
                num_events += len(batch)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
        async with store.engine.connect() as conn:
            rewarded = await conn.scalar(sa.select(sa.func.count()).select_from(schema.rollouts)
                                         .where(schema.rollouts.c.reward.is_not(None)))
            linked = await conn.scalar(sa.select(sa.func.count()).select_from(schema.rollout_nodes))
    finally:
        await store.close()
    rollouts = steps * GROUPS_PER_STEP * GROUP_SIZE
    expected = (warmup + steps) * GROUPS_PER_STEP * GROUP_SIZE
    if (rewarded, linked) != (expected, 3 * expected):
        raise RuntimeError(f"{rewarded} rollouts have a reward and the graphs {linked} nodes, expected {expected} "
                           f"and {3 * expected}: the load was not recorded whole")
    return {
        "cpu_ms_per_rollout": 1000 * cpu / rollouts,
        "cpu_s_per_step": cpu / steps,
        "events_per_s": num_events / wall,
        "events_per_step": num_events / steps,
        "cpu_ms_by_kind": {kind: 1000 * seconds / rollouts for kind, seconds in sorted(cpu_by_kind.items())},
        "steps": steps,
        "rollouts": rollouts,
        "wall_s": wall,
    }


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--steps", type=int, default=50, help="timed training steps of 128 rollouts")
    parser.add_argument("--warmup", type=int, default=2, help="steps recorded before the clock starts")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batch sizes and sampled answers")
    parser.add_argument("--database-url", help="an empty trace store (default: a fresh SQLite file)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = args.database_url or f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}"
        result = await measure(url, args.steps, args.warmup, args.seed)
    result["database"] = sa.make_url(url).get_backend_name()
    by_kind = "  ".join(f"{kind} {ms:.3f}" for kind, ms in result["cpu_ms_by_kind"].items())
    print(f"recorder ({result['database']}): {result['cpu_ms_per_rollout']:.3f} CPU ms per rollout, "
          f"{result['cpu_s_per_step']:.3f} CPU s per step, {result['events_per_s']:.0f} events/s "
          f"({result['steps']} steps of {result['events_per_step']:.0f} events)")
    print(f"  CPU ms per rollout by kind: {by_kind}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
