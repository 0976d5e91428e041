"""The run folder: atomic checkpoints, the journal (torn last line included), metrics kept to a step."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import msgspec
import pytest

from flywheel.contract.checkpoints import WEIGHTS_FILE
from flywheel_trainer import ledger
from flywheel_trainer.ledger import CheckpointState, Journal, RunFolder
from tests.unit.test_trainer_join import make_rollout, make_score


def test_a_checkpoint_becomes_the_latest_only_when_complete(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path, "r")
    checkpoints = folder.checkpoints
    assert checkpoints.latest() is None
    tmp = checkpoints.begin(1)
    (tmp / "engine").mkdir()
    (tmp / "engine" / "weights.bin").write_bytes(b"w1")
    assert checkpoints.latest() is None  # written, not committed
    checkpoints.commit(tmp, CheckpointState(step=1, version=1, trained={1: ["a", "b"]}, dropped={"c": "stale"}))
    latest = checkpoints.latest()
    assert latest is not None
    path, state = latest
    assert path.name == "step-00000001" and (path / "engine" / "weights.bin").read_bytes() == b"w1"
    assert state.trained == {1: ["a", "b"]} and state.consumed_ids() == {"a", "b", "c"}

    crashed = checkpoints.begin(2)  # a crash mid-write leaves this behind; the next begin clears it
    (crashed / "half").write_bytes(b"x")
    tmp = checkpoints.begin(2)
    assert not (tmp / "half").exists()
    checkpoints.commit(tmp, CheckpointState(step=2, version=2, trained={1: ["a", "b"], 2: ["d"]}))
    latest = checkpoints.latest()
    assert latest is not None
    path, state = latest
    assert state.step == 2 and [p.name for p in checkpoints.folder.glob("step-*")] == ["step-00000002"]


def test_the_newest_checkpoints_are_kept_with_their_weights(tmp_path: Path) -> None:
    checkpoints = RunFolder(tmp_path, "r", keep_checkpoints=2).checkpoints
    assert checkpoints.steps() == [] and checkpoints.at(1) is None
    for step in (1, 2, 3):
        checkpoints.write(CheckpointState(step=step, version=step), f"w{step}".encode(),
                          lambda folder: folder.mkdir())
    assert checkpoints.steps() == [2, 3] and checkpoints.at(1) is None
    found = checkpoints.at(2)
    assert found is not None and found[1].version == 2 and (found[0] / WEIGHTS_FILE).read_bytes() == b"w2"
    # A resume from step 2 (step 3 lost its place in `latest`): writing step 3 again replaces it.
    (checkpoints.folder / "latest").write_text("step-00000002")
    assert checkpoints.steps() == [2]  # none newer than the latest counts
    checkpoints.write(CheckpointState(step=3, version=4), b"w3 again", lambda folder: folder.mkdir())
    assert checkpoints.steps() == [2, 3] and (checkpoints.folder / "step-00000003" / WEIGHTS_FILE).read_bytes() == (
        b"w3 again")
    with pytest.raises(ValueError, match="keep=0"):
        RunFolder(tmp_path, "r", keep_checkpoints=0)


def test_the_journal_replays_what_was_appended_and_skips_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = Journal(path)
    assert journal.replay() == []
    journal.rewrite([])
    a = make_rollout("a", "g")
    journal.append([a, make_score(a, "exact", 1.0)])
    journal.close()
    with open(path, "ab") as f:
        f.write(b'{"type":"rollout","id":"torn","ru')  # a crash mid-append
    again = Journal(path)
    assert [e.id for e in again.replay()] == ["a", "a.exact"]
    again.rewrite(again.replay())  # cuts the torn line off before anything is appended after it
    again.append([make_rollout("b", "g")])
    assert [e.id for e in again.replay()] == ["a", "a.exact", "b"]
    again.close()
    with open(path, "r+b") as f:
        f.seek(5)
        f.write(b"!!!")  # damage in the middle is not a crash: it is an error
    with pytest.raises(msgspec.DecodeError):
        Journal(path).replay()


def test_metrics_keep_until_forgets_the_steps_a_crash_lost(tmp_path: Path) -> None:
    metrics = RunFolder(tmp_path, "r").metrics
    for step in range(4):
        metrics.append({"step": step, "loss": 0.5 * step})
    with open(metrics.path, "a") as f:
        f.write('{"step": 4, "lo')
    metrics.keep_until(2)
    assert [m["step"] for m in metrics.read()] == [0, 1, 2]
    # Each line carries the wall-clock time it was written: steps line up with other clocks.
    times = [datetime.fromisoformat(m["time"]) for m in metrics.read()]
    assert times == sorted(times) and all(t.tzinfo is not None for t in times)


def test_a_checkpoint_compacts_the_journal_only_once_it_outgrew_what_is_unconsumed(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    monkeypatch.setattr(ledger, "COMPACT_MIN_ENTRIES", 10)
    journal = Journal(tmp_path / "journal.jsonl")
    journal.rewrite([])
    rollouts: list[ledger.Entry] = [make_rollout(f"r{i}", "g") for i in range(12)]
    journal.append(rollouts[:9])
    assert not journal.compact(rollouts[8:9])  # 9 entries: under the floor, kept as they are
    assert len(journal.replay()) == 9
    journal.append(rollouts[9:])
    assert not journal.compact(rollouts[10:])  # 12 entries, 2 unconsumed: under 8 x 2
    assert journal.compact(rollouts[11:])  # 12 entries, 1 unconsumed: rewritten with it
    assert [e.id for e in journal.replay()] == ["r11"] and journal.num_entries == 1
    journal.close()
