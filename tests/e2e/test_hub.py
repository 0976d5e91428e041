"""The environment hub as a new user meets it, against ``flywheel up``: ``env init`` -> edit the
reward -> ``env push`` -> ``env install`` by id in a fresh venv -> a run and ``flywheel eval
--push`` -> the leaderboard shows it -> ``env fork`` (pushed with its lineage) -> a run names
the fork by id and trains, with nothing installed by hand.

The fresh venv holds no environment package: it reaches the project's own venv for Flywheel
and its dependencies (a ``.pth`` line), and everything the test installs goes into it alone;
``flywheel up`` runs its services with its Python, so they install what a run needs there."""

from __future__ import annotations

import json
import re
import site
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import stop_stack
from tests.e2e.test_up import Output

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 120
RUN_CONFIG = """\
run = "{run}"
env = "{env}"
group_size = 4

[model]
name = "tiny"

[sampling]
max_tokens = 8

[sft]
steps = 0

[trainer]
batch_size = 8
num_steps = 2
"""


def fresh_venv(where: Path) -> Path:
    """A venv of its own (its python), seeing this venv's packages after its own."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=60)
    (own,) = (where / "lib").glob("python3*/site-packages")
    calls = "; ".join(f"site.addsitedir({p!r})" for p in site.getsitepackages())
    (own / "flywheel-shared.pth").write_text(f"import site; {calls}\n")  # a .pth line run as code
    return where / "bin" / "python"


def test_push_install_eval_fork_and_a_run_on_the_fork(tmp_path: Path, clean_env: dict[str, str]) -> None:
    from flywheel.ops.natsserver import free_port

    python = fresh_venv(tmp_path / "fresh")
    ports = {"nats": free_port(), "gateway": free_port(), "inference": free_port()}
    data = tmp_path / "data"
    settings = ["--data-dir", str(data), "--nats-port", str(ports["nats"]), "--gateway-port", str(ports["gateway"]),
                "--inference-port", str(ports["inference"])]
    gateway = ["--gateway-url", f"http://127.0.0.1:{ports['gateway']}"]

    def flywheel(*args: str, timeout: float = 300, cwd: Path = tmp_path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(python), "-m", "flywheel.ops.cli", *args], capture_output=True, text=True,
                              env=clean_env, cwd=cwd, timeout=timeout, check=False)

    def ok(done: subprocess.CompletedProcess[str]) -> str:
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        return done.stdout

    up = subprocess.Popen([str(python), "-m", "flywheel.ops.cli", "up", *settings], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=clean_env)
    output = Output(up)
    try:
        output.wait_for(r"^Flywheel is up", READY_TIMEOUT_S)
        ok(flywheel("env", "init", "qa", "--owner", "acme", "--dir", str(tmp_path / "src")))
        module = tmp_path / "src" / "qa" / "qa" / "__init__.py"
        text = module.read_text()
        exact = 'return float(normalize(completion) == normalize(task["answer"]))'
        assert exact in text
        module.write_text(text.replace(exact, 'return float(normalize(task["answer"]) in normalize(completion))'))

        pushed = ok(flywheel("env", "push", str(tmp_path / "src" / "qa"), *gateway))
        assert re.search(r"^pushed acme/qa@0\.1\.0 \(sha256 [0-9a-f]{64}\)$", pushed, re.M), pushed
        again = flywheel("env", "push", str(tmp_path / "src" / "qa"), *gateway)
        assert again.returncode == 1 and "acme/qa@0.1.0 exists" in again.stderr, again.stderr[-2000:]

        assert "acme/qa" not in ok(flywheel("env", "list"))
        assert "installed acme/qa@0.1.0" in ok(flywheel("env", "install", "acme/qa", *gateway))
        assert re.search(r"acme/qa +0\.1\.0", ok(flywheel("env", "list")))

        config = tmp_path / "qa.toml"
        config.write_text(RUN_CONFIG.format(run="qa", env="acme/qa"))
        ok(flywheel("run", str(config), "--run-id", "qa", *settings, timeout=600, cwd=ROOT))
        evaluated = ok(flywheel("eval", "acme/qa", "--model", "qa@2", "-n", "4", "-r", "2", "--push", "--data-dir",
                                str(data), "--nats-port", str(ports["nats"]), "--inference-port",
                                str(ports["inference"]), *gateway, timeout=300))
        assert "pushed to the hub: acme/qa@0.1.0's leaderboard" in evaluated, evaluated
        assert re.search(r"^num_errors +0\b", evaluated, re.M), evaluated
        shown = ok(flywheel("env", "show", "acme/qa", *gateway))
        assert "leaderboard:" in shown and re.search(r"^qa@2 +0\.1\.0 ", shown, re.M), shown

        forked = ok(flywheel("env", "fork", "acme/qa", "bob/qa", "--dir", str(tmp_path / "forks"), *gateway))
        assert "pushed bob/qa@0.1.0, forked from acme/qa" in forked, forked
        fork_module = tmp_path / "forks" / "qa" / "bob_qa" / "__init__.py"
        assert 'normalize(task["answer"]) in normalize(completion)' in fork_module.read_text()  # the edited reward
        assert "forks: bob/qa" in ok(flywheel("env", "show", "acme/qa", *gateway))
        assert "forked from acme/qa@0.1.0" in ok(flywheel("env", "show", "bob/qa", *gateway))
        assert "bob/qa" not in ok(flywheel("env", "list"))

        config.write_text(RUN_CONFIG.format(run="on-fork", env="bob/qa"))
        ok(flywheel("run", str(config), "--run-id", "on-fork", *settings, timeout=600, cwd=ROOT))
        summary = json.loads((data / "runs" / "on-fork" / "summary.json").read_text())
        assert (summary["steps"], summary["env"]) == (2, "bob/qa@0.1.0"), summary  # pinned when registered
        assert re.search(r"bob/qa +0\.1\.0", ok(flywheel("env", "list")))  # installed by the run
    finally:
        stop_stack(up, output, data)


pytestmark = pytest.mark.slow
