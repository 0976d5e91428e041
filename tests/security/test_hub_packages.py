"""A hub that runs no one's code, against a real gateway process: what a publisher pushes
cannot run on whoever installs it.

Refused at push, with nothing stored: a wheel with a ``.pth`` file (its lines run at every
interpreter start) or a start-up module, any ``.data/`` folder (scripts on the PATH, data files
anywhere under the prefix), entry points outside ``flywheel.environments`` (console scripts,
other tools' plugins), a wheel not tagged ``py3-none-any`` (an installer that cannot take it
builds the sdist instead, running its build backend), an sdist alone, a RECORD that does not
match, and a METADATA bomb (a ~300 KB wheel whose METADATA inflates to 300 MB) with the
gateway's RSS bounded. An sdist stored for reading is never on the index, and the install path
builds no sdist: not the package's, not a dependency's, and refuses a stored wheel that breaks
a rule or would overwrite another package's modules.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from flywheel.contract.hubpackage import MAX_MEMBER_BYTES, MAX_METADATA_BYTES, MAX_README_BYTES
from flywheel.runtime.natsserver import NatsServer, free_port
from flywheel.sdk.hub import Hub, HubError, install
from tests.unit.test_hub import _digest, sdist, wheel

ENV = "acme/word-quiz"
BASE = "/v1/hub/environments"
BOMB_BYTES = 300 * 1000 * 1000  # METADATA inflated, as the issue's: 300 MB
RSS_BOUND_BYTES = 64 << 20  # what a push of the bomb may add to the gateway's peak RSS (it added ~3 GB)


@dataclass
class Gateway:
    url: str
    process: subprocess.Popen[bytes]

    def status(self, field: str) -> int:
        """A figure of the process's /proc status in bytes (VmRSS, VmHWM)."""
        text = Path(f"/proc/{self.process.pid}/status").read_text()
        match = re.search(rf"^{field}:\s+(\d+) kB$", text, re.M)
        assert match, text
        return int(match.group(1)) * 1024

    def reset_peak(self) -> None:
        """Start VmHWM afresh at the current RSS (Linux: clear_refs 5)."""
        Path(f"/proc/{self.process.pid}/clear_refs").write_text("5")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """``python -m flywheel_gateway api``, open (no keys), on a free port, with a nats-server of its own."""
    where = tmp_path_factory.mktemp("gateway")
    nats = NatsServer(where / "nats").start()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_") or k == "FLYWHEEL_NATS_SERVER_BIN"}
    env |= {"FLYWHEEL_NATS_URL": nats.url, "FLYWHEEL_DATA_DIR": str(where / "data"),
            "FLYWHEEL_GATEWAY_PORT": str(port), "FLYWHEEL_LOG_LEVEL": "WARNING"}
    process = subprocess.Popen([sys.executable, "-m", "flywheel_gateway", "api"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the gateway did not become healthy in 60 s"
            time.sleep(0.1)  # noqa: sleep - the polling interval of this bounded wait for the process
        yield Gateway(url, process)
    finally:
        process.terminate()
        process.wait(timeout=30)
        nats.stop()


def push(gateway: Gateway, *made: tuple[str, bytes], env_id: str = ENV, version: str = "0.1.0") -> httpx.Response:
    return httpx.post(f"{gateway.url}{BASE}/{env_id}/versions", data={"version": version},
                      files=[("files", (name, data, "application/octet-stream")) for name, data in made], timeout=60)


def refused(response: httpx.Response, *said: str) -> str:
    assert response.status_code == 422, response.text
    detail: str = response.json()["detail"]
    for part in said:
        assert part in detail, detail
    return detail


INFO = "acme_word_quiz-0.1.0.dist-info"
DATA = "acme_word_quiz-0.1.0.data"
EP = f"[flywheel.environments]\n{ENV} = acme_word_quiz:load_environment\n"


def with_member(made: tuple[str, bytes], name: str, content: bytes) -> tuple[str, bytes]:
    """The wheel with one more member, which its RECORD does not list."""
    buffer = io.BytesIO(made[1])
    with zipfile.ZipFile(buffer, "a") as archive:
        archive.writestr(name, content)
    return made[0], buffer.getvalue()


# case -> (the wheel, made when the case runs; what the refusal says besides the file's name)
HOSTILE: dict[str, tuple[Callable[[], tuple[str, bytes]], list[str]]] = {
    # Code at every interpreter start of the environment it is installed in.
    "a .pth at the root": (lambda: wheel(extra={"zz_hook.pth": b"import os; os.system('id > /tmp/owned')\n"}),
                           ["'zz_hook.pth'", ".pth file"]),
    "a .pth in the package": (lambda: wheel(extra={"acme_word_quiz/x.pth": b"import os\n"}),
                              ["'acme_word_quiz/x.pth'", ".pth file"]),
    "sitecustomize": (lambda: wheel(extra={"sitecustomize.py": b"import os\n"}),
                      ["'sitecustomize.py'", "every start"]),
    # Files outside the package: a command, data files under the prefix, purelib past the checks.
    ".data/scripts": (lambda: wheel(extra={f"{DATA}/scripts/python3": b"#!/bin/sh\nid\n"}),
                      [f"'{DATA}/scripts/python3'", "commands on the environment's PATH"]),
    ".data/data": (lambda: wheel(extra={f"{DATA}/data/bin/pip": b"#!/bin/sh\nid\n"}),
                   [f"'{DATA}/data/bin/pip'", "anywhere under the environment's prefix"]),
    ".data/headers": (lambda: wheel(extra={f"{DATA}/headers/x.h": b""}), [f"'{DATA}/headers/x.h'", "C headers"]),
    ".data/purelib": (lambda: wheel(extra={f"{DATA}/purelib/evil.pth": b"import os\n"}),
                      [f"'{DATA}/purelib/evil.pth'", "past the rules"]),
    "another distribution's metadata": (lambda: wheel(extra={"other-1.0.dist-info/entry_points.txt": b"[pytest11]\n"}),
                                        ["holds 2 .dist-info folders"]),
    "an egg-info": (lambda: wheel(extra={"other.egg-info/entry_points.txt": b"[console_scripts]\npip = os:system\n"}),
                    ["'other.egg-info/entry_points.txt'", "another distribution's metadata"]),
    "the platform's own package": (lambda: wheel(extra={"flywheel/__init__.py": b""}),
                                   ["'flywheel/__init__.py'", "the platform's own"]),
    # Entry points outside flywheel.environments.
    "console_scripts": (lambda: wheel(entry_points=EP + "[console_scripts]\npip = acme_word_quiz:load_environment\n"),
                        ["group 'console_scripts' (pip)", "no console_scripts"]),
    "gui_scripts": (lambda: wheel(entry_points=EP + "[gui_scripts]\nx = acme_word_quiz:load_environment\n"),
                    ["'gui_scripts'"]),
    "another tool's plugin": (lambda: wheel(entry_points=EP + "[pytest11]\nx = acme_word_quiz\n"), ["'pytest11'"]),
    "another tenant's id": (lambda: wheel(entry_points=EP + "bob/quiz = acme_word_quiz:load_environment\n"),
                            ["registers ['acme/word-quiz', 'bob/quiz']", "alone"]),
    # Wheels an installer may pass over for the sdist (whose build backend then runs).
    "a foreign tag": (lambda: wheel(tag="cp311-cp311-linux_x86_64"),
                      ["tagged cp311-cp311-linux_x86_64", "py3-none-any alone"]),
    "a universal tag": (lambda: wheel(tag="py2.py3-none-any"), ["tagged py2-none-any.py3-none-any"]),
    "a direct-reference dependency": (lambda: wheel(requires=["helper @ https://example.invalid/helper-1.0.tar.gz"]),
                                      ["Requires-Dist 'helper @ https://example.invalid/helper-1.0.tar.gz'",
                                       "direct reference"]),
    # An archive whose RECORD does not say what it holds.
    "an unlisted member": (lambda: with_member(wheel(), "acme_word_quiz/late.py", b"x = 1\n"),
                           ["'acme_word_quiz/late.py' is not in", "RECORD"]),
    "a member that does not match RECORD": (
        lambda: wheel(extra={"acme_word_quiz/a.py": b"x = 1\n"}, recorded={"acme_word_quiz/a.py": b"x = 2\n"}),
        ["'acme_word_quiz/a.py' does not match its line in"]),
    # Sizes, counted while inflating.
    "a member over its cap": (lambda: wheel(extra={"acme_word_quiz/tasks.jsonl": b"\0" * (40 << 20)},
                                            compression=zipfile.ZIP_DEFLATED),
                              ["'acme_word_quiz/tasks.jsonl'", "MAX_MEMBER_BYTES", str(MAX_MEMBER_BYTES)]),
    "a README over its cap": (lambda: wheel(extra={f"{INFO}/METADATA": (
        "Metadata-Version: 2.1\nName: acme_word_quiz\nVersion: 0.1.0\n\n" + "x" * (MAX_README_BYTES + 1)).encode()},
        compression=zipfile.ZIP_DEFLATED), ["description (the README)", "MAX_README_BYTES", str(MAX_README_BYTES)]),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_wheel_that_would_run_code_or_put_files_outside_its_package_is_refused(gateway: Gateway, case: str) -> None:
    make, said = HOSTILE[case]
    made = make()
    refused(push(gateway, made), made[0], *said)
    assert httpx.get(f"{gateway.url}{BASE}/{ENV}").status_code == 404  # nothing stored


def test_an_sdist_alone_is_refused_and_a_stored_one_is_never_on_the_index(gateway: Gateway, tmp_path: Path) -> None:
    env_id, project = "acme/stored-quiz", "acme_stored_quiz"
    refused(push(gateway, sdist(project), env_id=env_id), "holds 0 wheel(s) and 1 sdist(s)", "never builds an sdist")
    made = [wheel(project, env_id=env_id), sdist(project)]
    assert push(gateway, *made, env_id=env_id).status_code == 201
    # Kept for reading (a fork copies its source) ...
    detail = httpx.get(f"{gateway.url}{BASE}/{env_id}").json()
    (sdist_row,) = [f for f in detail["versions"][0]["files"] if f["kind"] == "sdist"]
    assert httpx.get(sdist_row["url"].split("#")[0]).content == made[1][1]
    # ... but the index lists the wheel alone, in both of its formats, so pip never sees the sdist.
    page = httpx.get(f"{gateway.url}/hub/simple/acme-stored-quiz/")
    assert made[0][0] in page.text and made[1][0] not in page.text, page.text
    as_json = httpx.get(f"{gateway.url}/hub/simple/acme-stored-quiz/",
                        headers={"Accept": "application/vnd.pypi.simple.v1+json"}).json()
    assert [f["filename"] for f in as_json["files"]] == [made[0][0]]
    # pip asked for the source finds none.
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-input",
                           "--disable-pip-version-check", "--no-binary", ":all:", "-d", str(tmp_path / "got"),
                           "--index-url", f"{gateway.url}/hub/simple/", "acme-stored-quiz"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0 and "No matching distribution" in done.stdout + done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "got").exists() or not any((tmp_path / "got").iterdir())


def metadata_bomb(inflated_bytes: int = BOMB_BYTES) -> tuple[str, bytes]:
    """An otherwise valid wheel whose METADATA's description inflates to ``inflated_bytes``
    (written and hashed in chunks: the test never holds it whole either)."""
    info, module = INFO, "acme_word_quiz"
    small = {f"{module}/__init__.py": b"def load_environment(**args): ...\n",
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
             f"{info}/entry_points.txt": f"[flywheel.environments]\n{ENV} = {module}:load_environment\n".encode()}
    head = b"Metadata-Version: 2.1\nName: acme_word_quiz\nVersion: 0.1.0\nSummary: a bomb\n\n"
    buffer = io.BytesIO()
    digest, written = hashlib.sha256(head), len(head)
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in small.items():
            archive.writestr(name, data)
        with archive.open(f"{info}/METADATA", "w") as out:
            out.write(head)
            chunk = b"A" * (8 << 20)
            while written < inflated_bytes:
                part = chunk[:inflated_bytes - written]
                out.write(part)
                digest.update(part)
                written += len(part)
        record = "".join(f"{name},sha256={_digest(data)},{len(data)}\n" for name, data in small.items())
        metadata_hash = "sha256=" + base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
        archive.writestr(f"{info}/RECORD", f"{record}{info}/METADATA,{metadata_hash},{written}\n{info}/RECORD,,\n")
    return "acme_word_quiz-0.1.0-py3-none-any.whl", buffer.getvalue()


def test_a_metadata_bomb_is_refused_with_the_gateway_rss_bounded(gateway: Gateway) -> None:
    name, data = metadata_bomb()
    assert len(data) < 400_000, len(data)  # ~300 KB on the wire
    # A first ordinary request, so what the process imports on first use is not counted.
    assert httpx.get(f"{gateway.url}{BASE}").status_code == 200
    gateway.reset_peak()
    before = gateway.status("VmRSS")
    detail = refused(push(gateway, (name, data)), f"'{INFO}/METADATA'", str(MAX_METADATA_BYTES),
                     "MAX_METADATA_BYTES")
    peak = gateway.status("VmHWM")
    print(f"gateway RSS before the push {before >> 20} MiB, peak during it {peak >> 20} MiB "
          f"(+{(peak - before) >> 20} MiB; bound +{RSS_BOUND_BYTES >> 20} MiB): {detail}")
    assert peak - before < RSS_BOUND_BYTES, (before, peak)
    assert httpx.get(f"{gateway.url}/healthz").status_code == 200  # and it keeps serving

    # Just under every cap (four files of 31 MiB, 124 MiB in all): taken, each member inflated
    # and hashed a chunk at a time, so the peak stays as bounded.
    big = {f"acme_big_quiz/part{i}.txt": b"\0" * (31 << 20) for i in range(4)}
    made = wheel("acme_big_quiz", env_id="acme/big-quiz", extra=big, compression=zipfile.ZIP_DEFLATED)
    del big
    gateway.reset_peak()
    before = gateway.status("VmRSS")
    assert push(gateway, made, env_id="acme/big-quiz").status_code == 201
    peak = gateway.status("VmHWM")
    print(f"a {len(made[1]) >> 10} KiB wheel inflating to 124 MiB, taken: RSS before {before >> 20} MiB, peak "
          f"{peak >> 20} MiB (+{(peak - before) >> 20} MiB)")
    assert peak - before < RSS_BOUND_BYTES, (before, peak)


# --- the install path -------------------------------------------------------------------------


EVIL_BACKEND = """\
import pathlib
pathlib.Path({marker!r}).write_text("the build backend ran")
raise RuntimeError("a dependency's sdist was built")
"""


def evil_sdist(folder: Path, marker: Path) -> Path:
    """``evil-dep 1.0`` as an sdist alone, whose in-tree build backend leaves ``marker`` when pip runs it."""
    root = "evil_dep-1.0"
    files = {f"{root}/PKG-INFO": b"Metadata-Version: 2.1\nName: evil-dep\nVersion: 1.0\n",
             f"{root}/pyproject.toml": b'[build-system]\nrequires = []\nbuild-backend = "backend"\n'
                                       b'backend-path = ["."]\n',
             f"{root}/backend.py": EVIL_BACKEND.format(marker=str(marker)).encode()}
    folder.mkdir()
    path = folder / f"{root}.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        for name, data in files.items():
            member = tarfile.TarInfo(name)
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
    return path


def test_install_never_builds_an_sdist(gateway: Gateway, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env_id, project = "acme/dep-quiz", "acme_dep_quiz"
    marker = tmp_path / "built"
    links = evil_sdist(tmp_path / "links", marker).parent
    assert push(gateway, wheel(project, env_id=env_id, requires=["evil-dep"]), env_id=env_id).status_code == 201
    # pip finds the dependency as that sdist alone.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    with Hub(gateway.url, api_key="") as hub, pytest.raises(HubError, match=r"(?s)pip install acme_dep_quiz-0\.1\.0-"
                                                                             r"py3-none-any\.whl failed.*evil-dep"):
        install(env_id, hub, tmp_path / "installed", say=lambda _: None)
    assert not marker.exists(), marker.read_text()  # the backend never ran
    done = subprocess.run([sys.executable, "-m", "pip", "show", "acme-dep-quiz"], capture_output=True, text=True,
                          check=False)
    assert done.returncode != 0 and not (tmp_path / "installed").exists()  # and nothing was installed


class StoredHub(Hub):
    """A hub serving one version as stored before its rules: ``files`` (name -> bytes) as is."""

    def __init__(self, files: dict[str, bytes]) -> None:
        super().__init__("http://127.0.0.1:9", api_key="")
        self.files = files

    def version(self, spec: str) -> tuple[str, dict[str, Any]]:
        rows = [{"filename": name, "kind": "wheel" if name.endswith(".whl") else "sdist",
                 "sha256": hashlib.sha256(data).hexdigest(), "url": f"/hub/files/{name}"}
                for name, data in self.files.items()]
        wheels = [r["sha256"] for r in rows if r["kind"] == "wheel"]
        return ENV, {"version": "0.1.0", "sha256": wheels[0] if wheels else "", "files": rows}

    def download(self, url: str) -> bytes:
        return self.files[url.rsplit("/", 1)[1]]


@pytest.mark.parametrize(("files", "said"), [
    (dict([sdist()]), r"has 0 wheels on the hub \(acme_word_quiz-0\.1\.0\.tar\.gz\).*never by building an sdist"),
    (dict([wheel(tag="cp311-cp311-linux_x86_64"), sdist()]), r"tagged cp311-cp311-linux_x86_64"),
    (dict([wheel(extra={"zz.pth": b"import os\n"})]), r"'zz\.pth' is a \.pth file"),
    (dict([wheel(entry_points=f"[flywheel.environments]\n{ENV} = acme_word_quiz:load_environment\n"
                              "[console_scripts]\nflywheel = acme_word_quiz:load_environment\n")]), r"console_scripts"),
])
def test_install_refuses_a_stored_wheel_that_breaks_a_rule_before_pip_runs(
        files: dict[str, bytes], said: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ran: list[list[str]] = []
    real_run = subprocess.run

    def run(argv: list[str], *args: Any, **kwargs: Any) -> Any:
        if "pip" in argv:
            ran.append(argv)
        return real_run(argv, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", run)
    with StoredHub(files) as hub, pytest.raises(HubError, match=said):
        install(ENV, hub, tmp_path / "installed", say=lambda _: None)
    assert ran == []
