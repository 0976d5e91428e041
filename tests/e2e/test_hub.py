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

from flywheel.contract.hubpackage import pyproject
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


def test_push_install_eval_fork_and_a_run_on_the_fork(tmp_path: Path, readable: Path,
                                                      clean_env: dict[str, str]) -> None:
    from flywheel.runtime.natsserver import free_port

    python = fresh_venv(readable / "fresh")  # its packages: what the workers of its stack see
    ports = {"nats": free_port(), "gateway": free_port(), "inference": free_port()}
    data = readable / "data"  # environment workers (users of their own) read what is installed there
    clean_env = clean_env | {"FLYWHEEL_DATA_DIR": str(data)}
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
        # The command the hub page prints, dependencies included, into a folder of nothing installed:
        # the package asks for nothing the hub index does not serve.
        pipped = subprocess.run([str(python), "-m", "pip", "install", "--only-binary", ":all:", "--no-input",
                                 "--disable-pip-version-check", "--target", str(tmp_path / "pipped"), "--index-url",
                                 f"http://127.0.0.1:{ports['gateway']}/hub/simple", "acme-qa"],
                                capture_output=True, text=True, timeout=300, check=False)
        assert pipped.returncode == 0, pipped.stdout[-2000:] + pipped.stderr[-2000:]
        assert (tmp_path / "pipped" / "qa" / "__init__.py").exists()

        assert "acme/qa" not in ok(flywheel("env", "list"))
        installed = ok(flywheel("env", "install", "acme/qa", *gateway))
        assert f"acme/qa is installed in {data / 'environments' / 'acme-qa-0.1.0'}" in installed, installed
        assert re.search(r"acme/qa +0\.1\.0 +.*acme-qa-0\.1\.0", ok(flywheel("env", "list")))

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


PINNED_MODULE = '''\
import fwpinlib

from flywheel.sdk.environment import Environment, Reward

WANTED = "{pin}"


def own_pin(completion: str) -> float:
    """1.0 when this version's worker imports the fwpinlib this version pins, whatever else is installed."""
    return float(fwpinlib.VERSION == WANTED)


def load_environment() -> Environment:
    return Environment(name="pinned_" + WANTED.replace(".", "_"), tasks=[{{"prompt": "hi"}}],
                       rewards=[Reward(own_pin)])
'''
TWO_VERSIONS = """\
run = "pins"
group_size = 2

[[envs]]
id = "acme/pinned@0.1.0"

[[envs]]
id = "acme/pinned@0.2.0"

[model]
name = "tiny"

[sampling]
max_tokens = 4

[sft]
steps = 0

[trainer]
batch_size = 4
num_steps = 8
"""


def fwpinlib_wheel(folder: Path, version: str) -> None:
    """``fwpinlib`` at ``version`` as a wheel in ``folder``: a library two environment versions pin differently."""
    import zipfile

    name = f"fwpinlib-{version}"
    files = {"fwpinlib/__init__.py": f'VERSION = "{version}"\n',
             f"{name}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: fwpinlib\nVersion: {version}\n",
             f"{name}.dist-info/WHEEL": ("Wheel-Version: 1.0\nGenerator: test\n"
                                                 "Root-Is-Purelib: true\nTag: py3-none-any\n")}
    files[f"{name}.dist-info/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{name}.dist-info/RECORD"])
    with zipfile.ZipFile(folder / f"{name}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


def test_two_versions_pinning_one_library_differently_train_in_one_run(readable: Path,
                                                                       clean_env: dict[str, str]) -> None:
    """acme/pinned 0.1.0 pins fwpinlib 1.0, 0.2.0 pins fwpinlib 2.0: pushed to the hub, named by one
    run ([[envs]]), installed each into a folder of its own with its own fwpinlib, each trained in
    its own workers, where each one's reward checks that it imports its own pin."""
    from flywheel.runtime.natsserver import free_port

    wheels = readable / "wheels"  # where pip finds fwpinlib (no index has it): these two wheels
    wheels.mkdir()
    for version in ("1.0", "2.0"):
        fwpinlib_wheel(wheels, version)
    env = clean_env | {"FLYWHEEL_DATA_DIR": str(readable / "data"), "PIP_FIND_LINKS": str(wheels)}
    ports = {"nats": free_port(), "gateway": free_port(), "inference": free_port()}
    data = readable / "data"
    settings = ["--data-dir", str(data), "--nats-port", str(ports["nats"]), "--gateway-port", str(ports["gateway"]),
                "--inference-port", str(ports["inference"])]
    gateway = ["--gateway-url", f"http://127.0.0.1:{ports['gateway']}"]

    def flywheel(*args: str, timeout: float = 300) -> str:
        done = subprocess.run([sys.executable, "-m", "flywheel.ops.cli", *args], capture_output=True, text=True,
                              env=env, cwd=ROOT, timeout=timeout, check=False)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        return done.stdout

    up = subprocess.Popen([sys.executable, "-m", "flywheel.ops.cli", "up", *settings], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=env)
    output = Output(up)
    try:
        output.wait_for(r"^Flywheel is up", READY_TIMEOUT_S)
        for version, pin in (("0.1.0", "1.0"), ("0.2.0", "2.0")):
            source = readable / f"pinned-{version}"
            (source / "acme_pinned").mkdir(parents=True)
            (source / "acme_pinned" / "__init__.py").write_text(PINNED_MODULE.format(pin=pin))
            (source / "README.md").write_text(f"Pins fwpinlib {pin}.\n")
            (source / "pyproject.toml").write_text(pyproject("acme", "pinned", "acme_pinned", "pins a library", [],
                                                             version, dependencies=[f"fwpinlib=={pin}"]))
            assert f"pushed acme/pinned@{version}" in flywheel("env", "push", str(source), *gateway)
        config = readable / "pins.toml"
        config.write_text(TWO_VERSIONS)
        flywheel("run", str(config), "--run-id", "pins", *settings, timeout=600)
    finally:
        stop_stack(up, output, data)
    summary = json.loads((data / "runs" / "pins" / "summary.json").read_text())
    assert summary["steps"] == 8, summary
    steps = [json.loads(line) for line in (data / "runs" / "pins" / "metrics.jsonl").read_text().splitlines()]
    for name in ("pinned_1_0", "pinned_2_0"):  # each version's reward: its own pin, in its own worker
        rewards = [s[f"env.{name}.reward_mean"] for s in steps if f"env.{name}.reward_mean" in s]
        assert rewards and set(rewards) == {1.0}, steps
    folders = sorted(p.name for p in (data / "environments").iterdir() if not p.name.startswith("."))
    assert folders == ["acme-pinned-0.1.0", "acme-pinned-0.2.0"], folders
    for folder, pin in zip(folders, ("1.0", "2.0"), strict=True):
        assert (data / "environments" / folder / "fwpinlib" / "__init__.py").read_text() == f'VERSION = "{pin}"\n'
    done = subprocess.run([sys.executable, "-m", "pip", "show", "fwpinlib"],
                          capture_output=True, text=True, check=False)
    assert done.returncode != 0  # nothing went into the services' environment
