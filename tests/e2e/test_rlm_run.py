"""The RLM environment trains end to end: ``flywheel run examples/long-context.toml`` against
``flywheel up`` (the real services, the sandbox service among them) for a few steps on the tiny
model (tiny-long: the harness's instructions need more than 256 positions): every rollout's REPL
runs in a sandbox of its own, every step trains, and the run finishes with its metrics (the
harness's counts among them). About 20 s. The tiny model writes no working code, so this is the
plumbing, not learning."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_up import Output

ROOT = Path(__file__).parents[2]
NUM_STEPS = 3


@pytest.mark.long
def test_the_rlm_environment_trains_end_to_end(
        tmp_path: Path, stack: tuple[subprocess.Popen[str], Output, dict[str, int]], clean_env: dict[str, str]) -> None:
    _, output, ports = stack
    output.wait_for(r"^Flywheel is up", 120)
    data_dir = tmp_path / "data"
    argv = [sys.executable, "-m", "flywheel.ops.cli", "run", str(ROOT / "examples" / "long-context.toml"),
            "--run-id", "rlm", "--data-dir", str(data_dir), "--nats-port", str(ports["nats"]),
            "--gateway-port", str(ports["gateway"]), "--inference-port", str(ports["inference"]),
            "--set", f"trainer.num_steps={NUM_STEPS}", "--set", "trainer.batch_size=8"]
    done = subprocess.run(argv, capture_output=True, text=True, env=clean_env, cwd=ROOT, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    metrics = [json.loads(line) for line in (data_dir / "runs" / "rlm" / "metrics.jsonl").read_text().splitlines()][1:]
    assert [m["step"] for m in metrics] == list(range(1, NUM_STEPS + 1))
    for m in metrics:
        assert m["num_rollouts"] == 8 and m["num_dropped_rollout_error"] == 0, m
        assert "scores.answered" in m and "scores.cells" in m and "scores.sub_calls" in m
    assert "sandbox" in output.text  # the stack's sandbox service ran the REPLs
