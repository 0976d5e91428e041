"""Harbor task folders, read into :class:`HarborTask`: what the bridge needs of each, checked.

A Harbor task is a folder::

    instruction.md          the task as the agent reads it
    task.toml               [verifier] timeout_sec, env; [agent] timeout_sec; [environment] cpus,
                            memory_mb, docker_image, ...; [solution] env; [task] and [metadata] (not read)
    environment/            Dockerfile (or docker-compose.yaml) and the files it copies in
    tests/test.sh           the verifier: run after the agent, it writes /logs/verifier/reward.txt
                            (one number) or reward.json (named numbers)
    solution/solve.sh       the reference solution (optional)

Harbor runs a task in a container built from environment/, in the Dockerfile's WORKDIR (``/app``
in Harbor's templates), copies tests/ to ``/tests`` after the agent and runs ``bash
/tests/test.sh`` from the workdir. A Flywheel sandbox can write only ``/work`` and ``/tmp``, so
the bridge maps those paths: the workdir becomes ``/work`` (in the instruction and in the task's
text files), and ``/tests``, ``/logs`` and ``/solution`` become folders of a fresh staging folder
under ``/tmp`` when the verifier (or the solution) runs.

Of the Dockerfile, the last stage's ``WORKDIR``, ``ENV`` (values without ``$``) and ``COPY`` /
``ADD`` of files of environment/ into the workdir (heredocs included) are carried over; what is
not (``CMD``, copies from other stages, URLs or outside the workdir) is listed in the task's
``not_carried``. A Dockerfile with ``RUN`` steps means the task needs its image: environment/
is kept as a build context (``image_context``), which the docker sandbox backend builds.
Without a Dockerfile or compose file, every file of environment/ is put in the workdir, as
Harbor does.

A folder that is not a usable task is refused with :class:`EnvironmentLoadError`, naming the
folder and the file or field: no instruction.md, task.toml or tests/test.sh, a task.toml that
does not parse or has a field of the wrong type, a Windows or multi-step task, a Dockerfile
that copies a file environment/ does not have.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import shlex
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import msgspec
import pydantic

from flywheel.sdk.environment import EnvironmentLoadError
from flywheel.sdk.sandbox import WORKDIR, SandboxSpec, context_archive

HARBOR_WORKDIR = "/app"  # the workdir of Harbor's task templates, where a Dockerfile names none
# Harbor's fixed paths inside the container, staged under a fresh folder of /tmp here.
STAGED = ("/tests", "/logs", "/solution")
MAX_COMMAND_S = 3600.0  # the longest command a sandbox runs (ExecRequest.timeout_s)
# The largest build context a build request carries: a NATS message (1 MiB by default) holds it
# base64-encoded, with room for the rest of the request.
MAX_CONTEXT_BYTES = 700 * 1024
CACHE = "__pycache__"
COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")
ARCHIVE = re.compile(r"\.(tar|tar\.gz|tgz|tar\.bz2|tbz2|tar\.xz|txz)$")
HEREDOC = re.compile(r"<<(-?)([\"']?)(\w+)\2")
CANARY = re.compile(r"^(<!--.*canary.*-->|#.*canary.*)$", re.IGNORECASE)


@dataclass(frozen=True)
class File:
    data: bytes = field(repr=False)
    mode: int = 0o644  # permission bits


@dataclass(frozen=True)
class HarborTask:
    """One task folder, read at load. ``instruction`` and the text files are as the sandbox
    sees them (the workdir is ``/work``); ``/tests``, ``/logs`` and ``/solution`` are mapped
    when they are staged (:meth:`staged`)."""

    id: str  # the folder's name
    folder: Path
    instruction: str
    workdir: str  # Harbor's workdir, which is /work here
    files: dict[str, File]  # put in /work before the agent starts (path relative to it)
    env: dict[str, str]  # the Dockerfile's ENV: every command's environment
    tests: dict[str, File]  # tests/, test.sh among them
    solution: dict[str, File]  # solution/, empty when the task has none
    verifier_timeout_s: float
    verifier_env: dict[str, str]
    solution_env: dict[str, str]
    agent_timeout_s: float | None
    cpus: float | None
    memory_mb: int | None
    digest: str  # sha256 of the folder's files: a row made from another version is refused
    not_carried: tuple[str, ...] = ()
    runs: int = 0  # RUN steps of the Dockerfile's last stage
    # environment/ as a build context (a tar archive), where the task needs its image (RUN steps)
    image_context: bytes | None = field(default=None, repr=False)

    def notes(self, build_images: bool) -> tuple[str, ...]:
        """What is not carried over, as the task runs: with its image built, or without."""
        if not self.runs or build_images:
            return self.not_carried
        runs = f"{self.runs} RUN instruction{'s' * (self.runs > 1)}"
        return (*self.not_carried, f"environment/Dockerfile: {runs} not run (build_images=false)")

    def row(self) -> dict[str, Any]:
        return {"id": self.id, "instruction": self.instruction, "digest": self.digest}

    def sandbox_spec(self, base: SandboxSpec) -> SandboxSpec:
        """``base`` with the task's resources and environment."""
        spec = msgspec.structs.replace(base, env={**base.env, **self.env})
        if self.cpus is not None:
            spec = msgspec.structs.replace(spec, cpu=self.cpus)
        if self.memory_mb is not None:
            spec = msgspec.structs.replace(spec, memory_mb=self.memory_mb)
        return spec

    def staged(self, files: Mapping[str, File], root: str) -> dict[str, File]:
        """``files`` with Harbor's fixed paths mapped into ``root`` (a folder of /tmp)."""
        return {rel: rewrite(f, {path: root + path for path in STAGED}) for rel, f in files.items()}


# --- task.toml ------------------------------------------------------------------------------


class _Section(pydantic.BaseModel):
    # Harbor has many more fields; those this bridge acts on are typed, the rest are kept to
    # say what is not carried over.
    model_config = pydantic.ConfigDict(extra="allow")


class VerifierConfig(_Section):
    timeout_sec: float = pydantic.Field(600.0, gt=0, le=MAX_COMMAND_S)
    env: dict[str, str] = {}


class AgentConfig(_Section):
    timeout_sec: float | None = pydantic.Field(None, gt=0)


class EnvironmentConfig(_Section):
    os: Literal["linux"] = "linux"
    cpus: float | None = pydantic.Field(None, gt=0)
    memory_mb: int | None = pydantic.Field(None, gt=0)
    gpus: int | None = None
    docker_image: str | None = None
    env: dict[str, str] = {}
    mcp_servers: list[Any] = []
    healthcheck: dict[str, Any] | None = None


class SolutionConfig(_Section):
    env: dict[str, str] = {}


class TaskConfig(_Section):
    verifier: VerifierConfig = VerifierConfig()
    agent: AgentConfig = AgentConfig()
    environment: EnvironmentConfig = EnvironmentConfig()
    solution: SolutionConfig = SolutionConfig()


def field_name(loc: tuple[int | str, ...]) -> str:
    """``("verifier", "timeout_sec")`` as task.toml spells it: ``[verifier] timeout_sec``."""
    if len(loc) < 2:
        return ".".join(map(str, loc))
    return f"[{loc[0]}] " + ".".join(map(str, loc[1:]))


def read_config(folder: Path) -> tuple[TaskConfig, dict[str, Any]]:
    where = f"harbor_tasks: task folder {folder}"
    path = folder / "task.toml"
    if not path.is_file():
        raise EnvironmentLoadError(f"{where}: no task.toml (every Harbor task has one; an empty file will do)")
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise EnvironmentLoadError(f"{where}: task.toml does not parse: {exc}") from None
    try:
        config = TaskConfig.model_validate(raw)
    except pydantic.ValidationError as exc:
        problems = "; ".join(f"{field_name(e['loc'])}: {e['msg']} (given {e.get('input')!r})"
                             for e in exc.errors(include_url=False))
        raise EnvironmentLoadError(f"{where}: task.toml {problems}") from None
    if "steps" in raw:
        raise EnvironmentLoadError(f"{where}: task.toml [steps]: multi-step tasks are not carried over; split it "
                                   "into one task per step")
    return config, raw


def config_notes(config: TaskConfig, raw: Mapping[str, Any]) -> list[str]:
    """What the task asks of Harbor that this bridge does not do."""
    notes = []
    environment = config.environment
    if environment.docker_image:
        notes.append(f"[environment] docker_image {environment.docker_image!r} is not used")
    if environment.gpus:
        notes.append("[environment] gpus: the sandbox has none")
    if environment.mcp_servers:
        notes.append("[environment] mcp_servers are not started")
    if environment.healthcheck:
        notes.append("[environment] healthcheck is not run")
    if environment.env:
        notes.append(f"[environment] env (host variables {sorted(environment.env)}) is not passed")
    verifier = raw.get("verifier", {})
    if verifier.get("environment") or verifier.get("environment_mode") == "separate":
        notes.append("[verifier] environment: the verifier runs in the agent's sandbox, not a separate one")
    for section in ("agent", "verifier"):
        if raw.get(section, {}).get("user") is not None:
            notes.append(f"[{section}] user: one unprivileged user runs everything")
    return notes


def literal_env(env: Mapping[str, str], name: str, notes: list[str]) -> dict[str, str]:
    """``env`` less the values that name host variables (``${VAR}``), which are not resolved."""
    templated = sorted(k for k, v in env.items() if "${" in v)
    if templated:
        notes.append(f"{name}: {templated} name host variables and are not passed")
    return {k: v for k, v in env.items() if k not in templated}


# --- environment/ ---------------------------------------------------------------------------


def dockerfile_instructions(text: str) -> Iterator[tuple[str, str, list[str]]]:
    """(KEYWORD, arguments, heredoc bodies) of each instruction: comments dropped, continued
    lines joined."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not line or line.startswith("#"):
            continue
        while line.endswith("\\") and i < len(lines):
            nxt = lines[i].strip()
            i += 1
            if not nxt.startswith("#"):
                line = line[:-1] + " " + nxt
        keyword, args = (line.split(None, 1) + [""])[:2]
        bodies = []
        for dash, _, end in HEREDOC.findall(args) if keyword.upper() in ("RUN", "COPY", "ADD") else ():
            body = []
            while i < len(lines) and (lines[i].strip() if dash else lines[i].rstrip()) != end:
                body.append(lines[i].lstrip("\t") if dash else lines[i])
                i += 1
            i += 1
            bodies.append("\n".join(body) + "\n")
        yield keyword.upper(), args.strip(), bodies


def _split(args: str) -> list[str]:
    if args.startswith("["):
        try:
            parts = json.loads(args)
        except ValueError:
            parts = None
        if isinstance(parts, list) and all(isinstance(p, str) for p in parts):
            return parts
    return shlex.split(args)


def _env_pairs(args: str) -> list[tuple[str, str]]:
    first = args.split(None, 1)
    if first and "=" not in first[0]:  # the old form: ENV KEY value with spaces
        return [(first[0], first[1] if len(first) > 1 else "")]
    pairs = []
    for part in shlex.split(args):
        key, sep, value = part.partition("=")
        if sep:
            pairs.append((key, value))
    return pairs


@dataclass
class _Build:
    """What the last stage of a Dockerfile puts in the container, as far as this bridge follows it."""

    context: Path
    where: str
    workdir: str | None = None
    placed: dict[str, File] = field(default_factory=dict)  # absolute path in the container -> file
    folders: set[str] = field(default_factory=lambda: {"/"})  # known to be folders in the container
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def cwd(self) -> str:
        return self.workdir or "/"

    def mark(self, folder: str) -> None:
        """``folder`` and its parents are folders."""
        while folder not in self.folders:
            self.folders.add(folder)
            folder = posixpath.dirname(folder)

    def place(self, path: str, f: File) -> None:
        path = posixpath.normpath(path)
        self.placed[path] = f
        self.mark(posixpath.dirname(path))

    def set_workdir(self, path: str) -> None:
        self.workdir = posixpath.normpath(posixpath.join(self.cwd(), path))
        self.mark(self.workdir)

    def copy(self, keyword: str, args: str, bodies: list[str]) -> None:
        parts = _split(args)
        flags = [p for p in parts if p.startswith("--")]
        paths = [p for p in parts if not p.startswith("--")]
        if any(f.startswith("--from") for f in flags):
            self.notes.append(f"{keyword} {args}: files of another stage or image are not copied")
            return
        if not paths:
            return
        sources, dest = paths[:-1], posixpath.normpath(posixpath.join(self.cwd(), paths[-1]))
        if bodies:  # COPY <<EOF /path: the heredoc is the file
            self.place(dest, File(bodies[0].encode()))
            return
        into_folder = paths[-1].endswith("/") or len(sources) > 1 or dest in self.folders
        for source in sources:
            if re.match(r"[a-z]+://", source) or source.startswith("git@"):
                self.notes.append(f"{keyword} {source}: downloads are not made")
                continue
            if keyword == "ADD" and ARCHIVE.search(source):
                self.notes.append(f"ADD {source}: the archive is copied, not unpacked")
            matched = self._sources(source)
            for path in matched:
                if path.is_dir():
                    for rel, f in read_tree(path).items():
                        self.place(posixpath.join(dest, rel), f)
                else:
                    self.place(posixpath.join(dest, path.name) if into_folder or len(matched) > 1 else dest,
                               read_file(path))

    def _sources(self, source: str) -> list[Path]:
        pattern = source.lstrip("/") or "."
        if any(c in pattern for c in "*?["):
            matched = sorted(self.context.glob(pattern))
        else:
            matched = [self.context / pattern] if (self.context / pattern).exists() else []
        if not matched:
            raise EnvironmentLoadError(f"{self.where}: environment/Dockerfile copies {source!r}, which environment/ "
                                       "does not have")
        return matched


def read_environment(folder: Path, where: str) -> tuple[str, dict[str, File], dict[str, str], list[str], int]:
    """(workdir, files in it, ENV, notes, number of RUN steps) of the task's environment/ folder."""
    context = folder / "environment"
    dockerfile = context / "Dockerfile"
    notes = [f"environment/{name}: its services are not started" for name in COMPOSE_FILES
             if (context / name).is_file()]
    if not dockerfile.is_file():
        files = {rel: f for rel, f in read_tree(context).items() if rel not in COMPOSE_FILES}
        return HARBOR_WORKDIR, files, {}, notes, 0
    build = _Build(context, where)
    try:
        text = dockerfile.read_text()
    except UnicodeDecodeError as exc:
        raise EnvironmentLoadError(f"{where}: environment/Dockerfile is not UTF-8 text: {exc}") from None
    instructions = list(dockerfile_instructions(text))
    last_from = max((i for i, (keyword, _, _) in enumerate(instructions) if keyword == "FROM"), default=-1)
    num_runs = 0
    for keyword, args, bodies in instructions[last_from + 1:]:
        if keyword == "WORKDIR":
            build.set_workdir(_split(args)[0] if args else ".")
        elif keyword == "ENV":
            for key, value in _env_pairs(args):
                if "$" in value:
                    build.notes.append(f"ENV {key}: its value refers to other variables and is not set")
                else:
                    build.env[key] = value
        elif keyword in ("COPY", "ADD"):
            build.copy(keyword, args, bodies)
        elif keyword == "RUN":
            num_runs += 1
        elif keyword in ("CMD", "ENTRYPOINT"):
            build.notes.append(f"{keyword}: no process is started with the sandbox")
    workdir = build.workdir or HARBOR_WORKDIR
    files = {}
    for path, f in build.placed.items():
        rel = posixpath.relpath(path, workdir)
        if rel in (".", "..") or rel.startswith("../"):
            build.notes.append(f"environment/Dockerfile copies to {path}, outside the workdir {workdir}: not there")
        else:
            files[rel] = f
    return workdir, files, build.env, notes + build.notes, num_runs


# --- files and paths ------------------------------------------------------------------------


def read_file(path: Path) -> File:
    return File(path.read_bytes(), path.stat().st_mode & 0o777)


def read_tree(folder: Path) -> dict[str, File]:
    """Every file under ``folder`` (path relative to it, '/'-separated), in a stable order;
    Python's caches aside (an installed package has them, its source does not)."""
    if not folder.is_dir():
        return {}
    out = {}
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != CACHE)
        for name in sorted(n for n in names if not n.endswith(".pyc")):
            path = Path(root) / name
            out[path.relative_to(folder).as_posix()] = read_file(path)
    return out


def map_paths(text: str, mapping: Mapping[str, str]) -> str:
    """``text`` with each absolute path that starts with a key of ``mapping`` (a whole path
    component: ``/app`` and ``/app/x``, not ``/apple`` or ``x/app``) starting with its value."""
    if not mapping:
        return text
    keys = "|".join(re.escape(k) for k in sorted(mapping, key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w./~$-])({keys})(?![\w-]|\.\w)")
    return pattern.sub(lambda m: mapping[m.group(1)], text)


def rewrite(f: File, mapping: Mapping[str, str]) -> File:
    """A text file with its paths mapped; anything else as it is."""
    try:
        text = f.data.decode()
    except UnicodeDecodeError:
        return f
    return replace(f, data=map_paths(text, mapping).encode())


def strip_canary(text: str) -> str:
    """The instruction without its leading canary lines (comments that mark benchmark data),
    which Harbor does not show the agent either."""
    lines = text.split("\n")
    i = 0
    while i < len(lines) and CANARY.match(lines[i].strip()):
        i += 1
    while i and i < len(lines) and not lines[i].strip():
        i += 1
    return "\n".join(lines[i:])


def digest(folder: Path) -> str:
    """The files' paths and contents (not their modes, which an install may change)."""
    sha = hashlib.sha256()
    for rel, f in read_tree(folder).items():
        sha.update(f"{rel}\0{len(f.data)}\0".encode())
        sha.update(f.data)
    return sha.hexdigest()


# --- a task, a folder of tasks --------------------------------------------------------------


def read_task(folder: Path) -> HarborTask:
    """One task folder; :class:`EnvironmentLoadError` naming the folder and what to fix."""
    where = f"harbor_tasks: task folder {folder}"
    instruction_path = folder / "instruction.md"
    if not instruction_path.is_file():
        raise EnvironmentLoadError(f"{where}: no instruction.md (the task as the agent reads it)")
    try:
        instruction = strip_canary(instruction_path.read_text())
    except UnicodeDecodeError as exc:
        raise EnvironmentLoadError(f"{where}: instruction.md is not UTF-8 text: {exc}") from None
    config, raw = read_config(folder)
    tests = read_tree(folder / "tests")
    if "test.sh" not in tests:
        raise EnvironmentLoadError(f"{where}: no tests/test.sh (the verifier, which writes the reward)")
    workdir, files, env, notes, num_runs = read_environment(folder, where)
    image_context = None
    if num_runs:  # the task needs its image: what RUN installs is there only once built
        try:
            image_context = context_archive(folder / "environment")
        except ValueError as exc:
            raise EnvironmentLoadError(f"{where}: environment/ cannot be sent as a build context: {exc}") from None
        if len(image_context) > MAX_CONTEXT_BYTES:
            raise EnvironmentLoadError(f"{where}: environment/ is {len(image_context) // 1024} KiB as a build "
                                       f"context, over the {MAX_CONTEXT_BYTES // 1024} KiB one build request carries "
                                       "(a NATS message): move large data into the task's files another way, or "
                                       "build the image yourself and pass it as image")
    notes = config_notes(config, raw) + notes
    verifier_env = literal_env(config.verifier.env, "[verifier] env", notes)
    solution_env = literal_env(config.solution.env, "[solution] env", notes)
    to_work = {workdir: WORKDIR} if workdir != "/" else {}
    task = HarborTask(
        id=folder.name, folder=folder, instruction=map_paths(instruction, to_work), workdir=workdir,
        files={rel: rewrite(f, to_work) for rel, f in files.items()}, env=env,
        tests={rel: rewrite(f, to_work) for rel, f in tests.items()},
        solution={rel: rewrite(f, to_work) for rel, f in read_tree(folder / "solution").items()},
        verifier_timeout_s=config.verifier.timeout_sec, verifier_env=verifier_env, solution_env=solution_env,
        agent_timeout_s=config.agent.timeout_sec, cpus=config.environment.cpus,
        memory_mb=config.environment.memory_mb, digest=digest(folder), not_carried=tuple(notes), runs=num_runs,
        image_context=image_context)
    try:
        msgspec.convert(msgspec.structs.asdict(task.sandbox_spec(SandboxSpec())), SandboxSpec)
    except msgspec.ValidationError as exc:
        raise EnvironmentLoadError(f"{where}: task.toml [environment] cpus={task.cpus}, memory_mb={task.memory_mb}: "
                                   f"more than a sandbox takes ({exc})") from None
    return task


def is_task(folder: Path) -> bool:
    return (folder / "task.toml").is_file() or (folder / "instruction.md").is_file()


def task_folders(path: Path) -> list[Path]:
    """``path`` itself when it is a task folder, else its folders (hidden ones aside)."""
    if not path.is_dir():
        raise EnvironmentLoadError(f"harbor_tasks: {path} is not a folder: give a Harbor task folder or a folder of "
                                   "them")
    if is_task(path):
        return [path]
    folders = [p for p in sorted(path.iterdir()) if p.is_dir() and not p.name.startswith(".")]
    if not folders:
        raise EnvironmentLoadError(f"harbor_tasks: {path} holds no task folders (each has instruction.md, task.toml "
                                   "and tests/test.sh)")
    return folders


def read_tasks(path: str | Path) -> dict[str, HarborTask]:
    """The tasks at ``path`` (a task folder or a folder of them) by id, in folder order."""
    return {task.id: task for task in map(read_task, task_folders(Path(path).resolve()))}
