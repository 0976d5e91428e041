"""``convert``: Harbor task folders as a standalone environment package, ready to install or push
to an environment hub.

The package it writes (``dest``)::

    pyproject.toml      distribution OWNER-NAME; registers OWNER/NAME under flywheel.environments
    README.md           what it holds, how to evaluate it, what each task does not carry over
    PKG/__init__.py     load_environment(**args): harbor_tasks.load_environment on its own tasks
    PKG/tasks/ID/...    the task folders, copied as they are (package data)

``PKG`` is ``OWNER_NAME`` with '-' as '_'. The tasks are read (and refused, naming the folder
and the field, where they do not load) before anything is written, so a package that is
written loads. It loads where Flywheel is installed, which provides the ``harbor_tasks`` module
(the hub index serves environments, not the platform, so the package lists no dependency on it).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from flywheel.contract.hub import ENV_PART
from flywheel.contract.hubpackage import pyproject

from .folders import CACHE, read_tasks, task_folders

MODULE = '''\
"""{owner}/{name}: {num_tasks} Harbor tasks (the folders under tasks/) as a Flywheel environment.

Written by ``harbor_tasks.convert``: the harness, the verifier and what is not carried over
from Harbor are those of the ``harbor_tasks`` module. Keyword arguments go to
``harbor_tasks.load_environment`` (max_turns, command_timeout_s, memory_mb, disk_mb, network,
image).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import harbor_tasks
from flywheel.sdk.environment import Environment

TASKS = Path(__file__).with_name("tasks")


def load_environment(**args: Any) -> Environment:
    return harbor_tasks.load_environment(str(TASKS), name="{owner}-{name}", **args)
'''

README = '''\
# {owner}/{name}

{num_tasks} Harbor tasks as a Flywheel environment, written by `harbor_tasks.convert` from the
task folders under `{pkg}/tasks/`. Per rollout, the model works in the task's sandbox with a `bash`
tool; then the task's `tests/test.sh` runs there and the reward file it writes is the reward.

```sh
pip install .                    # registers {owner}/{name}
flywheel eval {owner}/{name} --model RUN_OR_MODEL -n {num_tasks} -r 4
```

In a run config: `env = "{owner}/{name}"`, and `[env_args]` for `harbor_tasks.load_environment`'s
arguments (`max_turns`, `command_timeout_s`, `memory_mb`, `disk_mb`, `network`, `image`).

## Tasks

{tasks}
'''


def convert(src: str | Path, dest: str | Path, owner: str, name: str, version: str = "0.1.0") -> Path:
    """Write the environment package ``OWNER/NAME`` of the Harbor tasks at ``src`` (a task folder
    or a folder of them) into the folder ``dest`` (new, or empty); returns ``dest``."""
    for field, value in (("owner", owner), ("name", name)):
        if not ENV_PART.fullmatch(value):
            raise ValueError(f"{field} {value!r}: use a lowercase letter, then up to 63 lowercase letters, digits, "
                             "'-' or '_'")
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ValueError(f"{dest} exists and is not an empty folder: choose another destination")
    tasks = read_tasks(src)
    pkg = f"{owner}_{name}".replace("-", "_")
    for folder in task_folders(Path(src).resolve()):
        shutil.copytree(folder, dest / pkg / "tasks" / folder.name, ignore=shutil.ignore_patterns(CACHE, "*.pyc"))
    lines = []
    for task in tasks.values():
        first = next((line.strip("# ") for line in task.instruction.splitlines() if line.strip()), "")
        lines.append(f"- `{task.id}`: {first[:100]}")
        if task.runs:
            lines.append(f"  - runs in the image its environment/Dockerfile builds ({task.runs} RUN step"
                         f"{'s' * (task.runs > 1)}): the docker sandbox backend; build_images=false runs it without")
        lines += [f"  - not carried over: {note}" for note in task.notes(build_images=False)]
    values = {"owner": owner, "name": name, "pkg": pkg, "version": version, "num_tasks": len(tasks)}
    (dest / "pyproject.toml").write_text(pyproject(
        owner, name, pkg, f"Harbor tasks as a Flywheel environment: {owner}/{name} ({len(tasks)} tasks).",
        ["tasks/**/*", "tasks/**/.*"], version))
    (dest / "README.md").write_text(README.format(**values, tasks="\n".join(lines)))
    (dest / pkg / "__init__.py").write_text(MODULE.format(**values))
    return dest
