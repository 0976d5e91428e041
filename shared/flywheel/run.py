"""``flywheel run CONFIG.toml``: the main job, a training run from one command.

What it does, in order:

1. validates the run config (:class:`flywheel.config.RunConfig`) and gives the run a
   fresh id (``<run>-<UTC time>``, or ``--run-id``);
2. uses the services that run (``flywheel up`` in another terminal, or a deployment), or,
   when no NATS answers, brings up the embedded stack itself and stops it at the end;
3. registers the run with its config in the run-state bucket (every service reads it from
   there), starts a trainer for it (``python -m flywheel_trainer --run RUN``; it warms the
   model up with SFT when the config asks, then publishes weights version 0), and publishes
   the environment's tasks; inference admits them as fast as the staleness bound allows;
4. follows the trainer's weight updates (each carries its step's metrics) and prints a line
   a step: reward, staleness, tokens/s, rollouts in flight;
5. at the end prints a summary table and writes ``reward.png`` and ``summary.json`` in the
   run folder (``<data_dir>/runs/<run>``), beside the trainer's ``metrics.jsonl``.

Ctrl-C stops the trainer (and the stack, if this command started it). Not covered:
resuming a stopped run under the same id (start the trainer by hand with ``--run``).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import nats.errors
import nats.js.errors

from flywheel import events
from flywheel.bus import Bus, BusConfig
from flywheel.client import make_tasks
from flywheel.config import RunConfig
from flywheel.environment import Environment, load_for_run
from flywheel.runs import register_run
from flywheel.settings import Settings
from flywheel.stack import SERVICES, ServiceProcess, ServiceSpec, Stack, StackError, child_env, heartbeat_of

RUN_SERVICES = ("inference", "scorer")  # what a training run needs besides the trainer


@dataclass
class Progress:
    """What the run printed so far; the summary and the plot are made from it."""

    started_s: float = field(default_factory=time.monotonic)
    steps: list[dict[str, float]] = field(default_factory=list)

    def add(self, update: events.WeightUpdate) -> dict[str, float] | None:
        if update.trainer_step == 0 or any(s["step"] == update.trainer_step for s in self.steps):
            return None
        row = {"step": float(update.trainer_step), "elapsed_s": time.monotonic() - self.started_s, **update.metrics}
        self.steps.append(row)
        return row


def format_step(row: dict[str, float], num_steps: int, in_flight: int | None) -> str:
    def get(key: str, fmt: str = "{:.3f}") -> str:
        return fmt.format(row[key]) if key in row else "-"

    return (f"step {int(row['step']):>3}/{num_steps}  reward {get('reward_mean')}  "
            f"staleness {get('staleness_mean', '{:.2f}')} (max {get('staleness_max', '{:.0f}')})  "
            f"dropped {get('num_dropped_stale', '{:.0f}')}  tokens/s {get('tokens_per_s', '{:.0f}')}  "
            f"in flight {in_flight if in_flight is not None else '-'}  t {row['elapsed_s']:.0f}s")


def summarize(progress: Progress, cfg: RunConfig, run_dir: Path) -> dict[str, Any]:
    rewards = [s["reward_mean"] for s in progress.steps if "reward_mean" in s]
    k = max(1, len(rewards) // 4)
    first, last = rewards[:k], rewards[-k:]
    return {
        "run": cfg.run,
        "env": cfg.env,
        "model": cfg.model.name,
        "steps": len(progress.steps),
        "elapsed_s": progress.steps[-1]["elapsed_s"] if progress.steps else 0.0,
        "reward_first": sum(first) / len(first) if first else None,
        "reward_last": sum(last) / len(last) if last else None,
        "reward_gain": (sum(last) / len(last) - sum(first) / len(first)) if rewards else None,
        "window_steps": k,
        "num_dropped_stale": sum(s.get("num_dropped_stale", 0.0) for s in progress.steps),
        "staleness_max": max((s.get("staleness_max", 0.0) for s in progress.steps), default=0.0),
        "tokens_per_s_mean": (sum(s.get("tokens_per_s", 0.0) for s in progress.steps) / len(progress.steps)
                              if progress.steps else 0.0),
        "run_dir": str(run_dir),
    }


def format_summary(summary: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    width = max(len(k) for k in summary)
    return "\n".join(f"  {k.ljust(width)}  {fmt(v)}" for k, v in summary.items())


def plot(progress: Progress, path: Path, title: str) -> Path | None:
    """The reward curve as a PNG; None when matplotlib (the ``run`` extra) is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s["step"] for s in progress.steps if "reward_mean" in s]
    rewards = [s["reward_mean"] for s in progress.steps if "reward_mean" in s]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, marker="o", markersize=3)
    ax.set_xlabel("trainer step")
    ax.set_ylabel("mean reward of the step's rollouts")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


async def nats_answers(url: str) -> bool:
    try:
        bus = await Bus.connect(url, "flywheel-run-probe", BusConfig(connect_timeout_s=1.0), ensure=False)
    except ConnectionError:
        return False
    await bus.close()
    return True


class MainJob:
    def __init__(self, cfg: RunConfig, settings: Settings, out: TextIO = sys.stdout,
                 start_timeout_s: float = 300.0) -> None:
        self.cfg = cfg
        self.settings = settings
        self.out = out
        self.start_timeout_s = start_timeout_s
        self.run_dir = settings.data_dir.resolve() / "runs" / cfg.run
        self.stopping = asyncio.Event()
        self.progress = Progress()
        self.rows: list[dict[str, Any]] = []  # the environment's task rows, loaded once
        self.env: Environment | None = None  # loaded as every service loads it (load_for_run)
        self.num_published = 0

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    async def run(self) -> dict[str, Any]:
        stack_task: asyncio.Task[None] | None = None
        stack: Stack | None = None
        url = self.settings.resolved_nats_url
        if not await nats_answers(url):
            self.say(f"no NATS at {url}: starting the embedded stack")
            services = {name: spec for name, spec in SERVICES.items()}
            stack = Stack(self.settings, out=self.out, services=services, start_timeout_s=self.start_timeout_s)
            stack_task = asyncio.ensure_future(stack.run())
            await asyncio.wait([stack_task, asyncio.ensure_future(stack.ready.wait())],
                               return_when=asyncio.FIRST_COMPLETED)
            if stack_task.done():
                await stack_task  # raises StackError with the reason
                raise StackError("the embedded stack stopped before it was ready")
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stopping.set)
        try:
            return await self._train()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            if stack is not None and stack_task is not None:
                stack.stopping.set()
                await stack_task

    async def _train(self) -> dict[str, Any]:
        cfg = self.cfg
        bus = await Bus.connect(self.settings.resolved_nats_url, "flywheel-run")
        trainer: ServiceProcess | None = None
        try:
            # The environment's sampling settings are defaults under the config's own.
            self.env = load_for_run(cfg)
            cfg = self.cfg = cfg.with_env_sampling(self.env)
            await self._check_services(bus)
            _, created = await register_run(bus, cfg.run, cfg.tenant, config=cfg.model_dump())
            if not created:
                raise ValueError(f"run {cfg.run!r} exists already; give another --run-id")
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2) + "\n")
            spec = ServiceSpec(("-m", "flywheel_trainer", "--run", cfg.run), heartbeat_of("trainer"))
            trainer = ServiceProcess("trainer", spec, child_env(self.settings), self.run_dir / "trainer.log")
            await trainer.launch()
            self.say(f"run {cfg.run}: trainer pid {trainer.pid}, log {trainer.log_path}")
            await self._publish_tasks(bus)
            await self._follow(bus, trainer)
        finally:
            if trainer is not None:
                await trainer.stop(15.0)
            await bus.close()
        summary = summarize(self.progress, cfg, self.run_dir)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        png = plot(self.progress, self.run_dir / "reward.png", f"{cfg.run}: {cfg.env}, {cfg.model.name}")
        self.say("summary:\n" + format_summary(summary))
        self.say(f"reward curve: {png}" if png else "reward curve: install the `run` extra (matplotlib) for a PNG")
        return summary

    async def _check_services(self, bus: Bus) -> None:
        from flywheel.service import read_heartbeats

        deadline = time.monotonic() + self.start_timeout_s
        while True:
            live = {b.service for b in await read_heartbeats(bus) if b.status == "ok"}
            missing = [s for s in RUN_SERVICES if s not in live]
            if not missing:
                return
            if time.monotonic() > deadline or self.stopping.is_set():
                raise StackError(f"no live {', '.join(missing)} service on {self.settings.resolved_nats_url}: "
                                 "start them with `flywheel up`, or let `flywheel run` start the stack "
                                 "(it does when no NATS answers)")
            await asyncio.sleep(0.5)

    async def _publish_tasks(self, bus: Bus, num_dropped: int = 0) -> None:
        """Publish tasks up to what the run needs: a group for every step, what the
        staleness bound lets inference run ahead, and one group for each group's worth of
        rollouts the trainer dropped (they are replaced). Called again as drops come in."""
        cfg = self.cfg
        if cfg.num_tasks is not None:
            wanted = cfg.num_tasks
        else:
            wanted = ((cfg.trainer.num_steps + cfg.trainer.max_off_policy_steps + 2) * cfg.groups_per_step
                      + -(-num_dropped // cfg.group_size))
        if wanted <= self.num_published:
            return
        assert self.env is not None
        if len(self.rows) < wanted:
            self.rows = self.env.load_tasks(2 * wanted, seed=cfg.trainer.seed)
        sampling = events.Sampling(temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
                                   max_tokens=cfg.sampling.max_tokens, stop=list(cfg.sampling.stop))
        numbered = list(enumerate(self.rows, 1))[self.num_published:wanted]
        tasks = make_tasks(cfg.run, cfg.env_token(self.env), numbered, num_rollouts=cfg.group_size,
                           sampling=sampling)
        await bus.publish_many(tasks)
        if self.num_published == 0:
            self.say(f"run {cfg.run}: published {len(tasks)} tasks of {cfg.group_size} rollouts each "
                     f"({cfg.env}); {cfg.trainer.num_steps} steps of {cfg.trainer.batch_size} rollouts")
        else:
            self.say(f"run {cfg.run}: published {len(tasks)} more tasks to replace dropped rollouts")
        self.num_published = wanted

    async def _follow(self, bus: Bus, trainer: ServiceProcess) -> None:
        cfg = self.cfg
        decoder = events.Decoder(events.WeightUpdate)
        sub = await bus.js.subscribe(f"weights.{cfg.run}", ordered_consumer=True)
        try:
            while not self.stopping.is_set():
                returncode = trainer.returncode()
                if returncode is not None:
                    raise StackError(f"the trainer exited with code {returncode} before step "
                                     f"{cfg.trainer.num_steps}; {trainer.log_tail()}")
                try:
                    msg = await sub.next_msg(timeout=1.0)
                except (nats.errors.TimeoutError, asyncio.TimeoutError):
                    continue
                update = decoder.decode(msg.data)
                if update.version == 0:
                    self.say(f"run {cfg.run}: weights version 0 published (after {cfg.sft.steps} SFT steps)")
                    self.progress.started_s = time.monotonic()
                row = self.progress.add(update)
                if "num_dropped_total" in update.metrics:
                    await self._publish_tasks(bus, int(update.metrics["num_dropped_total"]))
                if row is not None:
                    self.say(format_step(row, cfg.trainer.num_steps, await self._in_flight(bus)))
                if update.trainer_step >= cfg.trainer.num_steps:
                    return
        finally:
            await sub.unsubscribe()

    async def _in_flight(self, bus: Bus) -> int | None:
        """Rollouts in flight: tasks the inference consumer holds, times the group size."""
        try:
            info = await bus.js.consumer_info("TASKS", "inference")
        except nats.js.errors.NotFoundError:
            return None
        return info.num_ack_pending * self.cfg.group_size


def new_run_id(base: str) -> str:
    return f"{base}-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"


def main_job(config_path: str, settings: Settings, run_id: str | None = None,
             overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = RunConfig.from_toml(config_path)
    data = cfg.model_dump()
    for dotted, value in (overrides or {}).items():
        section = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            section = section[p]
        section[leaf] = value
    data["run"] = run_id or new_run_id(cfg.run)
    cfg = RunConfig.parse(data, source=config_path)
    return asyncio.run(MainJob(cfg, settings).run())

