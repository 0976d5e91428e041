"""The trainer process for one run: its composition root and its loop.

:func:`run` connects to the bus, reads the run's config from the runs KV bucket, opens the
run folder (:mod:`flywheel_trainer.ledger`) and builds a :class:`Trainer`, which is two
durable batch consumers plus one training task under a :class:`flywheel.contract.service.Service`:

- ``trainer-<run>-rollouts`` (``rollouts.<run>.>``) and ``trainer-<run>-scores``
  (``scores.<run>.>``), and in a run with teachers ``trainer-<run>-signals``
  (``signals.<run>.>``: their logprobs of each rollout's tokens), feed the
  :class:`~flywheel_trainer.join.Joiner`. Each batch is
  appended to the journal and fsynced, then acknowledged: received work survives a crash
  without holding acks for the length of a step. A rollout whose token layer can never be
  trained is dead-lettered (:class:`flywheel.contract.bus.Reject`). Once ``max_buffered_rollouts``
  are held, the rollout handler waits (unacknowledged, so NATS keeps the backlog): memory
  does not grow with it. These bounds and the micro-batch size are the process's settings
  (section ``[trainer]``, :class:`flywheel.contract.settings.TrainerSettings`).
- The training task loads the model; on a fresh run it runs the SFT warm-up, writes
  checkpoint 0 and publishes weights version 0; on a restart it loads the latest
  checkpoint and publishes its weights again. Then, step by step: take
  ``trainer.batch_size / group_size`` done groups, train (on the compute thread, so
  heartbeats and acks go on), append the metrics line, checkpoint (every
  ``checkpoint_every`` steps and at the last), put the weights in the object store,
  publish the :class:`~flywheel.contract.events.WeightUpdate` (the step's figures in
  ``metrics``; the rollouts dropped so far in ``num_dropped_total``; those of the groups
  that trained nothing in ``num_unused_total``, which inference's admission and the run's
  task supply act on), update the run state (with ``errors``, the dropped rollouts' errors
  grouped, when a step took a new one; a kind it had not seen is logged once). After
  ``trainer.num_steps`` the run is ``finished`` and the process exits.

Versions: step ``n`` publishes version ``n`` (so ``version == trainer_step``), unless a
crash lost published steps after the last checkpoint (only with ``checkpoint_every > 1``):
the restart then publishes its checkpoint's weights under the next unused version, and
versions stay ahead of steps by that gap, so no version number ever names two different
sets of weights. A WeightUpdate's event id is ``<run>-v<version>-<sha256 prefix>``:
publishing the same weights again (a restart) is deduplicated. A graceful stop (SIGTERM,
SIGINT) checkpoints the last step first, so only a crash ever redoes steps.

On several data-parallel ranks (the setting ``trainer.ranks``, :mod:`flywheel_trainer.ranks`)
this is rank 0; every piece of model work it does (open the engine, a step, the weights, a
checkpoint's engine state, a resume) goes through its :class:`~flywheel_trainer.ranks.Team`, so
each follower (:class:`RankWork`) does the same on its own engine at the same time.

Not covered: several trainer processes for one run (one per run; nothing stops a second
one), training several runs in one process.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors

from flywheel.contract import events, metrics, weights
from flywheel.contract.bus import Bus, Consumer, Delivery, Reject, Undecodable, decode_message
from flywheel.contract.config import RunConfig
from flywheel.contract.heap import freeze_heap
from flywheel.contract.names import path_name
from flywheel.contract.runs import (
    DURABLE_INACTIVE_S,
    ENDED_STATUSES,
    get_run,
    let_run_durables_go,
    pin_version,
    trainer_durables,
    trainer_started,
    update_run,
)
from flywheel.contract.service import Service, compute
from flywheel.contract.settings import Settings, TrainerSettings, WorkersSettings
from flywheel.runtime.environments import WorkerPool
from flywheel.runtime.runs import RunEnvironment, load_run_environments
from flywheel.sdk import models
from flywheel.sdk.scoring import reward_definition
from flywheel_trainer.engines import Engine, build_engine, with_adapter
from flywheel_trainer.join import BadRollout, Joiner, Take, Tokens, add_errors
from flywheel_trainer.learner import (
    Example,
    SFTSupply,
    reference_examples,
    rl_step,
    seed_torch,
    sft_warmup,
    term_references,
    warmup_steps,
)
from flywheel_trainer.ledger import CheckpointState, Journal, RunFolder
from flywheel_trainer.ranks import Ranks, Team, share

log = logging.getLogger(__name__)

WAITING_LOG_S = 30.0  # how often a trainer waiting for data says what it holds


async def run(settings: Settings, run_id: str, handle_signals: bool = True, ranks: Ranks | None = None) -> None:
    """Composition root of ``python -m flywheel_trainer --run RUN``: train until the run is done or a
    signal, within the bounds of the settings' ``trainer`` section. ``ranks``: this process is
    rank 0 of them (None: the only one)."""
    bus = await Bus.for_settings(settings, f"trainer-{run_id}")
    pool = WorkerPool(settings.workers, settings.data_dir, name=f"trainer-{path_name(run_id)}")
    try:
        trainer = await Trainer.open(bus, Path(settings.data_dir), run_id, settings.trainer, ranks or Ranks(), pool,
                                     settings.trusted_modules)
    except BaseException:
        await pool.close()
        await bus.close()
        raise
    service = Service("trainer", bus, info={"run": run_id, "workers": pool.info}, handle_signals=handle_signals)
    for consumer in trainer.consumers():
        service.add(consumer)
    service.add_task(trainer.train)
    try:
        await service.run()
    finally:
        try:
            await compute(trainer.team.stop)
        except RuntimeError as exc:  # a follower died: the launcher stops the rest
            log.warning("run %s: could not stop the other trainer ranks: %s", run_id, exc)
        trainer.close()
        await pool.close()


async def last_published_version(bus: Bus, run: str) -> int | None:
    """The version of the run's last weight update in the WEIGHTS stream (None when there is none).

    The stream, not the run state, says what inference may have loaded: a crash between a
    publish and the run-state update leaves the run state one version behind. A last message
    that is not a weight update of this run (anyone can publish on the subject) is passed
    over: the stream is read from its start for the last one that is.
    """
    decoder: events.Decoder[events.WeightUpdate] = events.Decoder(events.WeightUpdate)
    subject = f"weights.{run}"
    try:
        msg = await bus.js.get_last_msg("WEIGHTS", subject)
    except nats.js.errors.NotFoundError:
        return None
    try:
        return decode_message(decoder, msg).version
    except Undecodable:
        log.warning("run %s: the last message on %s (seq %d) is not a weight update; reading the stream for the "
                    "last one that is", run, subject, msg.seq)
    last: int | None = None
    seq = 1
    while True:
        try:
            msg = await bus.js.get_msg("WEIGHTS", seq, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            return last
        try:
            last = decode_message(decoder, msg).version
        except Undecodable:
            pass
        seq = (msg.seq or seq) + 1


class Trainer:
    """One run's trainer: the join fed by the consumers, and the training task."""

    def __init__(self, bus: Bus, cfg: RunConfig, environments: dict[str, RunEnvironment], data_dir: Path,
                 joiner: Joiner,
                 journal: Journal, resume: tuple[Path, CheckpointState] | None, published_version: int,
                 options: TrainerSettings, tenant: str = "", ranks: Ranks | None = None) -> None:
        self.bus = bus
        self.tenant = tenant  # the run's owner, who pays for its training (metering)
        self.cfg = cfg
        self.data_dir = data_dir
        self.folder = RunFolder(data_dir, cfg.run, cfg.trainer.keep_checkpoints)
        self.environments = environments  # by name in subjects
        self.joiner = joiner
        self.journal = journal
        self.resume = resume
        self.published_version = published_version
        self.letting_go = False  # the run ended: its durables go, and are not made again here
        self.options = options
        self._held: set[int] | None = None  # the versions in the weights bucket, once listed (_drop_old_weights)
        self.arrived = asyncio.Event()  # the joiner took something in: maybe a step can start
        self.room = asyncio.Event()  # a step took groups out: maybe the rollout consumer can go on
        self.trained: dict[int, list[str]] = dict(resume[1].trained) if resume else {}
        self.dropped: dict[str, str] = dict(resume[1].dropped) if resume else {}
        self.num_unused = resume[1].num_unused if resume else 0
        self.errors: list[events.ErrorGroup] = list(resume[1].errors) if resume else []
        self.step = resume[1].step if resume else 0
        self.version = resume[1].version if resume else 0
        self.checkpointed_step = self.step if resume else -1
        self.sft_supply: SFTSupply | None = None  # the run's SFT term, built with the model (_start)
        self._warmup_examples: list[Example] = []  # the warm-up's reference answers (_start)
        # The model work, done on every rank at once (rank 0 alone warms up).
        self.work = RankWork(options, self._warmup_steps)
        self.team = Team(ranks or Ranks(), self.work.calls())

    @classmethod
    async def open(cls, bus: Bus, data_dir: Path, run_id: str, options: TrainerSettings,
                   ranks: Ranks | None = None, pool: WorkerPool | None = None,
                   trusted_modules: Sequence[str] = ()) -> Trainer:
        """Read the run's config and state (its parts by path only from ``trusted_modules``, the
        setting), then what the run folder holds (checkpoint, journal); its environments load in
        ``pool``'s workers (None: a pool of default settings)."""
        state = await get_run(bus, run_id)
        if state is None:
            raise ValueError(f"run {run_id!r} is not in the runs KV bucket; "
                             "`flywheel run` registers it with its config")
        if not state.config:
            raise ValueError(f"run {run_id!r} has no config (RunState.config is empty); `flywheel run` writes it")
        cfg = RunConfig.parse(state.config, source=f"run {run_id!r} config", trusted_modules=trusted_modules)
        if cfg.run != run_id:
            raise ValueError(f"run {run_id!r}: its stored config says run={cfg.run!r}; they must be the same")
        pool = pool or WorkerPool(WorkersSettings(), data_dir, name=f"trainer-{path_name(run_id)}")
        environments = await load_run_environments(pool, cfg, state.tenant)
        min_buffer = cfg.trainer.batch_size + cfg.inference.max_rollouts_in_flight
        if options.max_buffered_rollouts < min_buffer:
            raise ValueError(f"setting trainer.max_buffered_rollouts={options.max_buffered_rollouts} is below "
                             f"the run's trainer.batch_size plus inference.max_rollouts_in_flight ({min_buffer}): "
                             "groups could never complete; raise the setting (FLYWHEEL_TRAINER__MAX_BUFFERED_ROLLOUTS) "
                             "or lower the run's")
        folder = RunFolder(data_dir, run_id, cfg.trainer.keep_checkpoints)
        resume = folder.checkpoints.latest()
        published = await last_published_version(bus, run_id)
        published = max(published, state.policy_version) if published is not None else None
        if resume is None and (published is not None or state.trainer_step > 0):
            raise ValueError(f"run {run_id!r} has published weights (version {published}, trainer step "
                             f"{state.trainer_step}), but {folder.checkpoints.folder} holds no checkpoint: restore "
                             "that folder (FLYWHEEL_DATA_DIR) or start a new run")
        scorers, env_scorers = reward_definition(cfg, environments)
        signals, env_signals = signal_definition(cfg, environments)
        joiner = Joiner(scorers, cfg.trainer.max_off_policy_steps, env_scorers=env_scorers,
                        signals=signals, env_signals=env_signals,
                        version=resume[1].version if resume else 0,
                        consumed=resume[1].consumed_ids() if resume else ())
        journal = Journal(folder.journal_path)
        replayed = journal.replay()
        for entry in replayed:
            if isinstance(entry, events.Rollout):
                joiner.add_rollout(entry)
            elif isinstance(entry, events.Signal):
                joiner.add_signal(entry)
            else:
                joiner.add_score(entry)
        journal.rewrite(joiner.buffered_events())
        if resume is not None:
            folder.metrics.keep_until(resume[1].step)
            log.info("run %s: resuming from %s (step %d, version %d); %d journal entries replayed, %d rollouts "
                     "buffered", run_id, resume[0], resume[1].step, resume[1].version, len(replayed),
                     joiner.num_buffered)
        return cls(bus, cfg, environments, data_dir, joiner, journal, resume, published or 0, options,
                   tenant=state.tenant, ranks=ranks)

    def close(self) -> None:
        self.journal.close()

    # --- consuming ----------------------------------------------------------------------

    def consumers(self) -> list[Consumer]:
        run, o, durables = self.cfg.run, self.options, trainer_durables(self.cfg.run)
        # An ended run's consumers go LET_GO_S after its trainer stops pulling (an hour, where it
        # died first); a trainer restarted later starts them again from the stream's start and
        # skips what its checkpoint says it consumed.
        common: dict[str, Any] = dict(batch_size=o.consumer_batch_size, max_in_flight=o.consumer_max_in_flight,
                                      ack_wait_s=o.ack_wait_s, grace_s=2.0, inactive_threshold_s=DURABLE_INACTIVE_S,
                                      recreate_if=lambda: not self.letting_go)
        consumers = [
            Consumer(self.bus, stream="ROLLOUTS", durable=durables["ROLLOUTS"],
                     filter_subject=f"rollouts.{run}.>", batch_handler=self.on_rollouts, event_type=events.Rollout,
                     **common),
            Consumer(self.bus, stream="SCORES", durable=durables["SCORES"],
                     filter_subject=f"scores.{run}.>", batch_handler=self.on_scores, event_type=events.Score, **common),
        ]
        if self.cfg.teachers:
            consumers.append(Consumer(self.bus, stream="SIGNALS", durable=durables["SIGNALS"],
                                      filter_subject=f"signals.{run}.>", batch_handler=self.on_signals,
                                      event_type=events.Signal, **common))
        return consumers

    async def on_rollouts(self, deliveries: list[Delivery]) -> None:
        while self.joiner.num_buffered >= self.options.max_buffered_rollouts:
            self.room.clear()
            await self.room.wait()
        rollouts: list[events.Rollout] = [d.event for d in deliveries]
        try:
            checked = [self.joiner.check(r) for r in rollouts]
        except BadRollout as exc:
            raise Reject(str(exc)) from exc  # the bus retries the batch one by one: only this one is rejected
        self.journal.append([r for r, sequences in zip(rollouts, checked, strict=True)
                             if self.joiner.add_rollout(r, sequences)])
        self.arrived.set()

    async def on_scores(self, deliveries: list[Delivery]) -> None:
        self.journal.append([d.event for d in deliveries if self.joiner.add_score(d.event)])
        self.arrived.set()

    async def on_signals(self, deliveries: list[Delivery]) -> None:
        self.journal.append([d.event for d in deliveries if self.joiner.add_signal(d.event)])
        self.arrived.set()

    # --- training -----------------------------------------------------------------------

    async def train(self, stopping: asyncio.Event) -> None:
        # A crash does not mark the run failed: the run's owner (its orchestrator) restarts the
        # trainer, which resumes from its checkpoint, and marks the run failed only when
        # restarts stop helping.
        await self._train(stopping)

    async def _train(self, stopping: asyncio.Event) -> None:
        engine, pad_id = await self._start()
        while self.step < self.cfg.trainer.num_steps:
            waited = time.perf_counter()
            take = await self._next_take(stopping)
            if take is None:  # stopping: what is buffered stays in the journal
                if self.checkpointed_step < self.step:
                    await self._checkpoint(engine, await compute(self.team.call, "weights"))  # nothing redone
                state = await get_run(self.bus, self.cfg.run)
                if state is not None and state.status in ENDED_STATUSES:  # stopped: not to be read again here
                    await self._let_go()
                return
            await self._step(engine, pad_id, take, wait_s=time.perf_counter() - waited)
        await update_run(self.bus, self.cfg.run, status="finished", ended_at=events.utc_now())
        log.info("run %s: finished after %d steps", self.cfg.run, self.step)
        await self._let_go()

    async def _let_go(self) -> None:
        """The run ended: its durables go once this process stops pulling them (a resumed run's
        trainer makes them again and skips what its checkpoint consumed)."""
        self.letting_go = True
        await let_run_durables_go(self.bus, self.cfg.run, trainer_durables(self.cfg.run).items(), "its trainer's")

    def _warmup_steps(self, model: Any, tok: Any) -> list[list[Tokens]]:
        return warmup_steps(model, tok, self._warmup_examples, self.cfg)

    async def _start(self) -> tuple[Engine, int]:
        """Load the model; warm up, checkpoint and publish version 0, or resume and publish again."""
        cfg = self.cfg
        path = models.resolve_model(cfg.model.name, self.data_dir)
        warm_up = self.resume is None and cfg.sft.steps > 0
        if warm_up and not (cfg.sft.data or cfg.sft.dataset):  # reference answers, from the environments' workers
            self._warmup_examples = await reference_examples([found.env for found in self.environments.values()], cfg)
        tok, figures = await compute(self.team.call, "open", cfg, path, warm_up)
        engine = self.work.engine()
        model = engine.module
        references = await term_references({name: (found.config, found.env) for name, found in
                                            self.environments.items()}, cfg)
        supply = await compute(SFTSupply, tok, {name: found.config for name, found in self.environments.items()},
                               references, cfg, getattr(model.config, "max_position_embeddings", None))
        self.sft_supply = supply if supply else None
        if self.resume is None:
            self.folder.metrics.append({"step": 0, "version": 0, **figures})
            data = await compute(self.team.call, "weights")
            await self._checkpoint(engine, data)
        else:
            await compute(self.team.call, "load", self.resume[0] / "engine")
            data = await compute(self.team.call, "weights")
            figures = next(m for m in reversed(self.folder.metrics.read()) if m["step"] == self.step)
            if self.published_version > self.version + cfg.trainer.num_steps:
                # More versions past the checkpoint than the run has steps: not this run's trainer's.
                log.warning("run %s: the last weight update on the bus says version %d, more than %d steps past "
                            "checkpoint version %d; not taken", cfg.run, self.published_version,
                            cfg.trainer.num_steps, self.version)
            elif self.published_version > self.version:
                # Steps after this checkpoint were published, then lost: never reuse their versions.
                log.warning("run %s: versions %d..%d were published after checkpoint step %d and are lost; "
                            "its weights become version %d", cfg.run, self.version + 1, self.published_version,
                            self.step, self.published_version + 1)
                self.version = self.published_version + 1
                self.joiner.set_version(self.version)
        await self._publish(data, _numbers(figures))
        if self.resume is not None and self.step > 0:
            # The checkpoint's step was counted when it was trained, unless the trainer died between
            # its checkpoint and its count: counted again under the same id, which counts once.
            await self._publish_usage(self.step, figures, self.trained.get(self.step, []))
        # Fresh, or resumed from checkpoint 0 (killed between it and this): the same id counts once.
        if self.step == 0 and figures.get("sft_tokens"):
            await self.bus.publish(events.Usage(id=f"{cfg.run}.sft", run=cfg.run, source="sft", tenant=self.tenant,
                                                step=0, sft_tokens=int(figures["sft_tokens"])))
        await trainer_started(self.bus, cfg.run, trainer_step=self.step, policy_version=self.version)
        return engine, pad_token_id(tok)

    async def _step(self, engine: Engine, pad_id: int, take: Take, wait_s: float) -> None:
        """Train on ``take``, then record, checkpoint and publish the new version."""
        cfg = self.cfg

        def train_step() -> tuple[dict[str, float], bytes]:
            envs = {name: found.config for name, found in self.environments.items()}
            sft_rows = self.sft_supply.rows(self.step + 1) if self.sft_supply is not None else None
            return (self.team.call("rl_step", take.groups, pad_id, cfg, self.options.micro_batch_size, envs,
                                   sft_rows, self.options.micro_batch_tokens),
                    self.team.call("weights"))

        attributes: dict[str, str | int] = {"flywheel.run": cfg.run, "flywheel.step": self.step + 1}
        with self.bus.tracer_of(__name__).start_as_current_span("train step", attributes=attributes) as span:
            figures, data = await compute(train_step)
            span.set_attribute("flywheel.num_rollouts", len(take.trained_ids))
        self.step += 1
        self.version += 1
        figures.update(take_figures(take, self.joiner), wait_s=wait_s)
        # What inference sampled for this step (the completions of its rollouts) over the step's
        # cycle (waiting for them, then training): the sampling rate the run sees.
        sampled = sum(s.rollout.metrics.get("num_completion_tokens", 0.0) for g in take.groups for s in g)
        figures.update(sampled_tokens=sampled, sampled_tokens_per_s=sampled / max(wait_s + figures["step_s"], 1e-6))
        # A step whose loss or gradients were not finite changed nothing (num_skipped_nonfinite):
        # its figures that are not finite are left out of the metrics file and the update.
        figures = events.finite_metrics(figures)
        metrics.STEP_SECONDS.labels(cfg.run).observe(figures["step_s"])
        metrics.VERSION.labels(cfg.run).set(self.version)
        metrics.ROLLOUTS_TRAINED.labels(cfg.run, "trained").inc(len(take.trained_ids))
        metrics.ROLLOUTS_TRAINED.labels(cfg.run, "dropped").inc(len(take.dropped))
        self.trained[self.step] = take.trained_ids
        self.dropped.update(take.dropped)
        self.num_unused += len(take.unused)
        errors = add_errors(self.errors, take.errors) if take.errors else self.errors
        self.folder.metrics.append({"step": self.step, "version": self.version, **figures})
        if self.step % cfg.trainer.checkpoint_every == 0 or self.step == cfg.trainer.num_steps:
            await self._checkpoint(engine, data)
        await self._publish(data, figures)
        await self._publish_usage(self.step, figures, take.trained_ids)
        self.joiner.set_version(self.version)
        if errors is not self.errors:  # a step that dropped rollouts for an error
            self._say_new_errors(errors)
            self.errors = errors
        await update_run(self.bus, cfg.run, trainer_step=self.step, policy_version=self.version, errors=self.errors)
        log.info("run %s: step %d/%d, version %d: loss %.4f, reward %.3f, %d rollouts (%d stale dropped), %.2fs",
                 cfg.run, self.step, cfg.trainer.num_steps, self.version, figures.get("loss", math.nan),
                 figures.get("reward_mean", math.nan),
                 figures["num_rollouts"], figures["num_dropped_stale"], figures["step_s"])

    def _say_new_errors(self, errors: list[events.ErrorGroup]) -> None:
        """Log each kind of error in ``errors`` that the run had not had: once, with its count
        and example; the run state keeps counting them."""
        known = {(g.source, g.error) for g in self.errors}
        for group in errors:
            if (group.source, group.error) not in known:
                log.warning("run %s: %s failed on rollout %s: %s; its rollouts are dropped, not trained; the run "
                            "state counts each kind (its page, `flywheel runs follow`)", self.cfg.run, group.source,
                            group.example, group.error)

    async def _publish_usage(self, step: int, figures: dict[str, float], trained_ids: list[str]) -> None:
        """What step ``step`` trained, counted once whatever is redelivered: a step done again after
        a crash, or counted again at a resume, has the same id."""
        await self.bus.publish(events.Usage(
            id=f"{self.cfg.run}.trainer.{step}", run=self.cfg.run, source="trainer", tenant=self.tenant, step=step,
            trained_tokens=int(figures.get("num_loss_tokens", 0)), sft_tokens=int(figures.get("num_sft_tokens", 0)),
            rollout_ids=trained_ids))

    async def _next_take(self, stopping: asyncio.Event) -> Take | None:
        """Wait until enough groups are done (or the service stops: None)."""
        since = time.monotonic()
        while not stopping.is_set():
            take = self.joiner.take(self.cfg.groups_per_step)
            if take is not None:
                self.room.set()
                return take
            self.arrived.clear()
            waiters = [asyncio.ensure_future(self.arrived.wait()), asyncio.ensure_future(stopping.wait())]
            try:
                done, _ = await asyncio.wait(waiters, timeout=WAITING_LOG_S, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()
            if not done:
                awaited = self.joiner.awaited_scores()
                scores = ", ".join(f"{name} ({n})" for name, n in awaited.items()) or "none"
                teachers = "".join(f", teacher {name} ({n})" for name, n in self.joiner.awaited_signals().items())
                log.info("run %s: step %d waits for %d done groups (%.0fs so far): %d rollouts buffered, %d of them "
                         "dropped, %d scores without their rollout; rollouts waiting for a score from: %s%s",
                         self.cfg.run, self.step + 1, self.cfg.groups_per_step, time.monotonic() - since,
                         self.joiner.num_buffered, self.joiner.num_dropped, self.joiner.num_orphan_scores, scores,
                         teachers)
        return None

    async def _checkpoint(self, engine: Engine, data: bytes) -> None:
        """Engine state and the weights (``data``, as published), then what the run consumed; then
        the journal may keep only the rest (:meth:`Journal.compact`: a resume skips what the
        checkpoint consumed either way)."""
        state = CheckpointState(step=self.step, version=self.version, trained=self.trained, dropped=self.dropped,
                                num_unused=self.num_unused, errors=self.errors)
        await compute(self.folder.checkpoints.write, state, data, lambda folder: self.team.call("save", folder))
        self.journal.compact(self.joiner.buffered_events())
        self.checkpointed_step = self.step

    async def _publish(self, data: bytes, figures: dict[str, float]) -> None:
        """Put the weights in the object store and announce them: the step's ``figures`` for people,
        every rollout dropped so far (stale, scorer or rollout error) as ``num_dropped_total``, and
        those of the groups that trained nothing as ``num_unused_total``, on which inference's
        admission gives their allowance back and the run's owner replaces them."""
        # Kept whatever weight_versions_kept says: until its evals are done, or for the run's life
        # when a teacher serves it.
        if self.cfg.evals_at(self.step) or self.version in self.cfg.teacher_versions:
            await pin_version(self.bus, self.cfg.run, self.version)
        uri, sha256, size_bytes = await weights.put(self.bus, self.cfg.run, self.version, data,
                                                    self.options.weights_dir)
        await self.bus.publish(events.WeightUpdate(
            id=f"{self.cfg.run}-v{self.version}-{sha256[:16]}", run=self.cfg.run, version=self.version, uri=uri,
            sha256=sha256, size_bytes=size_bytes, trainer_step=self.step, metrics=figures,
            num_dropped_total=len(self.dropped), num_unused_total=self.num_unused))
        log.info("run %s: weights version %d published (step %d, %d bytes)", self.cfg.run, self.version, self.step,
                 size_bytes)
        try:
            await self._drop_old_weights()
        except (nats.errors.Error, TimeoutError) as exc:  # only disk space is at stake: the run goes on
            log.warning("run %s: could not drop old weight versions from the bucket: %s", self.cfg.run, exc)

    async def _drop_old_weights(self) -> None:
        """Purge the run's versions older than the last ``weight_versions_kept``, but those
        pinned for evals (``RunState.pinned_versions``, let go by the run's owner once their
        evals are done). The versions the bucket holds are listed on this trainer's first
        publish (an earlier life may have crashed between publishing and purging: JetStream
        frees disk from the bucket's head, so one version left there would keep the space of
        all after it), then tracked."""
        oldest_kept = self.version - self.options.weight_versions_kept + 1
        if self._held is None:
            self._held = set(await weights.versions(self.bus, self.cfg.run, self.options.weights_dir))
        self._held.add(self.version)
        older = sorted(v for v in self._held if v < oldest_kept)
        if not older:
            return
        state = await get_run(self.bus, self.cfg.run)
        pinned = set(state.pinned_versions) if state is not None else set()
        for version in older:
            if version not in pinned:
                await weights.delete(self.bus, self.cfg.run, version, self.options.weights_dir)
                self._held.discard(version)


def pad_token_id(tok: Any) -> int:
    """Any id pads: padding is masked out of attention and loss."""
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


class RankWork:
    """The model work of one rank, by name (:meth:`calls`): rank 0 runs it through its
    :class:`~flywheel_trainer.ranks.Team`, a follower (:func:`flywheel_trainer.ranks.follow`)
    when rank 0 calls it. ``warmup_steps``: rank 0's (model, tokenizer) -> the warm-up's
    batches, which it shares with the followers (None on a follower)."""

    def __init__(self, options: TrainerSettings,
                 warmup_steps: Callable[[Any, Any], list[list[Tokens]]] | None = None) -> None:
        self.options = options
        self.warmup_steps = warmup_steps
        self._engine: Engine | None = None

    def open(self, cfg: RunConfig, path: Path, warm_up: bool) -> tuple[Any, dict[str, Any]]:
        """Load the model, warm it up (``warm_up``: data-parallel like a step, on rank 0's
        batches), build the engine (every rank starts from rank 0's weights); the tokenizer and
        the warm-up's figures."""
        if cfg.seed is not None:
            seed_torch(cfg.seed)
        model, tok = models.load_model(path, "float32")
        model = with_adapter(model, cfg.trainer)  # the warm-up trains the adapter too
        figures: dict[str, Any] = {}
        if warm_up:
            steps = share(self.warmup_steps(model, tok) if self.warmup_steps is not None else None)
            figures = sft_warmup(model, steps, pad_token_id(tok), cfg, self.options.micro_batch_size,
                                 self.options.micro_batch_tokens)
        self._engine = build_engine(model, cfg.trainer, cfg.model.dtype)
        freeze_heap()  # the model, the engine and what building them imported
        return tok, figures

    def engine(self) -> Engine:
        assert self._engine is not None, "the engine is opened first"
        return self._engine

    def calls(self) -> dict[str, Callable[..., Any]]:
        return {
            "open": self.open,
            "load": lambda folder: self.engine().load(folder),
            "save": lambda folder: self.engine().save(folder),
            "weights": lambda: self.engine().weights(),
            "rl_step": lambda *args: rl_step(self.engine(), *args),
        }


def signal_definition(cfg: RunConfig, environments: dict[str, RunEnvironment]
                      ) -> tuple[list[str], dict[str, list[str]]]:
    """The teachers a rollout waits for, as the joiner takes them (as :func:`reward_definition`
    gives the scorers): for one environment, its teachers and no per-environment table; for
    several, each one's by its name in subjects."""
    by_env = {name: cfg.teachers_of(found.config) for name, found in environments.items()}
    if len(by_env) == 1:
        return next(iter(by_env.values())), {}
    return [], by_env


def take_figures(take: Take, joiner: Joiner) -> dict[str, float]:
    """The step's data figures: rewards, each scorer's mean (``scores.<name>``: metrics of
    weight 0 included), staleness, drops by reason, what is still buffered; in a run with
    several environments, each one's mean reward and rollouts (``env.<name>.reward_mean``,
    ``env.<name>.num_rollouts``), and how many of its rollouts the reward-hacking watch flagged
    (``flagged``, counted where the flag arrived before the step took the rollout)."""
    scored = [s for g in take.groups for s in g]
    rewards = [s.reward for s in scored]
    mean = sum(rewards) / len(rewards)
    staleness = [s.staleness for s in scored]
    by_scorer = {}
    for name in joiner.scorers:  # over the rollouts it scores (a run with several environments: theirs)
        values = [s.scores[name] for s in scored if name in s.scores]
        if values:
            by_scorer[f"scores.{name}"] = sum(values) / len(values)
    if joiner.env_scorers:  # a run with several environments: each one's reward and share of the step
        for env in joiner.env_scorers:
            env_rewards = [s.reward for s in scored if s.rollout.env == env]
            if env_rewards:
                by_scorer[f"env.{env}.reward_mean"] = sum(env_rewards) / len(env_rewards)
            by_scorer[f"env.{env}.num_rollouts"] = float(len(env_rewards))
    flagged = {s.rollout.id for s in scored} & joiner.flagged
    joiner.flagged = {r for r in joiner.flagged if r not in flagged and r not in joiner.consumed}
    return by_scorer | {
        "reward_mean": mean,
        "flagged": float(len(flagged)),  # rollouts of the step the reward-hacking watch flagged
        "reward_std": (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5,
        "num_rollouts": float(len(scored)),
        "num_groups": float(len(take.groups)),
        "num_dropped_stale": float(take.num_dropped("stale")),
        "num_dropped_scorer_error": float(take.num_dropped("scorer_error")),
        "num_dropped_rollout_error": float(take.num_dropped("rollout_error")),
        "num_dropped_signal_error": float(take.num_dropped("signal_error")),
        "staleness_mean": sum(staleness) / len(staleness),
        "staleness_max": float(max(staleness)),
        "num_buffered": float(joiner.num_buffered),
    }


def _numbers(line: dict[str, Any]) -> dict[str, float]:
    """A metrics line as WeightUpdate.metrics (numbers only; step and version are fields of their own)."""
    return {k: float(v) for k, v in line.items() if k not in ("step", "version") and isinstance(v, int | float)}
