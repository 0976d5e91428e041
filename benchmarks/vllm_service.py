"""Tokens/s of the inference service on the vLLM backend against the bare engine.

    .venv-vllm/bin/python benchmarks/vllm_service.py --json out/vllm_service.json [--tasks 96] [--rounds 3]

Needs vllm (``.venv-vllm``, built by ``scripts/setup-vllm.sh``; ``benchmarks/async_vs_sync.py``
runs this script with that interpreter). One model (tiny, built into a temporary folder),
one engine, one machine; compare the ratio, not the absolute figures:

- engine: :meth:`VLLMBackend.generate` called directly on the groups' prompts, in batches
  of ``inference.max_batch_size`` sequences in task order (as the service's batching loop
  forms them when tasks queue up), one call after another;
- service: a real nats-server (temporary store), the inference :class:`Worker` with its
  :class:`Service` (as ``tests/vllm/test_service.py`` runs it), a run whose config says
  ``inference.backend = "vllm"`` with admission bounds that never block, version-0 weights
  published with ``flywheel.contract.weights.put`` and a ``WeightUpdate``; the same prompts go out
  as tasks (one group of ``--group-size`` rollouts each), timed from the first task
  published to the last rollout seen on ``rollouts.<run>.>`` (a plain subscription: the
  worker's publish reaches it as JetStream stores it in ROLLOUTS; the stream's count is
  checked at the end). Tokens are summed over the rollouts' answers.

Profile figures per service round: ``generate_s`` (time inside the engine's generate
calls) and ``batch_sizes`` (the batches the policy's loop formed); the rest of the
round's time is the service around the engine.

Both sides use the same engine object (the worker's backend builder hands it over), so
the engine settings, the weights (the tiny model's own, loaded again as version 0) and the
prefix cache state are the same; the sampling settings and seeds are the same (task ``i``
is seeded ``1000 * i``, its rollout ``j`` with ``1000 * i + j``). vLLM cannot ignore EOS
through our sampling settings, so both count the tokens actually generated. A warm-up
round on each side is left out; then the timed rounds alternate engine, service, so both
see the same machine state.

Keys: ``engine_tokens_per_s``, ``service_tokens_per_s`` (generated tokens over seconds,
summed over the timed rounds), ``service_vs_engine`` (their ratio),
``service_vs_engine_per_round`` and ``rounds`` (every round's figures). Target: ratio at
least 0.9. Not covered: GPU engines, several runs or replicas sharing one engine, the
environment's own time (``reverse_text`` has no ``step``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ENV = "reverse_text"
RUN = "bench-vllm"
TARGET_RATIO = 0.9


class SharedBackend:
    """The benchmark's engine, handed to the worker: its ``close`` is left to the benchmark."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.batches: list[tuple[int, float]] = []  # (sequences, seconds) of each generate call

    def generate(self, prompts: Any, sampling: Any, seeds: Any = None, on_token: Any = None) -> Any:
        began = time.monotonic()
        out = self._backend.generate(prompts, sampling, seeds, on_token)
        self.batches.append((len(prompts), time.monotonic() - began))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def swap(self, data: bytes, version: int) -> None:
        self._backend.swap(data, version)

    @property
    def version(self) -> int | None:
        return self._backend.version

    @version.setter
    def version(self, value: int | None) -> None:  # settable, as the worker's Backend protocol has it
        self._backend.version = value

    def close(self) -> None:
        pass


def sequences(args: argparse.Namespace, prompts: Sequence[list[int]]) -> list[tuple[list[int], int]]:
    """(prompt ids, seed) of every rollout, in task order."""
    return [(p, 1000 * i + j) for i, p in enumerate(prompts) for j in range(args.group_size)]


async def engine_round(backend: Any, sampling: Any, seqs: list[tuple[list[int], int]], batch: int) -> dict[str, Any]:
    num_tokens = 0
    began = time.monotonic()
    for start in range(0, len(seqs), batch):
        chunk = seqs[start:start + batch]
        completions = await asyncio.to_thread(backend.generate, [p for p, _ in chunk], sampling, [s for _, s in chunk])
        num_tokens += sum(len(c.token_ids) for c in completions)
    elapsed = time.monotonic() - began
    return {"tokens": num_tokens, "seconds": elapsed, "tokens_per_s": num_tokens / elapsed}


async def service_round(bus: Any, shared: SharedBackend, label: str, rows: list[dict[str, Any]],
                        args: argparse.Namespace, sampling: Any) -> dict[str, Any]:
    from flywheel.contract import events
    from flywheel.contract.bus import decode_events, num_events

    expected = len(rows) * args.group_size
    received: list[Any] = []
    done = asyncio.Event()
    last = [0.0]

    async def on_rollout(msg: Any) -> None:
        received.append(msg)
        if sum(num_events(m) for m in received) == expected:  # a group's rollouts come as one message
            last[0] = time.monotonic()
            done.set()

    sub = await bus.nc.subscribe(f"rollouts.{RUN}.>", cb=on_rollout)
    tasks = [events.Task(id=f"{label}-t{i}", run=RUN, env=ENV, data=row, num_rollouts=args.group_size,
                         sampling=_with_seed(sampling, 1000 * i))
             for i, row in enumerate(rows)]
    shared.batches.clear()
    began = time.monotonic()
    await bus.publish_many(tasks)
    await asyncio.wait_for(done.wait(), timeout=args.timeout_s)
    elapsed = last[0] - began
    await sub.unsubscribe()
    decoder = events.Decoder(events.Rollout)
    rollouts = [r for m in received for r in decode_events(decoder, m)]  # a group's rollouts: one message
    num_tokens = 0
    for r in rollouts:
        answer = r.nodes[-1].tokens
        assert answer is not None  # the last node is the sampled answer, which has its tokens
        num_tokens += len(answer.token_ids)
    # Where the time goes: in the engine (the policy's generate calls) or around it.
    return {"tokens": num_tokens, "seconds": elapsed, "tokens_per_s": num_tokens / elapsed,
            "generate_s": sum(t for _, t in shared.batches), "batch_sizes": [n for n, _ in shared.batches]}


def _with_seed(sampling: Any, seed: int) -> Any:
    import msgspec

    return msgspec.structs.replace(sampling, seed=seed)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    from flywheel.contract import events, weights
    from flywheel.contract.bus import Bus, EventCount
    from flywheel.contract.config import RunConfig
    from flywheel.contract.settings import InferenceSettings
    from flywheel.runtime.natsserver import NatsServer
    from flywheel.sdk import models
    from flywheel.sdk.environment import load_environment
    from flywheel_inference.backend_vllm import VLLMBackend
    from flywheel_inference.worker import Worker

    tmp = Path(tempfile.mkdtemp(prefix="flywheel-vllm-service-"))
    model_dir = models.resolve_model("tiny", tmp / "data")
    base, _ = models.load_model(model_dir)
    blob = models.save_weights(base)
    print(f"building the vLLM engine on {model_dir} ...", flush=True)
    backend = await asyncio.to_thread(VLLMBackend, model_dir)
    await asyncio.to_thread(backend.swap, blob, 0)
    env = load_environment(ENV)
    rows = env.load_tasks(args.tasks, seed=0)
    prompts = [models.render_prompt(backend.tokenizer, env.prompt_messages(row)) for row in rows]
    seqs = sequences(args, prompts)
    sampling = events.Sampling(temperature=args.temperature, max_tokens=args.max_tokens)
    total = len(seqs) * (args.rounds + 1)
    cfg = RunConfig.parse({"run": RUN, "env": ENV, "group_size": args.group_size, "model": {"name": str(model_dir)},
                           "sampling": {"max_tokens": args.max_tokens, "temperature": args.temperature},
                           "inference": {"backend": "vllm", "max_batch_size": args.batch_size,
                                         "max_rollouts_in_flight": total},
                           "trainer": {"batch_size": total, "max_off_policy_steps": 1}}, source="benchmark run")

    server = NatsServer(tmp / "nats").start()
    bus = wbus = None
    worker = service = running = None
    results: list[dict[str, Any]] = []
    try:
        bus = await Bus.connect(server.url, name="benchmark")
        await (await bus.runs_kv()).put(RUN, events.encode(events.RunState(id=RUN, config=cfg.model_dump())))
        wbus = await Bus.connect(server.url, name="inference")
        shared = SharedBackend(backend)
        worker = Worker(wbus, lambda _cfg: shared, InferenceSettings())
        service = worker.service(handle_signals=False)
        running = asyncio.ensure_future(service.run())
        uri, sha, size = await weights.put(bus, RUN, 0, blob)
        await bus.publish(events.WeightUpdate(run=RUN, version=0, uri=uri, sha256=sha, size_bytes=size,
                                              trainer_step=0))
        warm_engine = await engine_round(backend, sampling, seqs, args.batch_size)
        warm_service = await service_round(bus, shared, "warm", rows, args, sampling)
        print(f"warm-up: engine {warm_engine['tokens_per_s']:.0f} tok/s, service {warm_service['tokens_per_s']:.0f} "
              f"tok/s (left out)", flush=True)
        for r in range(args.rounds):
            e = await engine_round(backend, sampling, seqs, args.batch_size)
            s = await service_round(bus, shared, f"r{r}", rows, args, sampling)
            results.append({"engine": e, "service": s})
            print(f"round {r}: engine {e['tokens']} tokens in {e['seconds']:.2f}s = {e['tokens_per_s']:.0f} tok/s; "
                  f"service {s['tokens']} tokens in {s['seconds']:.2f}s = {s['tokens_per_s']:.0f} tok/s; "
                  f"ratio {s['tokens_per_s'] / e['tokens_per_s']:.3f}; the service's time in the engine "
                  f"{s['generate_s']:.2f}s over {len(s['batch_sizes'])} batches (engine side "
                  f"{-(-len(seqs) // args.batch_size)})", flush=True)
        stored = await EventCount(bus, "ROLLOUTS", f"rollouts.{RUN}.>").now()
        if stored != len(seqs) * (args.rounds + 1):
            raise RuntimeError(f"{stored} rollouts stored, expected {len(seqs) * (args.rounds + 1)}")
    finally:
        if service is not None:
            service.stop()
            assert running is not None  # started right after the service
            await running
        if worker is not None:
            await worker.close()
        for b in (bus, wbus):
            if b is not None:
                await b.close()
        server.stop()
        await asyncio.to_thread(backend.close)
    def rate(side: str) -> float:
        return sum(r[side]["tokens"] for r in results) / sum(r[side]["seconds"] for r in results)

    engine, svc = rate("engine"), rate("service")
    return {
        "engine_tokens_per_s": engine,
        "service_tokens_per_s": svc,
        "service_vs_engine": svc / engine,
        "service_vs_engine_per_round": [r["service"]["tokens_per_s"] / r["engine"]["tokens_per_s"] for r in results],
        "target": {"service_vs_engine": TARGET_RATIO},
        "setup": {"model": "tiny", "env": ENV, "tasks": args.tasks, "group_size": args.group_size,
                  "max_batch_size": args.batch_size, "max_tokens": args.max_tokens,
                  "temperature": args.temperature, "rounds": args.rounds, "cpus": os.cpu_count()},
        "rounds": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="OUT", help="write the figures here as JSON")
    parser.add_argument("--tasks", type=int, default=96, help="tasks (groups) per round")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per task")
    parser.add_argument("--batch-size", type=int, default=64, help="inference.max_batch_size")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of each (after one warm-up)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="give up on a service round after this")
    args = parser.parse_args()
    started = time.monotonic()
    result = asyncio.run(bench(args))
    result["wall_s"] = time.monotonic() - started
    ok = result["service_vs_engine"] >= TARGET_RATIO
    print(f"engine {result['engine_tokens_per_s']:.0f} tok/s, service {result['service_tokens_per_s']:.0f} tok/s: "
          f"service_vs_engine {result['service_vs_engine']:.3f} (target >= {TARGET_RATIO}: "
          f"{'met' if ok else 'NOT met'})")
    print(f"total {result['wall_s']:.0f}s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
