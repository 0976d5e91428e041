"""``flywheel env init`` and ``flywheel env list`` as a user runs them: the scaffolded package
installs, registers its id, and passes its own tests as generated."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.ops.scaffold import scaffold


def flywheel(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flywheel.ops.cli", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=120, check=False)


@pytest.mark.long
def test_a_scaffolded_environment_installs_and_passes_its_own_tests(tmp_path: Path) -> None:
    made = flywheel("env", "init", "qa-env", "--owner", "acme", "--dir", str(tmp_path))
    assert made.returncode == 0, made.stderr
    folder = tmp_path / "qa-env"
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == [
        "README.md", "pyproject.toml", "qa_env/__init__.py", "qa_env/tasks.jsonl", "tests/test_qa_env.py"]
    # Installed into a folder of its own (the shared venv stays as it is), entry point included.
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q",
                    "--target", str(site), str(folder)], check=True, timeout=120)
    env = {**os.environ, "PYTHONPATH": str(site)}
    tested = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"], cwd=folder,
                            env=env, capture_output=True, text=True, timeout=120, check=False)
    assert tested.returncode == 0 and "5 passed" in tested.stdout, tested.stdout + tested.stderr
    listed = flywheel("env", "list", env=env)
    assert listed.returncode == 0 and "acme/qa-env" in listed.stdout and "flywheel/reverse-text" in listed.stdout
    again = flywheel("env", "init", "qa-env", "--dir", str(tmp_path))
    assert again.returncode == 1 and "exists already" in again.stderr


@pytest.mark.parametrize(("name", "owner", "message"), [
    ("Bad", "local", "NAME 'Bad': use a lowercase letter"),
    ("1env", "local", "NAME '1env'"),
    ("ok", "a/b", "--owner 'a/b'"),
])
def test_bad_names_are_refused(tmp_path: Path, name: str, owner: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        scaffold(name, tmp_path, owner=owner)
