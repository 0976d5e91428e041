"""``flywheel eval ENV``: an environment's harness against any OpenAI-compatible endpoint.

The same :class:`flywheel.sdk.environment.Environment` that a training run uses runs here
unchanged: its harness gets a per-rollout base URL, exactly as inside the inference service,
only here the URL is a local **recording proxy** (:class:`flywheel.runtime.evalproxy.RecordingProxy`) in front of the
endpoint under evaluation (the local inference service by default, with the run id as the
model; or any OpenAI-compatible server). The proxy forwards ``/chat/completions`` (streaming
included), takes ``/responses`` and ``/messages`` (the OpenAI Responses and Anthropic Messages
APIs, translated by :mod:`flywheel.sdk.wire`) as chat completions upstream, and records each
request's messages and the answer into a :class:`flywheel.sdk.tracegraph.TraceGraph` per
rollout (the message layer; upstream logprobs and usage are kept per call), retrying transient
upstream failures (429, 5xx, connection errors) with backoff before anything reaches the harness.

The run: ``num_tasks`` rows of the task set, ``num_rollouts`` rollouts of each (one group, so
group rewards apply), at most ``concurrency`` rollouts at once. Each rollout runs as in
training (:func:`flywheel.sdk.rollout.run_harness`: the rollout timeout, harness errors,
no model call, state that must be JSON) and each group is scored as the scorer service
scores it (:class:`flywheel.sdk.scoring.Scoring`, when its last rollout ends), so an
environment gives the same statuses, errors and rewards here as in a training run; a
rollout's ``reward`` is :func:`flywheel.sdk.scoring.rollout_reward` over the environment's
rewards. A harness or reward that fails is recorded on that rollout (``error``,
``reward_errors``), never ends the eval. Results go to a JSONL file, one
rollout a line (run, task, messages, state, rewards, usage, error), written group by group,
so ``resume`` goes on with the eval run the file holds and skips every task whose group is
in it already. Task and rollout ids are made as every producer makes them
(:func:`flywheel.contract.events.task_id`, :func:`~flywheel.contract.events.rollout_id`),
from the eval run's id. The summary: reward mean
and standard error (and per reward), pass@k for k in 1..num_rollouts (a rollout passes when
its reward reaches ``pass_threshold``, by default the sum of the reward weights: every
reward at 1.0), each over the rollouts without an error (``num_scored``), the errors by kind
(:func:`flywheel.runtime.evalresults.error_kind`: each with its count and an example), tokens from the upstream's usage.
Any model on the local stack, with no training run: :mod:`flywheel.ops.evalmodel`.

``record`` publishes the rollouts and their scores on the bus under a run of kind ``eval``
(registered in the runs bucket), so the gateway's recorder stores them beside training runs.
The eval run belongs to the tenant of the run it evaluates (``during``'s training run, or the
run a ``model`` of ``RUN`` or ``RUN@STEP`` names on this bus), so its owner sees it; else to
``tenant`` (``default`` unset). A run it evaluates whose state does not decode refuses the
recording (its owner cannot be told), as a ``tenant`` that is not that run's does.
Where NATS answers, harnesses get a sandbox client (``RolloutContext.sandbox_client``) and
rewards reach the sandbox service through it (:mod:`flywheel.sdk.sandbox_tools`).

Not covered: the token layer (an arbitrary endpoint returns no token ids; the interception
endpoint of the inference service records those in training), ``/completions`` (legacy
text completions) through the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import msgspec

from flywheel.contract import events
from flywheel.runtime.environments import RolloutLink, WorkerEnvironment, WorkerError, WorkerPool
from flywheel.runtime.envworker import RewardOutcome
from flywheel.runtime.runs import load_environment
from flywheel.sdk.environment import EnvironmentOverrides, Value, messages_of, subject_name
from flywheel.sdk.rollout import ROLLOUT_TIMEOUT_S, Ran, conclude
from flywheel.sdk.sandbox import SandboxClient
from flywheel.sdk.sandbox_tools import SandboxUnavailable
from flywheel.sdk.sandbox_tools import connect as connect_sandbox
from flywheel.sdk.scoring import REWARD_TIMEOUT_S, required_scorers, rollout_reward, score_event

if TYPE_CHECKING:
    import httpx

    from flywheel.contract.bus import Bus
    from flywheel.contract.settings import Settings

from flywheel.contract.names import is_run_id
from flywheel.runtime.evalproxy import HARNESS_API_KEY, Recording, RecordingProxy, eval_sampling
from flywheel.runtime.evalresults import read_results, scored_fields, summarize
from flywheel.runtime.serving import serve


@dataclass
class EvalConfig:
    env: str  # environment id
    model: str  # the model name sent (a run id for the local inference service)
    base_url: str  # the OpenAI-compatible endpoint, ending in /v1
    out: Path  # results JSONL
    api_key: str | None = None
    num_tasks: int = 8
    num_rollouts: int = 1
    concurrency: int = 8
    resume: bool = False
    pass_threshold: float | None = None
    env_args: dict[str, Any] = field(default_factory=dict)
    harness: str | None = None  # a command line run as the harness (a program harness); None: the environment's own
    runtime: str | None = None  # where a program harness runs (subprocess, sandbox); None: the environment's own
    seed: int = 0
    max_retries: int = 5
    timeout_s: float = 600.0  # one model call
    record: bool = False
    run_id: str | None = None
    rollout_timeout_s: float = ROLLOUT_TIMEOUT_S  # one harness run, as inference's
    reward_timeout_s: float = REWARD_TIMEOUT_S  # one reward, as the scorer's
    sampling: dict[str, Any] = field(default_factory=dict)  # over the environment's own (eval_sampling)
    # False: calls go as the harness sent them, the endpoint's defaults deciding (an API that
    # refuses sampling parameters, as some reasoning models' do); nothing is recorded as sent.
    send_sampling: bool = True
    # An eval during training: {"train_run": RUN, "step": STEP, "eval": NAME}, recorded in the
    # eval run's config, which links it to the training run and the step it evaluated.
    during: dict[str, Any] = field(default_factory=dict)
    # The eval run's tenant (record); None: the evaluated run's, else "default" (see the module).
    tenant: str | None = None
    # These rows instead of num_tasks drawn from the task set (flywheel optimize's minibatches).
    tasks: list[dict[str, Any]] | None = None
    # Every call's system message is this one (put first where a harness sends none): the
    # prompt flywheel optimize tries, whatever the harness. None: as the harness sends it.
    system_prompt: str | None = None
    # The name the endpoint knows the model by, where it is not ``model``: the run the local
    # stack's inference serves a model no training run trained as (flywheel.ops.evalmodel).
    served_as: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_tasks", "num_rollouts", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: at least 1")
        if self.max_retries < 0:
            raise ValueError(f"max_retries={self.max_retries}: not negative")


class ProgressLine:
    """One status line on stderr, redrawn in place on a terminal, every few seconds otherwise."""

    def __init__(self, total: int, out: TextIO = sys.stderr) -> None:
        self.total = total
        self.done = 0
        self.errors = 0
        self.out = out
        self.started_s = time.monotonic()
        self._shown_s = 0.0
        self._tty = out.isatty()

    def add(self, num: int, num_errors: int) -> None:
        self.done += num
        self.errors += num_errors
        now = time.monotonic()
        if self._tty or now - self._shown_s > 5.0 or self.done == self.total:
            self._shown_s = now
            self.show()

    def show(self) -> None:
        width = 30
        filled = width * self.done // max(self.total, 1)
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} rollouts  "
                f"{self.errors} errors  {time.monotonic() - self.started_s:.0f}s")
        self.out.write(("\r" + line) if self._tty else line + "\n")
        if self._tty and self.done == self.total:
            self.out.write("\n")
        self.out.flush()


class Evaluation:
    """One ``flywheel eval``: the environment (in its workers), the proxy, the results file,
    optionally the bus."""

    def __init__(self, cfg: EvalConfig, env: WorkerEnvironment, progress_out: TextIO = sys.stderr) -> None:
        self.cfg = cfg
        self.env = env
        self.env_name = subject_name(cfg.env, env.name)
        self.run_id = cfg.run_id or f"eval-{self.env_name}-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}"
        self.progress_out = progress_out
        self.weights = required_scorers(None, env)  # the reward: every reward of the environment, at its weight
        self.sampling = eval_sampling(env.info, cfg.sampling)  # sent with every call, recorded on every rollout
        self.proxy = RecordingProxy(cfg.base_url, cfg.api_key, max_retries=cfg.max_retries, timeout_s=cfg.timeout_s,
                                    system_prompt=cfg.system_prompt)
        self.bus: Bus | None = None
        self.sandbox: SandboxClient | None = None  # for sandbox tools and rewards, where NATS answers
        self._client: httpx.AsyncClient | None = None  # how the workers' rollouts reach the proxy
        self._sandbox_bus: Bus | None = None
        self._slots = asyncio.Semaphore(cfg.concurrency)
        self._write = asyncio.Lock()

    @property
    def pass_threshold(self) -> float:
        if self.cfg.pass_threshold is not None:
            return self.cfg.pass_threshold
        return sum(w for w in self.weights.values() if w > 0)

    async def run(self, nats_url: str | None = None) -> dict[str, Any]:
        cfg = self.cfg
        rows = cfg.tasks if cfg.tasks is not None else await self.env.load_tasks(cfg.num_tasks, seed=cfg.seed)
        previous = read_results(cfg.out) if cfg.resume else []
        if previous:
            self.run_id = self._resumed_run(previous)
        # Ids as every producer makes them (a task's position is its place in the task set,
        # from 1), so a recorded eval's tasks and rollouts are named as a training run's are.
        tasks = [(events.task_id(self.run_id, self.env_name, i, row), row) for i, row in enumerate(rows, 1)]
        wanted = {tid for tid, _ in tasks}
        counts: dict[str, int] = {}
        for r in previous:
            counts[r["task_id"]] = counts.get(r["task_id"], 0) + 1
        done = {tid for tid, n in counts.items() if n >= cfg.num_rollouts}
        # Keep only complete groups of this task set; a torn group is run again whole.
        kept = [r for r in previous if r["task_id"] in done and r["task_id"] in wanted]
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text("".join(json.dumps(r) + "\n" for r in kept))
        todo = [(tid, row) for tid, row in tasks if tid not in done]
        progress = ProgressLine(len(todo) * cfg.num_rollouts, self.progress_out)
        if cfg.resume:
            print(f"resume: {len(tasks) - len(todo)} of {len(tasks)} tasks done in {cfg.out}", file=self.progress_out)
        if cfg.record:
            await self._open_bus(nats_url)
        await self._open_sandbox(nats_url)
        served = await serve(self.proxy.app())
        self.proxy.url = served.url
        import httpx  # the workers' rollouts reach the proxy through this process

        self._client = httpx.AsyncClient(timeout=None)
        started = time.monotonic()
        try:
            with cfg.out.open("a") as out:
                await asyncio.gather(*(self._group(tid, row, out, progress) for tid, row in todo))
        finally:
            await served.stop()
            await self._client.aclose()
            await self.proxy.close()
            if self.bus is not None:
                await self._close_bus()
            if self._sandbox_bus is not None:
                await self._sandbox_bus.close()
        records = [r for r in read_results(cfg.out) if r["task_id"] in wanted]
        summary = {"env": cfg.env, "model": cfg.model, "served_as": cfg.served_as,
                   "run": self.run_id if cfg.record else None,
                   **summarize(records, self.weights, cfg.num_rollouts, self.pass_threshold),
                   "elapsed_s": time.monotonic() - started, "num_upstream_retries": self.proxy.num_retries,
                   "sampling": msgspec.structs.asdict(self.sampling) if cfg.send_sampling else None,
                   "harness": " ".join(self.env.info.argv) or self.env.info.harness,
                   "runtime": self.env.info.runtime or "process",
                   "results": str(cfg.out)}
        return summary

    def _resumed_run(self, previous: list[dict[str, Any]]) -> str:
        """The eval run the results file holds, which a resume goes on with (its ids derive from
        it); ValueError, before anything is rewritten, for a file of another or of several runs."""
        runs = {r.get("run") for r in previous}
        if None in runs:
            raise ValueError(f"{self.cfg.out} holds results without their eval run's id (written by an older "
                             "version): run this eval again into a new --out, without --resume")
        if len(runs) > 1:
            raise ValueError(f"{self.cfg.out} holds the results of several eval runs "
                             f"({', '.join(sorted(map(str, runs)))}): resume one results file per run")
        (run,) = runs
        if self.cfg.run_id is not None and self.cfg.run_id != run:
            raise ValueError(f"run_id={self.cfg.run_id!r}, but {self.cfg.out} holds the results of eval run "
                             f"{run!r}: resume without --run-id, or write this run to another --out")
        return str(run)

    async def _group(self, tid: str, row: dict[str, Any], out: TextIO, progress: ProgressLine) -> None:
        cfg = self.cfg
        results = await asyncio.gather(*(self._rollout(tid, row, i) for i in range(cfg.num_rollouts)))
        rollouts = [r for r, _ in results]
        scored = await self._scored(rollouts)
        records = []
        for (rollout, recording), scores in zip(results, scored, strict=True):
            records.append({"run": self.run_id, "task_id": tid, "index": rollout.index, "rollout_id": rollout.id,
                            "env": cfg.env, "model": cfg.model, "task": row, "messages": messages_of(rollout),
                            "state": rollout.state, "status": rollout.status, "error": rollout.error,
                            **scored_fields(scores),
                            "usage": recording.tokens(), "calls": recording.calls,
                            "flags": recording.hooks.flags if recording.hooks else {},
                            "sampling": msgspec.structs.asdict(rollout.sampling) if rollout.sampling else None,
                            "reward": rollout_reward(rollout.status, scores, self.weights)})
        async with self._write:
            out.write("".join(json.dumps(r, default=str) + "\n" for r in records))
            out.flush()
        if self.bus is not None:
            await self._publish(rollouts, scored)
        progress.add(len(records), sum(1 for r in records if r["error"] or r["reward_errors"]))

    async def _scored(self, rollouts: list[events.Rollout]) -> list[list[events.Score]]:
        """Every reward of the environment on a group, in its workers, as the scorer scores it: per
        rollout, one Score per reward in the environment's order (a worker that fails gives each an error)."""
        info = self.env.info
        timeout_s = self.cfg.reward_timeout_s
        outcomes: dict[str, list[RewardOutcome]] = {r.id: [] for r in rollouts}
        for run, names in ((self.env.score, info.rollout_rewards), (self.env.score_group, info.group_rewards)):
            try:
                got = await run(rollouts, names, timeout_s, [RolloutLink(r.id, r.run, sandbox=self.sandbox)
                                                             for r in rollouts])
            except WorkerError as exc:
                got = [[RewardOutcome(name=n, error=f"its environment worker failed: {exc}") for n in names]
                       for _ in rollouts]
            for rollout, row in zip(rollouts, got, strict=True):
                outcomes[rollout.id] += row
        order = {r.name: i for i, r in enumerate(info.rewards)}
        return [[score_event(r, o.name, self.weights.get(o.name, 0.0),
                             o.error if o.error is not None else Value(o.value or 0.0, dict(o.components)))
                 for o in sorted(outcomes[r.id], key=lambda o: order[o.name])] for r in rollouts]

    async def _rollout(self, tid: str, row: dict[str, Any], index: int) -> tuple[events.Rollout, Recording]:
        """One rollout, its harness run in the environment's worker as inference runs it (the
        rules of :mod:`flywheel.sdk.rollout`), its calls recorded by the proxy."""
        rid = events.rollout_id(self.run_id, tid, index)
        # As inference seeds a group's rollouts; None: the endpoint's own defaults (send_sampling off).
        sampling = self.sampling.with_seed_offset(index) if self.cfg.send_sampling else None
        async with self._slots:
            link = RolloutLink(rid, self.run_id, base_url=self.proxy.base_url(rid), api_key=HARNESS_API_KEY,
                               http_client=self._client, sandbox=self.sandbox)
            try:
                running = await self.env.start_rollout(link)
            except WorkerError as exc:
                recording = self.proxy.open(rid, sampling)
                ran = Ran(f"environment worker failed: {exc}", {}, False, 0.0)
            else:
                recording = self.proxy.open(rid, sampling, running.hooks if running.hooks else None)
                ran = await running.run(row, model=self.cfg.served_as or self.cfg.model, index=index,
                                        timeout_s=self.cfg.rollout_timeout_s)
            self.proxy.take(rid)  # the rollout is over: calls that still come are not its own
        outcome = conclude(ran, recording, rid, index)
        metrics = {k: float(v) for k, v in recording.tokens().items()} | {"rollout_s": outcome.elapsed_s}
        rollout = events.Rollout(id=rid, run=self.run_id, env=self.env_name, task_id=tid, group_id=tid, index=index,
                                 task_data=row, nodes=recording.graph.ordered(), status=outcome.status,
                                 error=outcome.error, group_size=self.cfg.num_rollouts, state=outcome.state,
                                 metrics=metrics, sampling=sampling)
        return rollout, recording

    # --- recording on the bus -----------------------------------------------------------

    async def _open_bus(self, nats_url: str | None) -> None:
        from flywheel.contract.bus import Bus
        from flywheel.contract.runs import register_run

        if nats_url is None:
            raise ValueError("--record needs NATS: set FLYWHEEL_NATS_URL or start `flywheel up`")
        self.bus = await Bus.connect(nats_url, "flywheel-eval")
        await register_run(self.bus, self.run_id, await self._tenant(), kind="eval", config={
            "eval": {"env": self.cfg.env, "model": self.cfg.model, "served_as": self.cfg.served_as,
                     "base_url": self.cfg.base_url,
                     "num_tasks": self.cfg.num_tasks, "num_rollouts": self.cfg.num_rollouts, **self.cfg.during}},
                           scorers=self.weights)

    async def _tenant(self) -> str:
        """The eval run's tenant: the evaluated run's (the training run ``during`` names, else the
        run the model names, where the bus holds one), else the config's, else ``default``.
        BadRunState when the evaluated run's state does not decode; ValueError for a config's
        tenant that is not the evaluated run's."""
        from flywheel.contract.runs import get_run  # imported here: with the bus, as above

        assert self.bus is not None
        trained = self.cfg.during.get("train_run")
        evaluated = str(trained) if trained else (self.cfg.served_as or self.cfg.model).partition("@")[0]
        state = await get_run(self.bus, evaluated) if is_run_id(evaluated) else None
        if state is None:
            if trained:
                raise ValueError(f"the training run {evaluated!r} this eval is of is not in the runs bucket")
            return self.cfg.tenant or "default"
        if self.cfg.tenant is not None and self.cfg.tenant != state.tenant:
            raise ValueError(f"tenant={self.cfg.tenant!r}, but the run this eval is of ({evaluated!r}) is tenant "
                             f"{state.tenant!r}'s: an eval of a run belongs to the run's tenant")
        return state.tenant

    async def _open_sandbox(self, nats_url: str | None) -> None:
        """The sandbox service's client, over the recording bus or a connection of its own, where
        NATS answers at ``nats_url``; without one a sandbox tool fails its rollout saying what to start."""
        if self.bus is not None:
            self.sandbox = SandboxClient(self.bus)
        elif nats_url is not None:
            with contextlib.suppress(SandboxUnavailable):  # no NATS: environments without a sandbox run as ever
                self._sandbox_bus, self.sandbox = await connect_sandbox(nats_url, timeout_s=1.0)

    async def _publish(self, rollouts: list[events.Rollout], scored: list[list[events.Score]]) -> None:
        assert self.bus is not None
        await self.bus.publish_many(rollouts, events.MSGPACK, together=True)
        await self.bus.publish_many([s for scores in scored for s in scores], together=True)

    async def _close_bus(self) -> None:
        from flywheel.contract.runs import update_run

        assert self.bus is not None
        try:
            await update_run(self.bus, self.run_id, status="finished")
        finally:
            await self.bus.close()


async def resolve_model(base_url: str, api_key: str | None) -> str:
    """The first model an endpoint lists (for ``--model URL``)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30.0) as client:
        try:
            response = await client.get(base_url.rstrip("/") + "/models", headers=headers)
        except httpx.TransportError as exc:
            raise ValueError(f"--model {base_url}: cannot reach it ({exc})") from exc
    if response.status_code != 200 or not response.json().get("data"):
        raise ValueError(f"--model {base_url}: GET /models answered {response.status_code} with no model; name one "
                         f"with --model NAME and --base-url {base_url}")
    return str(response.json()["data"][0]["id"])


# The eval's config (the model as served) and NATS URL (a stack started for it: its login), from its given config.
Serving = Callable[["EvalConfig"], contextlib.AbstractAsyncContextManager[tuple["EvalConfig", str | None]]]


async def run_eval(cfg: EvalConfig, nats_url: str | None = None, progress_out: TextIO = sys.stderr,
                   pool: WorkerPool | None = None, serving: Serving | None = None,
                   settings: Settings | None = None) -> dict[str, Any]:
    """Load the environment in a worker of the eval's tenant (``cfg.tenant``, else ``default``;
    in ``pool``, or a pool of this eval's own, of ``settings``' workers section and data dir
    (default: :meth:`Settings.load`)), run the eval,
    return the summary (also written beside the results). ``serving``: entered once the
    environment loaded and the sampling is checked, it gives the config the eval runs with (the
    model served for it: :mod:`flywheel.ops.evalmodel`) and its NATS URL (instead of
    ``nats_url``), and is left when the eval ends."""
    own = pool is None
    if pool is None:
        from flywheel.contract.settings import Settings

        settings = settings or Settings.load()
        pool = WorkerPool(settings.workers, settings.data_dir, name="eval")
    try:
        overrides = EnvironmentOverrides(args=dict(cfg.env_args), harness=cfg.harness, runtime=cfg.runtime)
        env = await load_environment(pool, cfg.env, overrides, cfg.tenant or "default")
        evaluation = Evaluation(cfg, env, progress_out)
        if serving is None:
            summary = await evaluation.run(nats_url)
        else:
            async with serving(cfg) as (served, served_nats_url):
                evaluation.cfg = served
                summary = await evaluation.run(served_nats_url)
    finally:
        if own:
            await pool.close()
    cfg.out.with_suffix(".summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
