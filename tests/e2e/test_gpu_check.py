"""The prepared GPU check keeps running: the same script, on CPU, smallest settings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.long
def test_gpu_check_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--zero-stages", "",
                           "--steps", "1", "--batch-size", "16", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["checks"] and all(check["ok"] for check in report["checks"].values()), report["checks"]
