"""Latency the interception endpoint adds over calling the backend directly, same model.

    python benchmarks/interception.py --json out/interception.json [--calls 200]

One process, one fresh nats-server, the tiny model on CPU. The inference app is served by
uvicorn on a loopback port. Each round opens a rollout session and makes a two-turn
conversation through ``/intercept/<key>/v1/chat/completions`` over HTTP (plain httpx, a kept-
alive connection): render and extend the tokens, sample through the run's policy, record the
trace graph, publish its trace nodes to JetStream, answer in OpenAI form. Right after each
call, the same prompt tokens (taken from the session) are sampled directly through the same
policy (``Policy.sample``: the batching queue and ``backend.generate``), with the same seed,
so both paths generate the same tokens. Calls alternate between the two paths so drift on a
shared machine hits both alike.

Keys: ``added_p50_ms`` and ``added_p99_ms`` (interception percentile minus direct
percentile), ``intercept_p50_ms`` / ``intercept_p99_ms``, ``direct_p50_ms`` /
``direct_p99_ms``, ``calls``. Target: ``added_p50_ms`` at most 5.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import uvicorn

from flywheel.contract import events, weights
from flywheel.contract.bus import Bus
from flywheel.contract.config import RunConfig
from flywheel.contract.settings import Settings
from flywheel.runtime.natsserver import NatsServer
from flywheel.sdk import models
from flywheel_inference.app import create_app

RUN = "bench"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(url: str, data_dir: Path, calls: int) -> dict[str, float]:
    model_dir = models.resolve_model("tiny", data_dir)
    bus = await Bus.connect(url, name="bench")
    cfg = RunConfig.parse({"run": RUN, "env": "reverse_text", "model": {"name": str(model_dir)},
                           "sampling": {"max_tokens": 8}})
    await (await bus.runs_kv()).put(RUN, events.encode(events.RunState(id=RUN, config=cfg.model_dump())))
    model, _ = models.load_model(model_dir)
    uri, sha, size = await weights.put(bus, RUN, 0, models.save_weights(model))
    await bus.publish(events.WeightUpdate(run=RUN, version=0, uri=uri, sha256=sha, size_bytes=size))

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(Settings(nats_url=url, data_dir=data_dir), url=f"http://127.0.0.1:{port}")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    serving = asyncio.ensure_future(server.serve())
    while not server.started:  # noqa: ASYNC110 - uvicorn says it has bound only through this flag
        await asyncio.sleep(0.05)
    worker = app.state.worker
    hosted = await worker.hosted(RUN)
    await hosted.policy.wait_ready()
    sampling = msgspec.structs.replace(hosted.sampling, seed=1)  # same seed, same tokens on both paths
    published: list[int] = []

    async def publish(nodes: list[events.TraceNode]) -> None:
        published.append(len(nodes))
        await bus.publish_many(nodes, events.MSGPACK)

    intercept_ms: list[float] = []
    direct_ms: list[float] = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        n = 0
        while n < calls:
            session = worker.interception.open(RUN, f"rollout-{n}", hosted.policy, sampling, publish)
            messages = [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": "abcd"}]
            for turn in range(2):
                t0 = time.perf_counter()
                response = await client.post(f"/intercept/{session.key}/v1/chat/completions",
                                             json={"model": RUN, "messages": messages})
                intercept_ms.append((time.perf_counter() - t0) * 1000)
                response.raise_for_status()
                reply = response.json()["choices"][0]["message"]
                seeded = events.Sampling(temperature=sampling.temperature, top_p=sampling.top_p,
                                         max_tokens=sampling.max_tokens, stop=sampling.stop,
                                         seed=sampling.seed + 7919 * turn)
                t0 = time.perf_counter()
                (direct,) = await hosted.policy.sample([session.prompts[-1]], seeded)
                direct_ms.append((time.perf_counter() - t0) * 1000)
                if direct.completion.text != (reply["content"] or ""):
                    raise AssertionError("the two paths sampled different answers: the comparison would be unfair")
                messages += [reply, {"role": "user", "content": "again"}]
                n += 1
            worker.interception.close(session.key)
    server.should_exit = True
    await serving
    await bus.close()
    result = {
        "calls": len(intercept_ms),
        "intercept_p50_ms": statistics.median(intercept_ms), "intercept_p99_ms": percentile(intercept_ms, 0.99),
        "direct_p50_ms": statistics.median(direct_ms), "direct_p99_ms": percentile(direct_ms, 0.99),
        "trace_nodes_published": sum(published),
    }
    result["added_p50_ms"] = result["intercept_p50_ms"] - result["direct_p50_ms"]
    result["added_p99_ms"] = result["intercept_p99_ms"] - result["direct_p99_ms"]
    return result


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--calls", type=int, default=200, help="calls through each path")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(Path(tmp) / "nats").start()
        try:
            result: dict[str, Any] = await measure(server.url, Path(tmp) / "data", args.calls)
        finally:
            server.stop()
    print(f"interception: p50 {result['intercept_p50_ms']:.2f} ms  p99 {result['intercept_p99_ms']:.2f} ms")
    print(f"direct:       p50 {result['direct_p50_ms']:.2f} ms  p99 {result['direct_p99_ms']:.2f} ms")
    print(f"added:        p50 {result['added_p50_ms']:.2f} ms  p99 {result['added_p99_ms']:.2f} ms "
          f"({result['calls']} calls; target: added p50 <= 5 ms: "
          f"{'met' if result['added_p50_ms'] <= 5 else 'NOT met'})")
    result["targets"] = {"added_p50_ms": 5}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
