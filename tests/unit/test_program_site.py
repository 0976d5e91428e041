"""A program's Python (and any Python it starts) sees the worker's packages and not the
interpreter's own package folders: a distribution's dist-packages (Debian's certifi points at
/etc/ssl, which a sandbox does not see) neither on the path nor in what its .pth files imported."""

from __future__ import annotations

import json
import site
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.runtime.environments import find_sandbox_python
from flywheel.runtime.programs import SITECUSTOMIZE

PROBE = """
import json, sys
import certifi
print(json.dumps({"path": sys.path, "certifi": certifi.__file__}))
"""


def test_the_interpreter_own_package_folders_are_off_the_path(tmp_path: Path) -> None:
    python = find_sandbox_python()
    if python is None:
        pytest.skip("no Python of this minor version under /usr")
    ours = [str(Path(d).resolve()) for d in site.getsitepackages()]
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE.format(site_dirs=ours, path=[str(tmp_path / "env")]))
    done = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, check=False,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    theirs = [p for p in seen["path"] if p.rstrip("/").endswith(("site-packages", "dist-packages")) and p not in ours]
    assert not theirs, seen["path"]
    # The environment's own folder ahead of the standard library and the worker's packages.
    where = seen["path"].index(str(tmp_path / "env"))
    assert where < min(seen["path"].index(d) for d in ours if d in seen["path"]), seen["path"]
    assert where < next(i for i, p in enumerate(seen["path"]) if p.endswith(f"python{sys.version_info[0]}."
                                                                            f"{sys.version_info[1]}"))
    assert any(seen["certifi"].startswith(d + "/") for d in ours), seen["certifi"]  # the worker's copy
