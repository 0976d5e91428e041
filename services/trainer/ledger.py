"""The trainer's state on disk: checkpoints, the journal of received work, the metrics.

Layout under ``<data_dir>/runs/<run>/``::

    metrics.jsonl               one JSON line per step (step 0: the weights before RL), with its wall-clock ``time``
    checkpoint/
      latest, step-*/           the newest checkpoints (flywheel.contract.checkpoints: engine state and weights)
      journal.jsonl             rollouts, scores and signals received and not yet consumed by a checkpoint

Why a journal: the trainer acknowledges a rollout or score to NATS as soon as it is
appended here and fsynced, so nothing waits on the bus for the slow path (a step, a
checkpoint) and a restart does not wait for redeliveries. A checkpoint is written to a
temporary folder, renamed into place, then named in ``latest`` (each an atomic rename),
and only then may the journal be compacted: rewritten with what is still unconsumed, once
it holds :data:`COMPACT_FACTOR` times as many entries as that (and :data:`COMPACT_MIN_ENTRIES`),
not at every checkpoint, which rewrote about as much as it kept. Resuming = the
latest checkpoint plus every journal entry whose rollout that checkpoint did not consume:
work received before a crash is neither lost nor trained twice, and rollouts trained by
steps after the last checkpoint are trained again (their steps never happened, as far as
the surviving weights know). A crash can tear the journal's last line only; that entry
was never acknowledged, so NATS delivers it again and the torn line is skipped.

Not covered: pruning the consumed ids (``state.json`` keeps every id, about 40 bytes a
rollout), checkpoints on another machine's disk (resume needs this folder).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import msgspec

from flywheel.contract import events
from flywheel.contract.checkpoints import (  # the layout, shared with its readers (flywheel export)
    Checkpoints,
    CheckpointState,
    run_folder,
    write_atomically,
)

__all__ = ["CheckpointState", "Checkpoints", "Journal", "MetricsFile", "RunFolder", "read_lines"]

log = logging.getLogger(__name__)

T = TypeVar("T")
Entry = events.Rollout | events.Score | events.Signal  # what the journal holds: what the join takes in
COMPACT_FACTOR = 8  # a checkpoint compacts the journal once it holds this many times what is unconsumed
COMPACT_MIN_ENTRIES = 4096  # ... and at least this many entries


def read_lines(path: Path, decode: Callable[[bytes], T]) -> list[T]:
    """Decode each line of ``path``. A crash mid-append can tear the last line only: that one
    is skipped (its writer never finished, so never acknowledged it); any other bad line raises."""
    lines = path.read_bytes().split(b"\n") if path.exists() else []
    out = []
    for i, line in enumerate(lines):
        if not line:
            continue
        try:
            out.append(decode(line))
        except (msgspec.DecodeError, msgspec.ValidationError):
            if i != len(lines) - 1:
                raise
            log.warning("%s: skipping a torn last line (%d bytes)", path, len(line))
    return out


class Journal:
    """Append-only JSON lines of rollouts and scores, fsynced before they are acknowledged.

    Open it with :meth:`rewrite` (after :meth:`replay` on a resume): that also cuts off a
    line torn by a crash, so new entries never follow half an old one.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: BinaryIO | None = None
        self._decoder: events.Decoder[Entry] = events.Decoder(Entry)
        self.num_entries = 0  # lines written since it was opened (rewritten): what it holds

    def replay(self) -> list[Entry]:
        """What the journal holds, each entry's numbers checked as the bus checks them on arrival
        (:func:`flywheel.contract.events.checked`), so a journal written before a bound existed
        never replays a number into a crash; an entry that cannot be made safe is left out."""
        out: list[Entry] = []
        for entry in read_lines(self.path, self._decoder.decode):
            try:
                out.append(events.checked(entry))
            except events.OutOfBounds as exc:
                log.warning("journal %s: %s; left out", self.path, exc)
        return out

    def rewrite(self, entries: list[Entry]) -> None:
        """Replace the journal with ``entries`` (what is still unconsumed), atomically."""
        self.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, b"".join(events.encode(e) + b"\n" for e in entries))
        self._file = open(self.path, "ab")
        self.num_entries = len(entries)

    def compact(self, entries: list[Entry]) -> bool:
        """:meth:`rewrite` with ``entries`` (what is still unconsumed) if the journal has grown
        enough past them to be worth it (see the module's docstring); whether it did."""
        if self.num_entries < max(COMPACT_FACTOR * len(entries), COMPACT_MIN_ENTRIES):
            return False
        self.rewrite(entries)
        return True

    def append(self, entries: list[Entry]) -> None:
        assert self._file is not None, "Journal.rewrite() opens the journal before the first append()"
        if not entries:
            return
        self._file.write(b"".join(events.encode(e) + b"\n" for e in entries))
        self._file.flush()
        os.fsync(self._file.fileno())
        self.num_entries += len(entries)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class MetricsFile:
    """``metrics.jsonl``: one JSON object per step, as the run's plots and tests read it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, line: dict[str, Any]) -> None:
        """Append one step's line, stamped with the wall-clock ``time`` it was written (UTC, ISO 8601)."""
        with open(self.path, "a") as f:
            f.write(json.dumps({**line, "time": events.utc_now().isoformat()}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> list[dict[str, Any]]:
        return read_lines(self.path, msgspec.json.decode)

    def keep_until(self, step: int) -> None:
        """Forget the lines of steps after ``step`` (they were lost with a crash; they are redone)."""
        kept = [line for line in self.read() if line["step"] <= step]
        write_atomically(self.path, "".join(json.dumps(line) + "\n" for line in kept).encode())


class RunFolder:
    """``<data_dir>/runs/<run>/``: everything the trainer keeps for one run."""

    def __init__(self, data_dir: Path, run: str, keep_checkpoints: int = 1) -> None:
        self.root = run_folder(data_dir, run)
        self.checkpoints = Checkpoints(self.root / "checkpoint", keep=keep_checkpoints)
        self.journal_path = self.root / "checkpoint" / "journal.jsonl"
        self.metrics = MetricsFile(self.root / "metrics.jsonl")
