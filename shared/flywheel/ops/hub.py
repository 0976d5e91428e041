"""The environment hub from the user's side: push, install, fork, and evals on the hub.

``flywheel env push [DIR]`` reads ``DIR/pyproject.toml`` (its ``[project]`` name must be
``owner-name`` and it must register ``owner/name`` under the ``flywheel.environments`` entry
points), builds a wheel and an sdist with the standard tooling (``python -m build``), checks
them by the hub's rules (:func:`check_files`: a ``py3-none-any`` wheel that installs its own
modules alone, sizes; the gateway refuses the same), checks the built wheel in a process of its
own (installed into a scratch folder: what the package
holds, not what the source folder holds, is checked): :func:`dry_check` loads the environment
with its defaults, checks a few task rows against its schema, renders their prompts and runs
every reward on a rollout answering with the reference answer (or nothing); then uploads both
files, which the gateway checks again and stores, immutable.

``flywheel env push DIR --as owner/name`` takes a package of another format too, unmodified: a
verifiers taskset or an OpenEnv environment (its ``[project]`` depends on ``verifiers`` or
``openenv-core``). :func:`wrap` makes it a hub package: the modules its own wheel holds, as they
are, beside a module of the hub package's own whose ``load_environment(**args)`` runs it through
its bridge (``flywheel.sdk.verifiers_bridge``, ``flywheel.sdk.openenv_bridge``), its
dependencies (the format's library among them) and the ``owner/name`` entry point. Installed,
its folder holds what it needs that the services do not (:func:`flywheel.sdk.hub.overlay`);
its rewards run inside its episodes, so the push's dry check loads it and reads its tasks, and
scores nothing.

``flywheel env install owner/name[@version]`` is :func:`flywheel.sdk.hub.install`: the
version's wheel (the newest without ``@``), checked against the hub's sha256 and rules,
installed with pip, wheels only.

``flywheel env fork owner/name[@version] new-owner/new-name`` downloads the version's sdist
into a folder, renames it (distribution, entry point, and the module when the old name would
clash with the parent's once both are installed), and pushes it with its lineage
(``forked_from``); edit it and push new versions as usual.

The gateway and the key come from the settings (``gateway_url``, ``api_key``;
``FLYWHEEL_API_KEY``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from flywheel.contract import events
from flywheel.contract.hub import ENTRY_POINT_GROUP, HubRefused, check_env_id, check_version, project_name
from flywheel.contract.hubpackage import check_sdist, check_wheel
from flywheel.runtime.installs import BRIDGED
from flywheel.sdk.environment import FORMATS, load_environment
from flywheel.sdk.hub import Hub, HubError, install_wheel, output_tail
from flywheel.sdk.scoring import Scoring
from flywheel.sdk.tracegraph import rollout_from_messages

DRY_CHECK_ROWS = 3


@dataclass(frozen=True)
class Project:
    """An environment package's folder, as its pyproject.toml names it."""

    folder: Path
    env_id: str
    version: str
    module: str  # the entry point's module

    @property
    def project(self) -> str:
        return project_name(self.env_id)


def read_project(folder: Path) -> Project:
    """The environment a package folder holds; HubError naming the field to fix otherwise."""
    path = folder / "pyproject.toml"
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise HubError(f"{path}: not found; give the folder of an environment package (`flywheel env init` "
                       "makes one)") from None
    except tomllib.TOMLDecodeError as exc:
        raise HubError(f"{path}: not valid TOML ({exc})") from None
    project = data.get("project", {})
    registered = project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {})
    if len(registered) != 1:
        raise HubError(f"{path}: [project.entry-points.\"{ENTRY_POINT_GROUP}\"] registers "
                       f"{sorted(registered) or 'nothing'}; a package pushed to the hub registers exactly one "
                       "environment, \"owner/name\"")
    ((env_id, target),) = registered.items()
    try:
        check_env_id(env_id)
        version = check_version(str(project.get("version", "")))
    except HubRefused as exc:
        raise HubError(f"{path}: {exc}") from None
    wanted = project_name(env_id)
    if canonicalize_name(project.get("name", "")) != wanted:
        raise HubError(f"{path}: [project] name is {project.get('name')!r}; the package of {env_id} must be named "
                       f"{wanted!r} (the hub serves it under that name)")
    return Project(folder, env_id, version, str(target).split(":")[0].split(".")[0])


def build(project: Project, out: Path) -> list[Path]:
    """A wheel and an sdist of the folder, made by ``python -m build`` (an isolated build, as
    any builder makes them) into ``out``."""
    done = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(project.folder)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise HubError(f"building {project.folder} failed (python -m build):\n{output_tail(done)}")
    files = sorted(p for p in out.iterdir() if p.suffix == ".whl" or p.name.endswith(".tar.gz"))
    if not any(p.suffix == ".whl" for p in files):
        raise HubError(f"building {project.folder} made no wheel: {[p.name for p in files]}")
    return files


def check_files(project: Project, files: list[Path]) -> None:
    """The hub's rules on what it takes (:mod:`flywheel.contract.hubpackage`), applied to the
    built files before anything runs or is uploaded; HubError naming the file, the member and
    what to change otherwise."""
    for path in files:
        check = check_wheel if path.suffix == ".whl" else check_sdist
        try:
            check(path.name, path.read_bytes(), project.env_id, project.version)
        except HubRefused as exc:
            raise HubError(f"the hub would refuse what {project.folder} builds: {exc}") from None


def check_built(wheel: Path, env_id: str, scoring: bool = True) -> dict[str, Any]:
    """Install ``wheel`` into a scratch folder, as a worker's folder is installed (with what it
    requires that this environment lacks), and run :func:`dry_check` on it in a process of its
    own; its report, or HubError saying what failed."""
    requires = check_wheel(wheel.name, wheel.read_bytes(), env_id, wheel.name.split("-")[1]).requires
    with tempfile.TemporaryDirectory(prefix="flywheel-check-") as scratch:
        try:
            install_wheel(wheel, requires, Path(scratch))
        except HubError as exc:
            raise HubError(f"{wheel.name} does not install: {exc}") from None
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([scratch, *filter(None, [os.environ.get("PYTHONPATH")])])}
        argv = [sys.executable, "-m", "flywheel.ops.hub", "check", env_id] + ([] if scoring else ["--no-scoring"])
        done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=scratch, check=False)
    lines = done.stdout.strip().splitlines()
    try:
        report = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        report = None
    if done.returncode != 0 or not isinstance(report, dict):
        raise HubError(f"{wheel.name}: the check of {env_id} did not finish:\n{output_tail(done)}")
    if report.get("errors"):
        raise HubError(f"{wheel.name} does not pass its check, so it is not pushed:\n  " +
                       "\n  ".join(report["errors"]))
    return report


def dry_check(env_id: str, scoring: bool = True, num_rows: int = DRY_CHECK_ROWS) -> dict[str, Any]:
    """What a push checks of an installed environment: it loads with its defaults, a few task
    rows fit its schema and render as prompts, and (``scoring``) every reward runs on a rollout
    per row answering with the reference answer, or with nothing where it has none. A report:
    ``errors`` (empty when it passes), ``rows``, ``rewards`` (name -> values)."""
    errors: list[str] = []
    try:
        env = load_environment(env_id)
        rows = env.load_tasks(num_rows)
    except Exception as exc:  # the report names whatever the package's own code raised
        return {"errors": [f"load_environment({env_id!r}) with its defaults failed: {type(exc).__name__}: {exc}"],
                "rows": 0, "rewards": {}}
    rollouts = []
    for i, row in enumerate(rows):
        try:
            env.check_task(row)
            messages = env.prompt_messages(row)
            answer = env.reference_answer(row) if env.reference is not None else ""
        except Exception as exc:  # as above
            errors.append(f"task row {i}: {type(exc).__name__}: {exc}")
            continue
        rollouts.append(rollout_from_messages(run="hub-check", env=env.name, task_id=f"check-{i}", task_data=row,
                                              index=i, group_size=len(rows), messages=[
                                                  *messages, events.Message(role="assistant", content=answer)]))
    rewards: dict[str, list[float]] = {}
    if scoring and rollouts:
        scored = asyncio.run(Scoring().score_group(env._rewards(), rollouts))
        for rollout, scores in zip(rollouts, scored, strict=True):
            for score in scores:
                if score.error:
                    errors.append(f"task row {rollout.task_id.removeprefix('check-')}: {score.error}")
                rewards.setdefault(score.scorer, []).append(score.value)
    if not rows:
        errors.append("the environment has no task rows")
    return {"errors": errors, "rows": len(rows), "rewards": rewards}


# --- the commands ---------------------------------------------------------------------------


def push(folder: Path, hub: Hub, private: bool = False, scoring: bool = True, forked_from: str | None = None,
         say: Any = print, as_id: str | None = None) -> dict[str, Any]:
    """Build, check and upload the package in ``folder``; the hub's record of the version.
    ``as_id``: the hub id of a package of another format (verifiers, OpenEnv), wrapped first."""
    kind = bridged_format(folder)
    if kind is not None:
        if as_id is None:
            raise HubError(f"{folder} is a {kind.rstrip(':')} package: give the hub id it goes under (flywheel env "
                           "push DIR --as owner/name)")
        with tempfile.TemporaryDirectory(prefix="flywheel-wrap-") as scratch:
            wrapped = wrap(folder, as_id, Path(scratch), say=say)
            say(f"{kind.rstrip(':')} package: its rewards run inside its episodes, so the dry check scores nothing")
            return push(wrapped, hub, private=private, scoring=False, forked_from=forked_from, say=say)
    if as_id is not None:
        raise HubError(f"--as {as_id}: {folder} is a Flywheel environment package, whose pyproject.toml names its "
                       "id; --as is for a verifiers or OpenEnv package")
    project = read_project(folder)
    with tempfile.TemporaryDirectory(prefix="flywheel-push-") as out:
        say(f"building {project.env_id} {project.version} (python -m build) ...")
        files = build(project, Path(out))
        wheel = next(p for p in files if p.suffix == ".whl")
        check_files(project, files)
        say(f"checking {wheel.name}: load_environment, the task schema" + (", a dry scoring" if scoring else "") +
            " ...")
        report = check_built(wheel, project.env_id, scoring)
        say(f"  {report['rows']} task rows; rewards: " +
            (", ".join(f"{name} {values}" for name, values in report["rewards"].items()) or "not run"))
        say(f"uploading {', '.join(p.name for p in files)} to {hub.url} ...")
        return hub.push(project.env_id, project.version, files, private=private, forked_from=forked_from)


def fork(spec: str, new_id: str, hub: Hub, where: Path, private: bool = False, scoring: bool = True,
         say: Any = print) -> tuple[Path, dict[str, Any]]:
    """Copy ``owner/name[@version]``'s sdist into ``where/<new name>`` renamed to ``new_id``, and
    push it with its lineage; (the folder, the hub's record of the fork's version)."""
    _, new_name = check_env_id(new_id)
    env_id, record = hub.version(spec)
    folder = where / new_name
    if folder.exists():
        raise HubError(f"{folder} exists already: fork into another folder (--dir)")
    sdists = [f for f in record["files"] if f["kind"] == "sdist"]
    if not sdists:
        raise HubError(f"{env_id}@{record['version']} has no sdist (source) to fork from; its owner pushes one "
                       "with `flywheel env push`")
    data = hub.download(sdists[0]["url"])
    if hashlib.sha256(data).hexdigest() != sdists[0]["sha256"]:
        raise HubError(f"{sdists[0]['filename']}: the download does not match the hub's sha256")
    with tempfile.TemporaryDirectory(prefix="flywheel-fork-") as scratch:
        sdist = Path(scratch) / sdists[0]["filename"]
        sdist.write_bytes(data)
        with tarfile.open(sdist, "r:gz") as archive:
            archive.extractall(Path(scratch) / "src", filter="data")
        (root,) = list((Path(scratch) / "src").iterdir())
        for generated in [root / "PKG-INFO", *root.glob("*.egg-info")]:
            shutil.rmtree(generated) if generated.is_dir() else generated.unlink()
        where.mkdir(parents=True, exist_ok=True)
        shutil.copytree(root, folder)
    rename(folder, env_id, new_id)
    say(f"forked {env_id}@{record['version']} into {folder} as {new_id}")
    pushed = push(folder, hub, private=private, scoring=scoring, forked_from=f"{env_id}@{record['version']}",
                  say=say)
    return folder, pushed


def rename(folder: Path, old_id: str, new_id: str) -> None:
    """Rename a package folder's environment ``old_id`` to ``new_id``: the distribution, the
    entry point, the README's mentions, and the module when the new id's module name differs
    (so parent and fork install side by side)."""
    project = read_project(folder)
    pyproject = folder / "pyproject.toml"
    text = pyproject.read_text()
    text = re.sub(r'(?m)^(name\s*=\s*)"[^"]*"', lambda m: f'{m.group(1)}"{project_name(new_id)}"', text, count=1)
    text = text.replace(f'"{old_id}"', f'"{new_id}"')
    pyproject.write_text(text)
    new_module = new_id.replace("/", "_").replace("-", "_")
    old_module = project.module
    if (folder / old_module).is_dir() and old_module != new_module:
        (folder / old_module).rename(folder / new_module)
        old = re.escape(old_module)
        # The module's name where a package names it: quoted whole ("qa", "qa:load_environment",
        # "qa.sub"), as a package-data key, and in imports. Not every word "qa" in the text.
        quoted = re.compile(rf"""(["'])({old})([:.]|\1)""")
        key = re.compile(rf"(?m)^{old}(\s*=)")
        imports = re.compile(rf"(?m)^(\s*(?:from|import)\s+){old}\b")
        for path in [pyproject, *folder.rglob("*.py")]:
            text = quoted.sub(lambda m: f"{m.group(1)}{new_module}{m.group(3)}", path.read_text())
            path.write_text(imports.sub(rf"\g<1>{new_module}", key.sub(rf"{new_module}\1", text)))
        for path in (folder / "tests").glob(f"*{old_module}*.py") if (folder / "tests").is_dir() else []:
            path.rename(path.with_name(path.name.replace(old_module, new_module)))
    for path in [folder / "README.md", *folder.rglob("*.py")]:
        if path.is_file():
            path.write_text(path.read_text().replace(old_id, new_id))


# --- packages of other formats ----------------------------------------------------------------------

WRAPPED_PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = {project}
version = {version}
description = {description}
readme = "README.md"
requires-python = {python}
dependencies = {dependencies}

[project.entry-points."flywheel.environments"]
{env_id} = "{module}:load_environment"

[tool.setuptools]
py-modules = {py_modules}
include-package-data = true

[tool.setuptools.packages.find]
where = ["."]
include = {include}

[tool.setuptools.package-data]
"*" = ["*", "**/*"]
"""
WRAPPED_MODULE = """\
\"\"\"{env_id}: the {kind} package {name} {version}, unmodified, as a Flywheel environment.\"\"\"

from typing import Any

from flywheel.sdk.environment import Environment

NAME = {name!r}


def load_environment(**args: Any) -> Environment:
    from {bridge} import load_environment as bridged

    return bridged(NAME, **args)
"""


def bridged_format(folder: Path) -> str | None:
    """``verifiers:`` or ``openenv:`` when ``folder``'s pyproject.toml is a package of that format
    (it depends on the format's library and registers no Flywheel environment); else None."""
    try:
        project = tomllib.loads((folder / "pyproject.toml").read_text()).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return None
    if project.get("entry-points", {}).get(ENTRY_POINT_GROUP):
        return None
    names = {canonicalize_name(Requirement(line).name) for line in project.get("dependencies", [])
             if _is_requirement(line)}
    return next((prefix for prefix, (library, _) in BRIDGED.items() if library in names), None)


def _is_requirement(line: str) -> bool:
    try:
        Requirement(line)
    except InvalidRequirement:
        return False
    return True


def wrap(folder: Path, env_id: str, out: Path, say: Any = print) -> Path:
    """A hub package of the verifiers or OpenEnv package in ``folder``, written into ``out/<name>``:
    the modules its own wheel holds (built by its own build backend), unchanged, a module whose
    ``load_environment`` runs it through its bridge, its dependencies and README, ``env_id``'s
    distribution and entry point. The folder it wrote."""
    kind = bridged_format(folder)
    if kind is None:
        raise HubError(f"{folder}: not a verifiers or OpenEnv package (its [project] depends on neither verifiers "
                       "nor openenv-core)")
    try:
        owner, name = check_env_id(env_id)
    except HubRefused as exc:
        raise HubError(f"--as: {exc}") from None
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    try:
        version = check_version(str(project.get("version", "")))
    except HubRefused as exc:
        raise HubError(f"{folder / 'pyproject.toml'}: {exc}; the hub version is the package's own") from None
    built = out / "built"
    say(f"building {project['name']} {version} with its own build backend ...")
    done = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(built), str(folder)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise HubError(f"building {folder} failed (python -m build --wheel):\n{output_tail(done)}")
    (wheel,) = built.glob("*.whl")
    dest = out / name
    module = f"{owner}_{name}_{kind.rstrip(':')}".replace("-", "_")
    tops: set[str] = set()
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            top = member.split("/", 1)[0]
            if top.endswith((".dist-info", ".data")) or member.endswith("/"):
                continue
            if top.endswith(".pth"):
                raise HubError(f"{wheel.name} installs {member}, a .pth file (run at every interpreter start): the "
                               "hub takes no such package")
            tops.add(top)
            archive.extract(member, dest)
    if f"{module}.py" in tops or module in tops:
        raise HubError(f"{folder} has a module {module!r}, the name of the module its hub package adds: push it "
                       "under another id")
    (dest / f"{module}.py").write_text(WRAPPED_MODULE.format(env_id=env_id, kind=kind.rstrip(":"),
                                                             name=str(project["name"]), version=version,
                                                             bridge=FORMATS[kind]))
    given = project.get("readme", "README.md")  # a file's name, or a table naming one
    readme = folder / (given if isinstance(given, str) else str(given.get("file", "README.md")))
    intro = (f"# {env_id}\n\nThe {kind.rstrip(':')} package `{project['name']}` {version}, unmodified, as a "
             f"Flywheel environment: `env = \"{env_id}\"`; `[env_args]` are its bridge's ({FORMATS[kind]}).\n\n")
    (dest / "README.md").write_text(intro + (readme.read_text() if readme.is_file() else ""))
    packages = sorted(top for top in tops if not top.endswith(".py"))
    (dest / "pyproject.toml").write_text(WRAPPED_PYPROJECT.format(
        project=json.dumps(project_name(env_id)), version=json.dumps(version),
        description=json.dumps(f"{project['name']} {version} ({kind.rstrip(':')}) as a Flywheel environment"),
        python=json.dumps(str(project.get("requires-python", ">=3.11"))),
        dependencies=json.dumps(list(project.get("dependencies", []))), env_id=json.dumps(env_id), module=module,
        py_modules=json.dumps(sorted([module, *(top[:-3] for top in tops if top.endswith(".py"))])),
        include=json.dumps(sorted({*packages, *(f"{p}.*" for p in packages)}))))
    return dest


def main(argv: list[str]) -> int:
    """``python -m flywheel.ops.hub check ENV_ID [--no-scoring]``: :func:`dry_check`'s report,
    as the last line of output (JSON). What a push runs on the package it built."""
    if len(argv) < 2 or argv[0] != "check":
        print("usage: python -m flywheel.ops.hub check ENV_ID [--no-scoring]", file=sys.stderr)
        return 2
    report = dry_check(argv[1], scoring="--no-scoring" not in argv)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
