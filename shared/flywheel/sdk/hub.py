"""The environment hub's client: read it, download from it, install from it.

:class:`Hub` speaks the gateway's hub API (``/v1/hub``); :func:`install` downloads a
version's wheel, checks its sha256 against the hub's record (and against a pinned one) and
its content by the hub's rules (:mod:`flywheel.contract.hubpackage`), and installs that file
with pip, wheels only (its dependencies from pip's usual index): no install builds an sdist.
``flywheel env`` commands (:mod:`flywheel.ops.hub`) and the services, which install the hub
environments a run names (:func:`flywheel.sdk.environment.resolve`), use it. The gateway and the key come from the
settings (``gateway_url``; ``api_key``, else a deployment's ``service_token``).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from flywheel.contract.hub import HubRefused, check_env_id, project_name
from flywheel.contract.hubpackage import Wheel, check_wheel


class HubError(RuntimeError):
    """The hub refused a request, or a step of a push or an install failed; the message says why."""


def output_tail(done: subprocess.CompletedProcess[str], chars: int = 3000) -> str:
    return (done.stdout + done.stderr)[-chars:]


class Hub:
    """The gateway's hub API (``/v1/hub``), with the settings' gateway URL and key unless given."""

    def __init__(self, url: str | None = None, api_key: str | None = None, timeout_s: float = 120.0) -> None:
        if url is None or api_key is None:
            from flywheel.contract.settings import Settings

            settings = Settings()
            url = url if url is not None else settings.resolved_gateway_url
            # A service of a deployment that wants keys: its service token sees every tenant's.
            api_key = api_key if api_key is not None else settings.api_key or settings.service_token
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

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
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise HubError(f"{method} {path}: {response.status_code}: {detail}")
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


def install(spec: str, hub: Hub, sha256: str | None = None, say: Callable[[str], Any] = print) -> tuple[str, str, str]:
    """Install ``owner/name[@version]`` from the hub: its wheel alone, checked against the hub's
    sha256 (and ``sha256`` when pinned) and by the hub's package rules, refused where it would
    overwrite or shadow a module another package installed, then given to pip with
    ``--only-binary :all:`` so that no sdist is ever built (the wheel's dependencies too come as
    wheels, from pip's usual index); (env id, version, sha256)."""
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
    python = sys.executable  # the environment pip installs into, and the one checked for clashes
    clashes = _clashes(python, project_name(env_id), contents)
    if clashes:
        raise HubError(f"{env_id}@{version} would overwrite or shadow what another package installed in {python}'s "
                       "environment, so its code would run where that package's is imported: " + "; ".join(clashes[:5])
                       + "; not installed (install it into an environment of its own)")
    with tempfile.TemporaryDirectory(prefix="flywheel-install-") as scratch:
        path = Path(scratch) / wheel["filename"]
        path.write_bytes(data)
        say(f"installing {env_id} {version} ({wheel['filename']}, sha256 {found[:12]}...)")
        done = subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-input", "--disable-pip-version-check",
                               "--only-binary", ":all:", str(path)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise HubError(f"pip install {wheel['filename']} failed (wheels only: a dependency with no wheel for this "
                       f"platform is not built from source):\n{output_tail(done)}")
    return env_id, version, found


# Run by the Python that pip installs with (isolated: no PYTHONPATH, no user site), so it sees
# what that environment holds: a path of the wheel's that exists there and is no file of this
# project's installed version, or a module of the wheel's that it imports from elsewhere (the
# standard library, an editable install, a .pth-added folder), is a clash.
_CLASHES = r"""
import importlib.metadata, importlib.util, json, re, sys, sysconfig
from pathlib import Path

asked = json.load(sys.stdin)
purelib = Path(sysconfig.get_paths()["purelib"])
own = [d for d in importlib.metadata.distributions(path=[str(purelib)])
       if re.sub(r"[-_.]+", "-", d.metadata["Name"] or "").lower() == asked["project"]]
own_files = {str(f) for d in own for f in d.files or []}  # PackagePath: posix, as RECORD
own_modules = {f.split("/")[0].split(".")[0] for f in own_files}
clashes = [f"{path} is there already ({purelib / path})" for path in asked["files"]
           if path not in own_files and (purelib / path).exists()]
for name in asked["modules"]:
    if name in own_modules:
        continue
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:
        clashes.append(f"module {name} does not resolve ({exc})")
        continue
    if spec is not None and spec.origin not in (None, "namespace"):
        clashes.append(f"module {name} is {spec.origin}")
print(json.dumps(clashes))
"""


def _clashes(python: str, project: str, wheel: Wheel) -> list[str]:
    asked = {"project": project, "files": [f for f in wheel.files if ".dist-info/" not in f],
             "modules": wheel.modules}
    done = subprocess.run([python, "-I", "-c", _CLASHES], input=json.dumps(asked), capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise HubError(f"checking what {python}'s environment holds failed:\n{output_tail(done)}")
    found: list[str] = json.loads(done.stdout)
    return found
