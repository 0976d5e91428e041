"""A run's checkpoints on disk: the layout the trainer writes and ``flywheel export`` reads.

Under ``<data_dir>/runs/<run>/checkpoint/``::

    latest                      name of the newest complete checkpoint, e.g. step-00000012
    step-00000012/
      state.json                step, version, the rollout ids trained at each step, the dropped ones
      weights.safetensors       the policy's weights at that step, as published (any engine)
      engine/                   model and optimizer, as the engine writes them (what a resume loads)

A checkpoint is written to a temporary folder, renamed into place, then named in
``latest`` (each an atomic rename), so a reader sees a checkpoint whole or not at all. The
newest ``keep`` complete checkpoints are kept (``trainer.keep_checkpoints``); older ones are
deleted once a newer one is named in ``latest``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import msgspec

from flywheel.contract import events
from flywheel.contract.names import path_name

STEP_PREFIX = "step-"
WEIGHTS_FILE = "weights.safetensors"


def run_folder(data_dir: str | Path, run: str) -> Path:
    """``<data_dir>/runs/<run>`` (the run's :func:`~flywheel.contract.names.path_name`): where
    everything of one run is kept."""
    return Path(data_dir) / "runs" / path_name(run)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class CheckpointState(msgspec.Struct, kw_only=True):
    """What a checkpoint knows besides the weights: where the run stood and what it consumed."""

    step: int
    version: int  # the weights version these weights were published as
    trained: dict[int, list[str]] = {}  # step -> ids of the rollouts it trained
    dropped: dict[str, str] = {}  # rollout id -> why it was consumed without training
    num_unused: int = 0  # rollouts of the groups consumed with nothing trained (WeightUpdate.num_unused_total)
    errors: list[events.ErrorGroup] = []  # the dropped rollouts' errors, grouped (RunState.errors)

    def consumed_ids(self) -> set[str]:
        return {i for ids in self.trained.values() for i in ids} | set(self.dropped)


def _name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


class Checkpoints:
    """Complete checkpoints in one folder; the newest ``keep`` are kept."""

    def __init__(self, folder: Path, keep: int = 1) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: at least the newest checkpoint is kept (a resume needs it)")
        self.folder = folder
        self.pointer = folder / "latest"
        self.keep = keep

    def latest(self) -> tuple[Path, CheckpointState] | None:
        if not self.pointer.exists():
            return None
        return self._read(self.folder / self.pointer.read_text().strip())

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints kept, oldest first (none newer than ``latest``)."""
        latest = self.latest()
        if latest is None:
            return []
        found = sorted(int(p.name.removeprefix(STEP_PREFIX)) for p in self.folder.glob(f"{STEP_PREFIX}*")
                       if p.name.removeprefix(STEP_PREFIX).isdigit() and (p / "state.json").exists())
        return [step for step in found if step <= latest[1].step]

    def at(self, step: int) -> tuple[Path, CheckpointState] | None:
        """The complete checkpoint of ``step``; None when none is kept."""
        return self._read(self.folder / _name(step)) if step in self.steps() else None

    @staticmethod
    def _read(path: Path) -> tuple[Path, CheckpointState]:
        return path, msgspec.json.decode((path / "state.json").read_bytes(), type=CheckpointState)

    def begin(self, step: int) -> Path:
        """An empty temporary folder for checkpoint ``step`` (the engine writes into ``engine/``)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".{_name(step)}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a crash mid-write: never named in `latest`
        tmp.mkdir()
        return tmp

    def write(self, state: CheckpointState, weights: bytes, save_engine: Callable[[Path], None]) -> Path:
        """A whole checkpoint: ``save_engine(folder)`` writes the engine state into ``engine/``,
        ``weights`` (safetensors bytes, as published) go beside it; then :meth:`commit`."""
        tmp = self.begin(state.step)
        save_engine(tmp / "engine")
        (tmp / WEIGHTS_FILE).write_bytes(weights)
        return self.commit(tmp, state)

    def commit(self, tmp: Path, state: CheckpointState) -> Path:
        """Make ``tmp`` (from :meth:`begin`) the latest checkpoint, atomically; keep the newest
        ``keep``, and drop any kept checkpoint of a later step (a resume went back past it)."""
        write_atomically(tmp / "state.json", msgspec.json.encode(state))
        name = _name(state.step)
        final = self.folder / name
        if final.exists():
            # A previous attempt at this step, renamed into place but never named in
            # `latest` (a crash in between): the run resumed from an earlier checkpoint.
            assert self.pointer.read_text().strip() != name, f"checkpoint {name} is the latest; not overwriting it"
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(self.folder)
        write_atomically(self.pointer, name.encode())
        kept = sorted((p for p in self.folder.glob(f"{STEP_PREFIX}*") if p.name.removeprefix(STEP_PREFIX).isdigit()),
                      key=lambda p: p.name)
        older = [p for p in kept if p.name < name]
        for old in [p for p in kept if p.name > name] + older[:max(0, len(older) - (self.keep - 1))]:
            shutil.rmtree(old)
        return final
