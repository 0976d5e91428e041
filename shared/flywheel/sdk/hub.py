"""The environment hub's client: read it, download from it, install from it.

:class:`Hub` speaks the gateway's hub API (``/v1/hub``); :func:`install` downloads a
version's wheel, checks its sha256 against the hub's record (and against a pinned one) and
its content by the hub's rules (:mod:`flywheel.contract.hubpackage`), and installs that file
with pip, wheels only (its dependencies from pip's usual index): no install builds an sdist.
``flywheel env`` commands (:mod:`flywheel.ops.hub`) and the services, which install the hub
environments a run names (:mod:`flywheel.runtime.installs`: each version in a folder of its own,
never into the services' environment), use it. The gateway and the key come from the
settings (``gateway_url``; ``api_key``, else a deployment's ``service_token``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from flywheel.contract.hub import HubRefused, check_env_id
from flywheel.contract.hubpackage import check_wheel
from flywheel.sdk import gateway


class HubError(RuntimeError):
    """The hub refused a request, or a step of a push or an install failed; the message says why."""


def output_tail(done: subprocess.CompletedProcess[str], chars: int = 3000) -> str:
    return (done.stdout + done.stderr)[-chars:]


class Hub:
    """The gateway's hub API (``/v1/hub``), with the settings' gateway URL and key unless given."""

    def __init__(self, url: str | None = None, api_key: str | None = None, timeout_s: float = 120.0) -> None:
        # A service of a deployment that wants keys: its service token sees every tenant's.
        self.http = gateway.sync_client(url, api_key, timeout_s=timeout_s, service_token=True)
        self.url = str(self.http.base_url).rstrip("/")

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Hub:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise HubError(f"the gateway at {self.url} did not answer ({type(exc).__name__}: {exc}); is it up "
                           "(flywheel up, or the deployment's), and is gateway_url right?") from None
        if response.status_code >= 400:
            raise HubError(f"{method} {path}: {response.status_code}: {gateway.detail_of(response)}")
        return response

    def environment(self, env_id: str) -> dict[str, Any]:
        check_env_id(env_id)
        return self._call("GET", f"/v1/hub/environments/{env_id}").json()

    def environments(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/hub/environments").json()["items"]

    def push(self, env_id: str, version: str, files: list[Path], private: bool = False,
             forked_from: str | None = None) -> dict[str, Any]:
        form: dict[str, str] = {"version": version, "private": "true" if private else "false"}
        if forked_from:
            form["forked_from"] = forked_from
        uploads = [("files", (p.name, p.read_bytes(), "application/octet-stream")) for p in files]
        return self._call("POST", f"/v1/hub/environments/{env_id}/versions", data=form, files=uploads).json()

    def set_private(self, env_id: str, private: bool) -> dict[str, Any]:
        return self._call("PATCH", f"/v1/hub/environments/{env_id}", json={"private": private}).json()

    def download(self, url: str) -> bytes:
        return self._call("GET", url.split("#")[0]).content

    def push_eval(self, env_id: str, version: str, summary: dict[str, Any]) -> dict[str, Any]:
        body = {"version": version, "model": summary["model"], "num_tasks": summary["num_tasks"],
                "num_rollouts": summary["num_rollouts"], "reward_mean": summary.get("reward_mean"),
                "reward_stderr": summary.get("reward_stderr"),
                "pass_at": {k: v for k, v in summary.items() if k.startswith("pass@")},
                "prompt_tokens": summary.get("prompt_tokens", 0),
                "completion_tokens": summary.get("completion_tokens", 0),
                "summary": {k: v for k, v in summary.items() if k not in ("results",)}}
        return self._call("POST", f"/v1/hub/environments/{env_id}/evals", json=body).json()

    def evals(self, env_id: str, version: str | None = None) -> list[dict[str, Any]]:
        params = {"version": version} if version else {}
        return self._call("GET", f"/v1/hub/environments/{env_id}/evals", params=params).json()["items"]

    def version(self, spec: str) -> tuple[str, dict[str, Any]]:
        """``owner/name[@version]`` -> (env id, that version's record; the newest without ``@``)."""
        env_id, at, version = spec.partition("@")
        env = self.environment(env_id)
        if not env["versions"]:
            raise HubError(f"{env_id} has no version on the hub yet")
        if not at:
            return env_id, env["versions"][0]
        for row in env["versions"]:
            if row["version"] == version:
                return env_id, row
        known = ", ".join(row["version"] for row in env["versions"])
        raise HubError(f"{env_id}@{version} is not on the hub (its versions: {known})")


def install(spec: str, hub: Hub, folder: Path, sha256: str | None = None, say: Callable[[str], Any] = print
            ) -> tuple[str, str, str]:
    """Install ``owner/name[@version]`` from the hub into ``folder``, a folder of its own (an
    environment worker puts it first on its path; nothing is installed into this Python's
    environment): its wheel alone, checked against the hub's sha256 (and ``sha256`` when pinned)
    and by the hub's package rules, then what its dependencies need that this Python's
    environment does not hold (:func:`install_wheel`), all with ``--only-binary :all:``, so
    that no sdist is ever built. The folder appears whole or not at all. (env id, version, sha256)."""
    env_id, record = hub.version(spec)
    version = record["version"]
    if sha256 is not None and record["sha256"] != sha256:
        raise HubError(f"{env_id}@{version} on the hub has sha256 {record['sha256']}, not the pinned "
                       f"{sha256}: it is not the package the run was started with")
    wheels = [f for f in record["files"] if f["kind"] == "wheel"]
    if len(wheels) != 1:
        raise HubError(f"{env_id}@{version} has {len(wheels)} wheels on the hub ("
                       f"{', '.join(f['filename'] for f in record['files']) or 'no files'}); a hub environment "
                       "installs from its one wheel, never by building an sdist")
    (wheel,) = wheels
    data = hub.download(wheel["url"])
    found = hashlib.sha256(data).hexdigest()
    if found != record["sha256"]:
        raise HubError(f"{wheel['filename']}: downloaded sha256 {found}, the hub recorded {record['sha256']}; "
                       "not installed")
    try:
        contents = check_wheel(wheel["filename"], data, env_id, version)
    except HubRefused as exc:
        raise HubError(f"{exc}; not installed") from None
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".installing-", dir=folder.parent) as scratch:
        path = Path(scratch) / wheel["filename"]
        path.write_bytes(data)
        target = Path(scratch) / "target"
        say(f"installing {env_id} {version} ({wheel['filename']}, sha256 {found[:12]}...) into {folder}")
        install_wheel(path, contents.requires, target)
        target.chmod(0o755)  # environment workers run as users of their own: they read it
        target.rename(folder)
    return env_id, version, found


def install_wheel(wheel: Path, requires: Sequence[str], target: Path) -> None:
    """``wheel`` (checked already) into ``target`` (``pip install --target``), and, where this
    Python's environment does not satisfy its ``Requires-Dist`` lines (:func:`unsatisfied`),
    the packages that must be there first on the path for them to be met (:func:`overlay`: a
    verifiers package's pins, not a second copy of what the services hold); wheels only: no
    sdist is ever built."""
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-input", "--disable-pip-version-check",
           "--only-binary", ":all:", "--no-deps", "--target", str(target)]
    try:
        needed = overlay(requires) if unsatisfied(requires) else []
    except HubError as exc:
        raise HubError(f"pip install {wheel.name} failed (wheels only: a dependency with no wheel for this platform "
                       f"is not built from source): {exc}") from None
    for argv in ([*pip, str(wheel)], [*pip, *needed] if needed else None):
        if argv is None:
            continue
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise HubError(f"pip install {wheel.name} failed (wheels only: a dependency with no wheel for this "
                           f"platform is not built from source):\n{output_tail(done)}")


def unsatisfied(requires: Sequence[str]) -> list[str]:
    """Of a wheel's ``Requires-Dist`` lines, those this Python's environment does not satisfy (a
    version pinned elsewhere, a package not installed): what its own folder must hold. The
    platform itself (``flywheel-rl``) is always there."""
    out = []
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's, or another platform's
        if canonicalize_name(req.name) == "flywheel-rl":
            continue
        try:
            have = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            out.append(str(req))
            continue
        if not req.specifier.contains(have, prereleases=True):
            out.append(str(req))
    return out


def overlay(requires: Sequence[str]) -> list[str]:
    """The packages (``name==version``) a folder of its own must hold so that, first on the path
    ahead of this Python's environment, ``requires`` are met with all they depend on: pip resolves
    them as if nothing were installed (``--dry-run --report``); a package this environment holds
    at a version every requirement of it in that resolution accepts is left out (the worker
    imports the platform's copy), any other is kept at the version pip chose. So a folder holds
    what differs (verifiers and its pins), not a second copy of pydantic or numpy. Wheels only,
    as every install of a dependency here: no sdist is built. The platform (``flywheel-rl``) is
    left out, as in :func:`unsatisfied`."""
    requires = [r for r in requires if canonicalize_name(Requirement(r).name) != "flywheel-rl"]
    if not requires:
        return []
    with tempfile.TemporaryDirectory(prefix="flywheel-resolve-") as scratch:
        report = Path(scratch) / "report.json"
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-input",
                               "--disable-pip-version-check", "--only-binary", ":all:", "--dry-run",
                               "--ignore-installed", "--report", str(report), *requires],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise HubError(f"pip could not resolve {' '.join(requires)}:\n{output_tail(done)}")
        items = json.loads(report.read_text())["install"]
    wanted: dict[str, list[Requirement]] = {}
    for line in requires:
        req = Requirement(line)
        wanted.setdefault(canonicalize_name(req.name), []).append(req)
    for item in items:
        extras = set(item.get("requested_extras") or [])
        for line in item["metadata"].get("requires_dist") or []:
            req = Requirement(line)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras | {""}):
                continue
            wanted.setdefault(canonicalize_name(req.name), []).append(req)
    out = []
    for item in items:
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        key = canonicalize_name(name)
        if key == "flywheel-rl":
            continue
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = None
        if have is not None and all(r.specifier.contains(have, prereleases=True) for r in wanted.get(key, [])):
            continue
        out.append(f"{name}=={version}")
    return out
