"""Hub environments installed for environment workers: each version in a folder of its own.

A hub environment (``owner/name[@version]``) a run names is installed, by whichever process
first needs it, into ``<data_dir>/environments/<owner-name>-<version>/`` (:func:`ensure`,
:func:`flywheel.sdk.hub.install`): its verified wheel, and the dependencies the services'
environment does not satisfy at the versions it pins. Never into the services' environment: a
package's files cannot shadow the platform's, and two versions of one environment, or one
pinning a library the services also use at another version, sit side by side. Its workers put
that folder first on their path (:class:`flywheel.runtime.environments.WorkerPool`). What is
read here is package metadata only: nothing of an environment is imported by its host.

An environment installed in the services' environment itself (the built-in ones, a package
being developed with ``pip install -e``) is used as it is: a run names what it develops.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from flywheel.contract.hub import ENTRY_POINT_GROUP, project_name
from flywheel.sdk.environment import OPENENV_PREFIX, VERIFIERS_PREFIX, EnvironmentNotInstalled, available

if TYPE_CHECKING:
    from flywheel.contract.config import RunConfig

log = logging.getLogger(__name__)

FOLDER = "environments"  # under the data dir


def root(data_dir: Path) -> Path:
    """Where hub environments are installed for ``data_dir``'s stack."""
    return data_dir / FOLDER


def installed(data_dir: Path) -> dict[str, dict[str, Path]]:
    """Hub environments installed in folders of their own: id -> {version: folder}."""
    out: dict[str, dict[str, Path]] = {}
    folder = root(data_dir)
    if not folder.is_dir():
        return out
    for place in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for dist in importlib.metadata.distributions(path=[str(place)]):
            for ep in dist.entry_points:
                if ep.group == ENTRY_POINT_GROUP:
                    out.setdefault(ep.name, {})[dist.version] = place
    return out


def _newest(versions: dict[str, Any]) -> str:
    def order(v: str) -> tuple[int, Any]:
        try:
            return (1, Version(v))
        except InvalidVersion:
            return (0, v)

    return max(versions, key=order)


def find(env_id: str, data_dir: Path) -> Path | None:
    """The folder ``env_id`` (``owner/name[@version]``; no version: the newest) is installed in, if any."""
    name, _, version = env_id.partition("@")
    versions = installed(data_dir).get(name, {})
    if not versions:
        return None
    return versions.get(version or _newest(versions))


def ensure(env_id: str, data_dir: Path, sha256: str | None = None, gateway_url: str | None = None
           ) -> Path | None:
    """The folder a worker of ``env_id`` puts first on its path: None for a module name or an
    environment the services' environment holds at that version; else its folder of its own,
    installed from the hub (at ``gateway_url``; default: the settings') when missing, the wheel
    checked against ``sha256`` when the run pinned one. EnvironmentNotInstalled saying why when
    it cannot be."""
    if bridged_kind(env_id) is not None:
        return bridged_folder(env_id, data_dir)
    if "/" not in env_id:
        return None
    name, _, version = env_id.partition("@")
    have = available().get(name)
    if have is not None and (not version or have == version):
        return None
    found = find(env_id, data_dir)
    if found is not None:
        return found
    # imported here: the hub's HTTP client only when an environment is missing
    from flywheel.sdk.hub import Hub, HubError, install

    folder = root(data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)  # workers, users of their own, read what is installed here
    try:
        with Hub(gateway_url) as hub:
            env_id, version, _ = hub_version(hub, env_id)
            target = folder / f"{project_name(env_id)}-{version}"
            with open(folder / f".lock-{target.name}", "w") as lock:  # one install at a time, machine-wide
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not target.exists():
                    log.info("environment %s@%s: installing it from the hub at %s into %s", env_id, version, hub.url,
                             target)
                    install(f"{env_id}@{version}", hub, target, sha256, say=log.info)
    except (HubError, ValueError) as exc:
        raise EnvironmentNotInstalled(f"environment {env_id!r} is not installed here, nor could the hub install it: "
                                      f"{exc}") from exc
    return target


# --- environments of other formats (verifiers, OpenEnv) -------------------------------------------------

# prefix of their ids -> (the distribution such a package depends on, the module that shows it is there)
BRIDGED = {VERIFIERS_PREFIX: ("verifiers", "verifiers"), OPENENV_PREFIX: ("openenv-core", "openenv")}
MARKER = "flywheel-bridged.json"  # in such a package's folder: what was installed, written last


def bridged_kind(env_id: str) -> str | None:
    """The prefix of ``env_id`` when it names a package of another format (``verifiers:``, ``openenv:``)."""
    return next((prefix for prefix in BRIDGED if env_id.startswith(prefix)), None)


def bridged_place(prefix: str, name: str, data_dir: Path) -> Path:
    return root(data_dir) / f"{prefix.rstrip(':')}-{canonicalize_name(name)}"


def _importable(prefix: str, name: str) -> bool:
    """Whether the services' environment holds the format's package and ``name``'s module (one being developed)."""
    module = name.replace("-", "_").lower()
    try:
        return (importlib.util.find_spec(BRIDGED[prefix][1]) is not None
                and importlib.util.find_spec(module) is not None)
    except (ImportError, ValueError):
        return False


def bridged_folder(env_id: str, data_dir: Path) -> Path | None:
    """The folder a worker of ``verifiers:NAME`` or ``openenv:NAME`` puts first on its path: None
    where the services' environment holds the package and its format's; else its folder of its
    own (:func:`install_bridged`). EnvironmentNotInstalled saying how to install it when it is neither."""
    prefix = bridged_kind(env_id)
    assert prefix is not None
    name = env_id.removeprefix(prefix).partition("@")[0]
    folder = bridged_place(prefix, name, data_dir)
    if (folder / MARKER).is_file():
        return folder
    if _importable(prefix, name):
        return None
    raise EnvironmentNotInstalled(f"environment {env_id!r}: the package {name!r} is not installed here: flywheel env "
                                  f"install {prefix}<its package: a name, a wheel or a project folder> (into a folder "
                                  f"of its own, with {BRIDGED[prefix][0]})")


def install_bridged(prefix: str, spec: str, data_dir: Path, say: Any = log.info) -> tuple[str, Path]:
    """Install a package of another format (``prefix``: ``verifiers:`` for a verifiers taskset,
    ``openenv:`` for an OpenEnv environment; ``spec``: a requirement such as ``vf-echo==0.1``, a
    wheel, or a project folder) and what it needs that the services' environment does not
    satisfy (the format's own package, its pins: :func:`flywheel.sdk.hub.overlay`; wheels only, but
    a project folder, which is built), into a folder of its own; a second install of the same
    package replaces the first once the new one is whole. (its name, the folder)."""
    # imported here: the hub's HTTP client only for an install
    from flywheel.sdk.hub import HubError, output_tail, overlay

    needs = BRIDGED[prefix][0]
    path = Path(spec).expanduser()
    if path.is_dir():
        try:
            name = str(tomllib.loads((path / "pyproject.toml").read_text())["project"]["name"])
        except (OSError, KeyError, tomllib.TOMLDecodeError) as exc:
            raise EnvironmentNotInstalled(f"{spec}: a project folder to install has a pyproject.toml with [project] "
                                          f"name ({type(exc).__name__}: {exc})") from exc
        source = str(path.resolve())
    elif path.suffix == ".whl" and path.is_file():
        name, source = path.name.split("-")[0], str(path.resolve())
    else:
        try:
            name, source = Requirement(spec).name, spec
        except InvalidRequirement as exc:
            raise EnvironmentNotInstalled(f"{spec!r} is neither a package requirement, a wheel nor a project "
                                          f"folder: {exc}") from exc
    folder = bridged_place(prefix, name, data_dir)
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.parent.chmod(0o755)
    # Wheels only (no sdist's build backend runs here), but for a project folder the user names:
    # building their own package is what installing it means.
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-input", "--disable-pip-version-check",
           "--no-deps", "--target"]
    wheels_only = ["--only-binary", ":all:"]
    with open(folder.parent / f".lock-{folder.name}", "w") as lock, \
            tempfile.TemporaryDirectory(prefix=".installing-", dir=folder.parent) as scratch:
        fcntl.flock(lock, fcntl.LOCK_EX)
        target = Path(scratch) / "target"
        say(f"installing {name} ({source}) into {folder}")
        done = subprocess.run([*pip, str(target), *([] if path.is_dir() else wheels_only), source],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise EnvironmentNotInstalled(f"pip install {source} failed:\n{output_tail(done)}")
        dists = [d for d in importlib.metadata.distributions(path=[str(target)])
                 if canonicalize_name(d.metadata["Name"]) == canonicalize_name(name)]
        if not dists:
            raise EnvironmentNotInstalled(f"{source} installed no package named {name!r}")
        requires = [r for r in dists[0].requires or [] if (marker := Requirement(r).marker) is None
                    or marker.evaluate({"extra": ""})]
        if not any(canonicalize_name(Requirement(r).name) == needs for r in requires):
            raise EnvironmentNotInstalled(f"{name} does not depend on {needs}: it is not a {prefix.rstrip(':')} "
                                          "package (a Flywheel environment installs with flywheel env install "
                                          "owner/name)")
        try:
            needed = overlay(requires)
        except HubError as exc:
            raise EnvironmentNotInstalled(str(exc)) from exc
        if needed:
            done = subprocess.run([*pip, str(target), *wheels_only, *needed], capture_output=True, text=True,
                                  check=False)
            if done.returncode != 0:
                raise EnvironmentNotInstalled(f"pip install {' '.join(needed)} (what {name} needs) failed:\n"
                                              f"{output_tail(done)}")
        (target / MARKER).write_text(json.dumps({"package": name, "format": prefix.rstrip(":"), "source": source,
                                                 "version": dists[0].version, "installed": needed}) + "\n")
        target.chmod(0o755)  # environment workers run as users of their own: they read it
        old = Path(scratch) / "old"
        if folder.exists():
            folder.rename(old)
        target.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
    return name, folder


def hub_version(hub: Any, env_id: str) -> tuple[str, str, str]:
    """(env id, version, sha256) of ``env_id`` on ``hub`` (no version: its newest)."""
    name, record = hub.version(env_id)
    return name, str(record["version"]), str(record["sha256"])


def pin(cfg: RunConfig, data_dir: Path, gateway_url: str | None = None) -> RunConfig:
    """The run config with each ``owner/name[@version]`` it names (environments and evals) that
    the services' environment does not hold at that version pinned to a version on the hub (at
    ``gateway_url``; default: the settings') and installed in its folder: its id becomes
    ``owner/name@version`` (the newest, when none is given) and ``hub_pins`` records its wheel's
    sha256, so every service of the run installs exactly that file. Ids the services'
    environment holds stay as they are (a package being developed is the one a run uses)."""
    ids = [*(env.id for env in cfg.environments), *(spec.id for spec in cfg.evals)]
    have = available()
    missing = sorted({i for i in ids if "/" in i and i not in cfg.hub_pins
                      and (have.get(i.partition("@")[0]) is None
                           or i.partition("@")[2] not in ("", have[i.partition("@")[0]]))})
    if not missing:
        return cfg
    # imported here: the hub's HTTP client only for a run naming a hub environment not installed
    from flywheel.sdk.hub import Hub, HubError

    pinned: dict[str, str] = {}
    pins = dict(cfg.hub_pins)
    try:
        with Hub(gateway_url) as hub:
            for env_id in missing:
                name, version, sha256 = hub_version(hub, env_id)
                pinned[env_id] = f"{name}@{version}"
                pins[pinned[env_id]] = sha256
                log.info("run %s: environment %s pinned to %s (sha256 %s) from the hub at %s", cfg.run, env_id,
                         pinned[env_id], sha256, hub.url)
    except (HubError, ValueError) as exc:
        raise EnvironmentNotInstalled(f"environments {', '.join(missing)}: not installed here, and the hub could "
                                      f"not pin them: {exc}") from exc
    for exact in pinned.values():
        ensure(exact, data_dir, pins[exact], gateway_url)
    update: dict[str, Any] = {"hub_pins": pins}
    if cfg.env is not None:
        update["env"] = pinned.get(cfg.env, cfg.env)
    update["envs"] = [e.model_copy(update={"id": pinned.get(e.id, e.id)}) for e in cfg.envs]
    update["evals"] = [e.model_copy(update={"id": pinned.get(e.id, e.id)}) for e in cfg.evals]
    return cfg.model_copy(update=update)
