"""``flywheel eval reverse_text --model tiny`` on a machine where no stack runs, as a new user
first runs it: the eval starts the embedded stack's nats-server, inference and sandbox, has
inference serve the untrained tiny model with no training run, evaluates it (no errors, a real
reward), records it on the stack's bus (``--record``) and stops what it started."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flywheel.runtime.natsserver import free_port


@pytest.mark.long
def test_eval_of_a_model_starts_the_stack_when_none_runs(tmp_path: Path, clean_env: dict[str, str]) -> None:
    data, out = tmp_path / "data", tmp_path / "tiny.jsonl"
    ports = {"nats": free_port(), "inference": free_port()}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "flywheel.ops.cli", "eval", "reverse_text", "--model", "tiny",
                           "-n", "4", "-r", "2", "--max-tokens", "8", "--out", str(out), "--data-dir", str(data),
                           "--nats-port", str(ports["nats"]), "--inference-port", str(ports["inference"]),
                           "--record"],
                          capture_output=True, text=True, env=clean_env, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "starting the embedded stack's nats-server, inference and sandbox for this eval" in done.stderr
    assert "inference loads model tiny for this eval" in done.stderr and "model tiny is served" in done.stderr
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert (summary["num_rollouts"], summary["num_errors"], summary["errors"]) == (8, 0, []), summary["errors"]
    assert summary["reward_mean"] is not None and summary["num_scored"] == 8
    assert summary["served_as"].startswith("model-tiny-")
    assert summary["run"] is not None  # --record reached the stack's NATS, with the login it made
    assert re.search(r"^num_errors +0$", done.stdout, re.M), done.stdout
    for port in ports.values():  # what the eval started, it stopped
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still answers after the eval"
    print(f"flywheel eval --model tiny, stack started and stopped: {time.monotonic() - started:.1f}s")
