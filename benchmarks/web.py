"""How fast the gateway's web pages draw with a large run, in headless Chromium.

    python benchmarks/web.py --json out/web.json [--steps 1000] [--rollouts 100000] [--turns 50] [--repeats 3]

One process: a real nats-server, the gateway (SQLite trace store, open API on loopback) served
over HTTP, and Debian's Chromium driven by Playwright (``scripts/setup-browser.sh`` installs
both). The store is filled first, as the recorder fills it: a run of ``--steps`` trainer steps
(each a weight update with its figures, per environment) and ``--rollouts`` rollouts of that run
(a prompt and an answer each), plus one rollout of ``--turns`` tool-calling turns with its
token layer. Then, ``--repeats`` times each, in a fresh browser page:

- ``run_page_ms``: from navigation to ``/runs/RUN`` until its reward curve holds every step
  (the page's script has fetched the metrics and drawn them);
- ``trace_page_ms``: from navigation to ``/rollouts/ID`` until the last message of the long
  rollout's final branch is on the page; ``trace_tokens_ms``: then until its token layer is shown.

Keys: those three (medians; target <= 1000 ms for the first two on this machine), their
``*_all`` lists, ``fill_s`` (seconds to record everything) and the sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from flywheel.contract import events
from flywheel.contract.settings import Settings
from flywheel.runtime.natsserver import NatsServer
from flywheel.runtime.serving import serve
from flywheel_gateway.app import create_app
from flywheel_gateway.store import Store

RUN = "web-bench"
ENVS = ("reverse_text", "arithmetic")
LONG = "long-rollout"
CHROMIUM = "/usr/bin/chromium"
BATCH = 1000


def node(parent: events.Node | None, message: events.Message, tokens: list[int] | None = None,
         sampled: bool = False) -> events.Node:
    span = None
    if tokens is not None:
        span = events.TokenSpan(token_ids=tokens, logprobs=[-0.5 if sampled else 0.0] * len(tokens),
                                loss_mask=[sampled] * len(tokens), policy_version=3 if sampled else None,
                                texts=[f" w{t}" for t in tokens])  # each token's text, as inference records it
    parent_id = parent.id if parent else None
    return events.Node(id=events.node_id(parent_id, message, span), parent_id=parent_id, message=message, tokens=span)


def small_rollout(i: int) -> events.Rollout:
    user = node(None, events.Message(role="user", content=f"Reverse: text number {i}"))
    answer = node(user, events.Message(role="assistant", content=f"{i} rebmun txet"))
    env = ENVS[i % len(ENVS)]
    return events.Rollout(id=f"r{i}", run=RUN, env=env, task_id=f"t{i // 8}", group_id=f"g{i // 8}", index=i % 8,
                          policy_version=i // 100, nodes=[user, answer], status="completed")


def long_rollout(turns: int) -> events.Rollout:
    at = node(None, events.Message(role="system", content="Use the tools."), list(range(1, 8)))
    at = node(at, events.Message(role="user", content="Walk the maze."), list(range(8, 20)))
    nodes = [at]
    for turn in range(turns):
        call = events.ToolCall(id=f"call_{turn}", name="step", arguments=json.dumps({"turn": turn}))
        at = node(at, events.Message(role="assistant", tool_calls=[call]), list(range(100, 130)), sampled=True)
        nodes.append(at)
        at = node(at, events.Message(role="tool", tool_call_id=f"call_{turn}", name="step",
                                     content=f"room {turn}: doors north and east"), list(range(30, 45)))
        nodes.append(at)
    at = node(at, events.Message(role="assistant", content="Out of the maze."), list(range(200, 210)), sampled=True)
    nodes.append(at)
    return events.Rollout(id=LONG, run=RUN, env=ENVS[0], task_id="maze", group_id="maze", index=0, policy_version=3,
                          nodes=nodes, status="completed")


def step(number: int) -> events.WeightUpdate:
    reward = {env: min(1.0, 0.1 + 0.0008 * number * (i + 1)) for i, env in enumerate(ENVS)}
    metrics = {f"env.{env}.reward_mean": value for env, value in reward.items()}
    metrics |= {"reward_mean": sum(reward.values()) / len(reward), "staleness_mean": 0.5, "staleness_max": 1.0,
                "step_s": 1.0}
    return events.WeightUpdate(id=f"{RUN}-{number}", run=RUN, version=number, uri="file:///weights",
                               sha256="0" * 64, size_bytes=1, trainer_step=number, metrics=metrics)


async def fill(app: Any, args: argparse.Namespace) -> float:
    started = time.perf_counter()
    bus, store = app.state.bus, app.state.store
    assert isinstance(store, Store)
    config = {"run": RUN, "envs": [{"id": env} for env in ENVS]}
    state = events.RunState(id=RUN, tenant="default", status="running", config=config)
    await (await bus.runs_kv()).put(RUN, events.encode(state))
    await store.upsert_runs([state])
    for first in range(1, args.steps + 1, BATCH):
        await store.record([step(n) for n in range(first, min(first + BATCH, args.steps + 1))])
    for first in range(0, args.rollouts, BATCH):
        await store.record([small_rollout(i) for i in range(first, min(first + BATCH, args.rollouts))])
        if first and first % (20 * BATCH) == 0:
            print(f"  {first} rollouts recorded ({time.perf_counter() - started:.0f} s)", flush=True)
    await store.record([long_rollout(args.turns)])
    return time.perf_counter() - started


async def measure(url: str, args: argparse.Namespace) -> dict[str, list[float]]:
    from playwright.async_api import async_playwright, expect

    out: dict[str, list[float]] = {"run_page_ms": [], "trace_page_ms": [], "trace_tokens_ms": []}
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            for _ in range(args.repeats):
                page = await (await browser.new_context(base_url=url)).new_page()
                started = time.perf_counter()
                await page.goto(f"/runs/{RUN}")
                await expect(page.locator('#reward-chart polyline[data-series="reward"]')).to_have_attribute(
                    "data-num-points", str(args.steps), timeout=60_000)
                out["run_page_ms"].append((time.perf_counter() - started) * 1000)
                started = time.perf_counter()
                await page.goto(f"/rollouts/{LONG}")
                await expect(page.locator(".branch", has_text="final").locator(".message-node").last).to_contain_text(
                    "Out of the maze.", timeout=60_000)
                out["trace_page_ms"].append((time.perf_counter() - started) * 1000)
                started = time.perf_counter()
                await page.check("#show-tokens")
                await expect(page.locator("body")).to_have_attribute("data-tokens", "shown", timeout=60_000)
                out["trace_tokens_ms"].append((time.perf_counter() - started) * 1000)
                await page.context.close()
        finally:
            await browser.close()
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="flywheel-web-bench-") as scratch:
        nats = NatsServer(Path(scratch) / "nats").start()
        try:
            app = create_app(Settings(nats_url=nats.url, data_dir=Path(scratch) / "data"))
            async with app.router.lifespan_context(app):
                print(f"recording {args.steps} steps, {args.rollouts} rollouts and a {args.turns}-turn rollout ...",
                      flush=True)
                fill_s = await fill(app, args)
                served = await serve(app)
                try:
                    times = await measure(served.url, args)
                finally:
                    await served.stop()
        finally:
            nats.stop()
    result: dict[str, Any] = {"steps": args.steps, "rollouts": args.rollouts, "turns": args.turns,
                              "fill_s": round(fill_s, 1)}
    for key, values in times.items():
        result[key] = round(statistics.median(values), 1)
        result[f"{key}_all"] = [round(v, 1) for v in values]
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rollouts", type=int, default=100_000)
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parsed = parser.parse_args()
    figures = asyncio.run(main(parsed))
    print(json.dumps(figures, indent=2))
    if parsed.json:
        parsed.json.parent.mkdir(parents=True, exist_ok=True)
        parsed.json.write_text(json.dumps(figures, indent=2) + "\n")
