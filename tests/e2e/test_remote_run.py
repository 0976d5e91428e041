"""A tenant trains over HTTP, as a user does: ``flywheel up`` with API keys, ``flywheel keys
create``, then ``flywheel run CONFIG --remote URL`` with that key: the gateway registers the run
as the key's tenant's, an orchestrator of the stack loads its environment and runs it to the end,
and the command follows it there. A run whose environment does not exist fails, and the
command says why and exits 1."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import stack_up
from tests.e2e.test_hub import RUN_CONFIG

pytestmark = pytest.mark.long  # flywheel up and a two-step run of the tiny model (about a minute)


def test_a_tenant_trains_over_http_with_its_key(tmp_path: Path, readable: Path, clean_env: dict[str, str]) -> None:
    data = readable / "data"
    env = clean_env | {"FLYWHEEL_DATA_DIR": str(data), "FLYWHEEL_AUTH": "keys"}

    def flywheel(*args: str, key: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "flywheel.ops.cli", *args], capture_output=True, text=True,
                              env=env | ({"FLYWHEEL_API_KEY": key} if key else {}), cwd=tmp_path, timeout=timeout,
                              check=False)

    with stack_up(data, env) as ports:
        url = f"http://127.0.0.1:{ports['gateway']}"
        made = flywheel("keys", "create", "--tenant", "acme", "--nats-port", str(ports["nats"]))
        assert made.returncode == 0, made.stderr
        key = made.stdout.strip().splitlines()[-1]
        config = tmp_path / "remote.toml"
        config.write_text(RUN_CONFIG.format(run="remote", env="reverse_text"))
        done = flywheel("run", str(config), "--remote", url, "--run-id", "remote-1", key=key)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        assert f"run remote-1 registered on {url} (tenant acme)" in done.stdout, done.stdout
        assert "step 2/2: reward" in done.stdout and "run remote-1 finished" in done.stdout, done.stdout
        summary = data / "runs" / "remote-1" / "summary.json"  # in the stack's run folder, once its owner ends it
        deadline = time.monotonic() + 30
        while not summary.is_file() and time.monotonic() < deadline:
            time.sleep(0.2)  # noqa: sleep - the polling interval of this bounded wait
        assert json.loads(summary.read_text())["steps"] == 2

        config.write_text(RUN_CONFIG.format(run="remote", env="no_such_env"))
        broken = flywheel("run", str(config), "--remote", url, "--run-id", "remote-2", key=key)
        assert broken.returncode == 1, broken.stdout[-4000:] + broken.stderr[-4000:]
        assert "run remote-2 failed: " in broken.stdout and "no_such_env" in broken.stdout, broken.stdout
        refused = flywheel("run", str(config), "--remote", url, "--run-id", "remote-3")  # no key
        assert refused.returncode == 1 and "401" in refused.stderr, refused.stderr[-2000:]
