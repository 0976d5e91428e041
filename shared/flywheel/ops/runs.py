"""``flywheel runs list | follow RUN | stop RUN | resume RUN``: the runs of a stack, from their state.

- ``list``: every run in the run-state bucket: kind, status as :func:`flywheel.contract.runs.end_of`
  sees it (``abandoned`` while no orchestrator holds it after its owner's lease expired),
  step, owner;
- ``follow RUN``: the run's steps (those its weight updates still hold, then each new one, the
  line ``flywheel run`` prints), its owner's notes from now on (evals' results among them)
  and its status changes, until it ends and its owner lets go (an abandoned run is followed,
  saying so, until an orchestrator takes it over); Ctrl-C only detaches;
- ``pause RUN``: marks the run paused (:func:`flywheel.contract.runs.pause_run`); its owner
  stops the trainer (it checkpoints first) and holds the run with its queued tasks until
  ``resume RUN``;
- ``stop RUN``: marks the run stopped (:func:`flywheel.contract.runs.stop_run`); its owner (an
  orchestrator) sees it within a second, stops the trainer, which checkpoints first, and lets
  go of it; inference releases its queued tasks;
- ``resume RUN``: a stopped, failed or abandoned run goes on from its last checkpoint, with the
  config it was started with (its run state, else the run folder's ``config.json``), followed
  here as ``flywheel run CONFIG --run-id RUN --resume`` does (starting the embedded stack
  when no NATS answers). A run that finished, does not exist, or is still running is
  refused, saying why.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any, TextIO

import nats.errors

from flywheel.contract import events, natsusers
from flywheel.contract.bus import Bus, wait_at_most, watch
from flywheel.contract.checkpoints import run_folder
from flywheel.contract.config import RunConfig
from flywheel.contract.runs import check_resumable, end_of, get_run, list_runs, new_notes, pause_run, stop_run
from flywheel.contract.settings import Settings
from flywheel.ops.run import MainJob, nats_answers
from flywheel.ops.tables import table
from flywheel.runtime.reporting import format_step, format_summary

FOLLOW_STATE_S = 1.0  # how often `runs follow` reads the run's state


async def connect(settings: Settings, what: str) -> Bus:
    """The bus, or a ConnectionError saying that no stack answers, for ``what``."""
    url = settings.resolved_nats_url
    if not await nats_answers(url):
        raise ConnectionError(f"no NATS at {natsusers.redacted(url)}: {what} needs the stack that runs the runs "
                              "(`flywheel up`, or the one `flywheel run` started); give --nats-url or --nats-port "
                              "of that stack")
    return await Bus.connect(url, "flywheel-runs")


def status_of(state: events.RunState) -> str:
    end = end_of(state)
    return end.status if end is not None else state.status


def _when(at: datetime | None) -> str:
    return at.astimezone().strftime("%Y-%m-%d %H:%M:%S") if at else "-"


def format_runs(states: list[events.RunState]) -> str:
    """The runs as a table, newest first."""
    if not states:
        return "no runs (`flywheel run CONFIG` starts one)"
    rows = []
    for s in sorted(states, key=lambda s: s.created_at, reverse=True):
        num_steps = (s.config.get("trainer") or {}).get("num_steps") if s.config else None
        step = f"{s.trainer_step}/{num_steps}" if num_steps else str(s.trainer_step)
        rows.append([s.id, s.kind, status_of(s), step, s.tenant, _when(s.created_at), s.owner or "-"])
    return table(rows, ["run", "kind", "status", "step", "tenant", "created", "owner"])


async def list_command(settings: Settings, out: TextIO) -> None:
    bus = await connect(settings, "listing runs")
    try:
        print(format_runs(await list_runs(bus)), file=out)
    finally:
        await bus.close()


async def stop_command(settings: Settings, run: str, by: str, out: TextIO) -> events.RunState:
    state, before = await _change(settings, run, f"stopping run {run!r}", stop_run, by)
    if before is not None and before.status == state.status:
        print(f"run {run} had {status_of(state)} already ({state.reason or 'no reason given'})", file=out)
    else:
        print(f"run {run}: {state.reason}; its owner stops its trainer (it checkpoints first); "
              f"`flywheel runs resume {run}` goes on from there", file=out)
    return state


async def pause_command(settings: Settings, run: str, by: str, out: TextIO) -> events.RunState:
    state, before = await _change(settings, run, f"pausing run {run!r}", pause_run, by)
    if before is not None and before.status == "paused":
        print(f"run {run} is paused already ({state.reason or 'no reason given'})", file=out)
    else:
        print(f"run {run}: {state.reason}; its owner stops its trainer (it checkpoints first) and keeps the run; "
              f"`flywheel runs resume {run}` goes on", file=out)
    return state


async def _change(settings: Settings, run: str, what: str,
                  change: Callable[[Bus, str, str], Awaitable[events.RunState]], by: str
                  ) -> tuple[events.RunState, events.RunState | None]:
    """``change(bus, run, by)`` on the stack's bus: the new state, and the one before."""
    bus = await connect(settings, what)
    try:
        before = await get_run(bus, run)
        return await change(bus, run, by), before
    finally:
        await bus.close()


def stored_config(settings: Settings, run: str) -> dict[str, Any] | None:
    """The config the run was started with, from its run folder (no bus needed); None when absent."""
    path = run_folder(settings.data_dir, run) / "config.json"
    return json.loads(path.read_text()) if path.exists() else None


async def resumable_config(settings: Settings, run: str) -> RunConfig:
    """The run's config when it may be resumed; a ValueError saying why not. Without a stack
    answering, the run folder's config is taken (the embedded stack starts with the resume)."""
    data = stored_config(settings, run)
    if await nats_answers(settings.resolved_nats_url):
        bus = await Bus.connect(settings.resolved_nats_url, "flywheel-runs")
        try:
            state = await get_run(bus, run)
        finally:
            await bus.close()
        data = check_resumable(state, run).config
    if data is None:
        raise ValueError(f"run {run!r}: no {run_folder(settings.data_dir, run) / 'config.json'} and no stack "
                         "answers to read its state from; give --data-dir (or --nats-url) of the stack that ran it")
    return RunConfig.parse(data, source=f"run {run!r} config", trusted_modules=settings.trusted_modules)


def resume_command(settings: Settings, run: str) -> dict[str, Any]:
    cfg = asyncio.run(resumable_config(settings, run))
    return asyncio.run(MainJob(cfg, settings, resume=True).run())


async def follow(settings: Settings, run: str, out: TextIO) -> str:
    """Print the run's steps and status changes until it ends (its final status) or Ctrl-C
    (``detached``)."""
    bus = await connect(settings, f"following run {run!r}")
    detached = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, detached.set)
    try:
        state = await get_run(bus, run)
        if state is None:
            raise ValueError(f"run {run!r} is not in the runs KV bucket; `flywheel runs list` lists the runs")
        cfg = (RunConfig.parse(state.config, source=f"run {run!r} config", trusted_modules=settings.trusted_modules)
               if state.config else None)
        num_steps = cfg.trainer.num_steps if cfg is not None else 0
        print(f"run {run}: {status_of(state)}, step {state.trainer_step}/{num_steps or '?'}, owner "
              f"{state.owner or 'none'} (Ctrl-C stops following, not the run)", file=out, flush=True)
        steps = asyncio.ensure_future(_print_steps(bus, run, num_steps, detached, out))
        try:
            status = await _until_ended(bus, run, status_of(state), state.num_notes, detached, out)
        finally:
            detached.set()
            await asyncio.gather(steps, return_exceptions=True)
        if status != "detached":
            _say_summary(settings, run, out)
        return status
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await bus.close()


def _say_summary(settings: Settings, run: str, out: TextIO) -> None:
    """The ended run's summary as ``flywheel run`` prints it, from the run folder its owner wrote
    it to; where this machine has none (the owner ran elsewhere), where it would be."""
    path = run_folder(settings.data_dir, run) / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        print(f"run {run}: no summary on this machine ({path}): its owner writes it in its own data dir",
              file=out, flush=True)
        return
    except (OSError, ValueError) as exc:
        print(f"run {run}: its summary ({path}) could not be read: {exc}", file=out, flush=True)
        return
    if summary:
        print("summary:\n" + format_summary(summary), file=out, flush=True)


async def _print_steps(bus: Bus, run: str, num_steps: int, stopping: asyncio.Event, out: TextIO) -> None:
    first: datetime | None = None
    shown: set[int] = set()
    async for update in watch(bus, f"weights.{run}", events.WeightUpdate, stopping, watcher="flywheel-runs-follow"):
        first = first or update.created_at
        if update.trainer_step == 0 or update.trainer_step in shown:
            continue
        shown.add(update.trainer_step)
        row = {"step": float(update.trainer_step), "elapsed_s": (update.created_at - first).total_seconds(),
               **update.metrics}
        print(format_step(row, num_steps, None), file=out, flush=True)


async def _until_ended(bus: Bus, run: str, status: str, num_notes: int, detached: asyncio.Event, out: TextIO) -> str:
    """Say the owner's notes from ``num_notes`` on and each status change of the run; return its
    status once it ended (and its owner let go: its last notes are its evals), ``detached`` on Ctrl-C.
    An abandoned run (its owner's lease ran out) has not ended: an orchestrator takes it over, and
    until one does this says it waits for that (as ``flywheel run`` does)."""
    said_abandoned = False
    while not detached.is_set():
        try:
            state = await get_run(bus, run)
        except (TimeoutError, nats.errors.Error):
            state = None  # the bus is away for now: asked again soon
        if state is not None:
            for note in new_notes(state, num_notes):
                print(f"run {run}: {note}", file=out, flush=True)
            num_notes = state.num_notes
            now = status_of(state)
            if now != status:
                end = end_of(state)
                print(f"run {run}: {now}" + (f" ({end.reason})" if end is not None and now != "finished" else ""),
                      file=out, flush=True)
                status = now
            held = state.owner is not None and (state.lease_expires_at is None
                                                or state.lease_expires_at > events.utc_now())
            end = end_of(state)
            if end is not None and end.status == "abandoned":
                if not said_abandoned:
                    print(f"run {run}: {end.reason}; waiting for an orchestrator to take it over", file=out,
                          flush=True)
                    said_abandoned = True
            elif end is not None and not held:
                await asyncio.sleep(FOLLOW_STATE_S)  # time for the steps watch to print the last step
                return status
        await wait_at_most(detached.wait(), FOLLOW_STATE_S)
    print(f"run {run}: no longer following (the run goes on; `flywheel runs follow {run}` again)", file=out)
    return "detached"
