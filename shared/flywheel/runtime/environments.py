"""Environments in workers, from the host's side: the pool of workers, and environments loaded in them.

Every process that needs an environment (the inference service for harnesses, hooks and
prompts; the scorer for rewards; the orchestrator for tasks; the trainer for reference
answers; ``flywheel run`` and ``flywheel eval``) holds a :class:`WorkerPool`. It starts
:mod:`environment workers <flywheel.runtime.envworker>` in the sandbox of
:mod:`flywheel.runtime.isolation`, one kind per environment version and tenant (the pool's
``key``: a tenant's workers never run another tenant's rollouts), reuses them for every run
that needs that version, starts another when each one is busy (``max_calls`` calls, up to
``max_per_environment``), stops one idle for ``idle_s``, and kills one whose event loop stops
answering for ``unresponsive_s``. A worker that dies fails its calls, each with an error naming
the environment, the worker and its last words (a rollout or a score with that error; the
service goes on), and the next call starts a new one, which loads what the old one had.

:meth:`WorkerPool.load` gives a :class:`WorkerEnvironment`: what the host knows of the
environment (:class:`~flywheel.runtime.envworker.EnvironmentInfo`: its name, rewards and
weights, sampling defaults) and async methods for what runs in the worker: task rows, first
messages, reference answers, rollouts (:meth:`WorkerEnvironment.start_rollout`), rewards.

What a worker may ask of its host, and only for the rollouts it was given (``RolloutLink``;
a scored rollout for its rewards' sandboxes):

- ``post`` and ``http``: a request to the rollout's own model endpoint, a path under its base
  URL (no ``..``), nothing else;
- ``sandbox``: the sandbox service, on the rollout's behalf: sandboxes it makes are labelled
  with the rollout and metered to its run, their model URL (if any) is the rollout's own
  endpoint whatever the worker asked, and it may touch only the sandboxes it made;
- ``program``: a program harness's program, run for the rollout in a sandbox of its own
  (:mod:`flywheel.runtime.programs`), whose one way out is the rollout's endpoint.

And, for no rollout in particular, ``egress``: a request to an endpoint the run's config gives
the environment (an argument that is an http(s) URL: a user simulator's model, a judge), to
that URL or under its path and nothing else, made by the host with no credential of its own
(:mod:`flywheel.sdk.egress`). Whoever writes a run config chooses those URLs: pointing one at
a service inside a deployment lets the tenant's environment code call it from the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import site
import sys
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from flywheel.contract import events
from flywheel.contract.retry import WORKER_RESTART
from flywheel.contract.settings import WorkersSettings
from flywheel.runtime.channel import Channel, ChannelClosed, RemoteError
from flywheel.runtime.envworker import NUM_REWARD_THREADS, EnvironmentInfo, HookOutcome, LoadSpec, RewardOutcome
from flywheel.runtime.isolation import WORKDIR, Isolation, Limits, MiB, View, readable_by_others
from flywheel.runtime.isolation import sandbox_python as find_sandbox_python
from flywheel.sdk import sandbox as sandbox_sdk
from flywheel.sdk.environment import (
    Environment,
    EnvironmentLoadError,
    EnvironmentNotInstalled,
    EnvironmentVersionMismatch,
    Reward,
)
from flywheel.sdk.harness import ChatHarness, RolloutContext
from flywheel.sdk.hooks import FLAG_METRIC, Blocked
from flywheel.sdk.messages import message_dict
from flywheel.sdk.rollout import Ran, run_only

if TYPE_CHECKING:
    from flywheel.sdk.sandbox import SandboxClient

log = logging.getLogger(__name__)

PING_EVERY_S = 5.0  # how often the pool asks each worker's event loop for an answer
# Errors a worker's environment code raises that say the environment cannot be used as asked
# (raised again here as EnvironmentLoadError, so services treat them as they always did).
LOAD_ERRORS = frozenset({EnvironmentLoadError.__name__, EnvironmentNotInstalled.__name__,
                         EnvironmentVersionMismatch.__name__, "RewardError", "ModuleNotFoundError", "ImportError"})
WORKER_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKDIR, "LANG": "C.UTF-8", "TMPDIR": "/tmp",
              "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1"}


class WorkerError(RuntimeError):
    """A worker failed a call it was given: it died, was killed, or never started; the message
    names the environment, the worker and what it last said."""


def _safe_path(path: str) -> str:
    """``path`` (a request's path and query, below a rollout's base URL) when it stays below it."""
    if not isinstance(path, str) or not path.startswith("/") or path.startswith("//") or "\\" in path:
        raise ValueError(f"{path!r}: a path below the rollout's endpoint, starting with /")
    segments = urllib.parse.unquote(path.partition("?")[0]).split("/")
    if any(s in (".", "..") for s in segments):
        raise ValueError(f"{path!r}: no . or .. segments: a worker reaches its rollout's endpoint only")
    return path


@dataclass
class RolloutLink:
    """What a rollout running in a worker reaches through its host: ``base_url``, its own
    OpenAI-compatible endpoint (what a program in a sandbox reaches through the model relay), and
    the ways there: ``post(url, body) -> (status, body)`` for a chat call (a host with the
    endpoint in its own process), else ``http_client`` (an ``httpx.AsyncClient``); the sandbox
    service, if any; the run it meters to."""

    rollout_id: str
    run: str
    base_url: str = ""
    api_key: str = ""
    post: Callable[[str, bytes], Awaitable[tuple[int, bytes]]] | None = None
    http_client: Any = None
    sandbox: SandboxClient | None = None
    boxes: set[str] = field(default_factory=set)  # the sandboxes made on its behalf


class Process(Protocol):
    """A worker's process as its host sees it: a :class:`~flywheel.runtime.isolation.Sandboxed`."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def last_words(self) -> str: ...

    async def stop(self) -> None: ...


DEATH_WORDS_WAIT_S = 5.0  # a call whose worker's channel closed waits this long for the process's exit
EGRESS_MAX_BYTES = 64 * 2**20  # an answer to environment code's outside call, at most
EGRESS_TIMEOUT_S = 600.0  # a call of environment code to an endpoint its run's config names


def urls_in(value: Any) -> set[str]:
    """The http(s) URLs among ``value``'s strings (an environment's arguments, nested or not)."""
    if isinstance(value, str):
        parsed = urllib.parse.urlsplit(value)
        return {value} if parsed.scheme in ("http", "https") and parsed.netloc else set()
    if isinstance(value, Mapping):
        return set().union(*(urls_in(v) for v in value.values()))
    if isinstance(value, list | tuple):
        return set().union(*(urls_in(v) for v in value))
    return set()


def _under(url: str, allowed: str) -> bool:
    """Whether ``url`` is ``allowed`` or under its path: the same scheme and host and port, the path
    the same or below, and no ``..`` anywhere."""
    a, b = urllib.parse.urlsplit(url), urllib.parse.urlsplit(allowed)
    if (a.scheme, a.netloc.lower()) != (b.scheme, b.netloc.lower()) or ".." in urllib.parse.unquote(a.path).split("/"):
        return False
    base = b.path.rstrip("/")
    return a.path == base or a.path.startswith(base + "/") or (not base and a.path in ("", "/"))


HOP_HEADERS = frozenset({"host", "content-length", "connection", "transfer-encoding", "keep-alive", "upgrade"})


async def _forward(client: Any, url: str, args: Any, drop: set[str] | frozenset[str] = frozenset(),
                   add: Sequence[tuple[str, str]] = (), max_bytes: int | None = None) -> dict[str, Any]:
    """A worker's HTTP request (``args``: method, headers, body) made to ``url`` with ``client``: its
    hop-by-hop headers and ``drop`` left out, ``add`` added; the answer as the worker takes it, its
    body at most ``max_bytes`` (more: a ValueError naming the URL, read no further)."""
    headers = [(str(k), str(v)) for k, v in args.get("headers") or [] if str(k).lower() not in HOP_HEADERS | drop]
    request = client.build_request(str(args.get("method", "GET")), url, headers=[*headers, *add],
                                   content=bytes(args.get("body") or b""))
    response = await client.send(request, stream=True)
    try:
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            if max_bytes is not None and len(body) > max_bytes:
                raise ValueError(f"{url!r} answered more than {max_bytes} bytes; an environment takes no more")
    finally:
        await response.aclose()
    return {"status": response.status_code, "body": bytes(body),
            "headers": [[k, v] for k, v in response.headers.items()
                        if k.lower() not in ("content-length", "transfer-encoding", "content-encoding")]}


class WorkerProcess:
    """One running worker: its process, the channel on its stdin and stdout, what it has loaded, its links."""

    def __init__(self, pool: WorkerPool, key: tuple[str, ...], label: str, started: Process,
                 read_exactly: Callable[[int], Awaitable[bytes]], write: Callable[[bytes], Awaitable[None]]) -> None:
        self.pool, self.key, self.label, self.started = pool, key, label, started
        self.handles: dict[str, int] = {}  # by LoadSpec.key
        self.links: dict[str, RolloutLink] = {}
        self.in_flight = 0
        self.num_calls = 0
        self.last_used = time.monotonic()
        self.started_at = time.time()
        self.dead: str | None = None  # why, once it is
        self.egress: set[str] = set()  # the URLs its environments' arguments give (egress)
        self._egress_client: Any = None  # an httpx.AsyncClient, made on the first egress
        self.channel = Channel(read_exactly, write,
                               {"post": self._post, "http": self._http, "sandbox": self._sandbox,
                                "program": self._program, "egress": self._egress})
        self._serving = asyncio.ensure_future(self._serve())
        self._loading: dict[str, asyncio.Future[Any]] = {}

    @property
    def pid(self) -> int:
        return self.started.pid

    async def _serve(self) -> None:
        await self.channel.serve()
        if self._egress_client is not None:
            await self._egress_client.aclose()
        await self.started.wait()
        code = self.started.returncode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        words = self.started.last_words()
        self._died(f"{self.label} (pid {self.pid}) ended with {how}" + (f"; it last said: {words[-1500:]}"
                                                                       if words else ""))

    def _died(self, why: str) -> None:
        if self.dead is None:
            self.dead = why
            self.channel.close(why)
            self.pool.forget(self)
            for link in self.links.values():
                self.pool.release_boxes(link)

    async def call(self, op: str, args: Any) -> Any:
        """``op`` in the worker; :class:`WorkerError` when the worker is gone, the worker's own
        error otherwise (:class:`EnvironmentLoadError` for an environment that cannot be used)."""
        if self.dead is not None:
            raise WorkerError(self.dead)
        self.in_flight += 1
        self.num_calls += 1
        try:
            return await self.channel.call(op, args)
        except ChannelClosed:
            if self.dead is None:  # its stdout ended: the process's exit (status, last words) says why, shortly
                with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(self._serving), DEATH_WORDS_WAIT_S)
            raise WorkerError(self.dead or self.channel.closed or f"{self.label} is gone") from None
        except RemoteError as exc:
            if exc.kind in LOAD_ERRORS:
                raise EnvironmentLoadError(str(exc)) from None
            raise
        finally:
            self.in_flight -= 1
            self.last_used = time.monotonic()

    async def handle(self, spec: LoadSpec, key: str) -> tuple[int, EnvironmentInfo]:
        """The handle of ``spec`` (``key``: its :attr:`LoadSpec.key`) loaded in this worker
        (loaded now, once, if it is not)."""
        found = self.handles.get(key)
        if found is not None:
            return found, self.pool.infos[key]
        pending = self._loading.get(key)
        if pending is None:
            pending = self._loading[key] = asyncio.ensure_future(self.call("load", msgspec.to_builtins(spec)))
        try:
            answer = await asyncio.shield(pending)
        finally:
            if pending.done():
                self._loading.pop(key, None)
        if not isinstance(answer, dict) or not isinstance(answer.get("handle"), int):
            raise WorkerError(f"{self.label} answered a load with {answer!r}")
        info = msgspec.convert(answer.get("info"), EnvironmentInfo)
        self.egress |= urls_in(spec.args)
        self.handles[key] = answer["handle"]
        self.pool.infos.setdefault(key, info)
        return answer["handle"], info

    async def kill(self, why: str) -> None:
        self._died(why)
        await self.started.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await self._serving

    # --- what the worker may ask ------------------------------------------------------------

    def _link(self, rollout: Any) -> RolloutLink:
        link = self.links.get(rollout) if isinstance(rollout, str) else None
        if link is None:
            raise PermissionError(f"rollout {rollout!r} is not one this worker is running or scoring")
        return link

    async def _post(self, args: Any) -> dict[str, Any]:
        link = self._link(args.get("rollout"))
        url = link.base_url.rstrip("/") + _safe_path(args.get("path"))
        body = bytes(args.get("body") or b"")
        if link.post is not None:
            status, answer = await link.post(url, body)
            return {"status": status, "body": answer}
        response = await link.http_client.post(url, content=body, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {link.api_key}"})
        return {"status": response.status_code, "body": response.content}

    async def _http(self, args: Any) -> dict[str, Any]:
        link = self._link(args.get("rollout"))
        url = link.base_url.rstrip("/") + _safe_path(args.get("path"))
        # The rollout's own key, whatever the worker sent.
        return await _forward(link.http_client, url, args, drop={"authorization"},
                              add=[("Authorization", f"Bearer {link.api_key}")])

    async def _sandbox(self, args: Any) -> bytes | int:
        link = self._link(args.get("scope"))
        client = link.sandbox
        op = args.get("op")
        try:
            if client is None:
                raise sandbox_sdk.SandboxError("unavailable", f"no sandbox service for this rollout: "
                                                              f"{sandbox_sdk.NO_SERVICE}")
            if op == "destroy_by_label":
                labels = msgspec.json.decode(args.get("request") or b"{}", type=dict[str, str])
                return await client.destroy_by_label({**labels, sandbox_sdk.ROLLOUT_LABEL: link.rollout_id})
            message = self.pool.sandbox_requests(op, args.get("request"))
            message = self._scoped(op, message, link)
            reply = await client._request(op, message, float(args.get("timeout_s") or client.request_timeout_s),
                                          sandbox_sdk.instance_of(message.id) if hasattr(message, "id") else None)
        except sandbox_sdk.SandboxError as exc:
            return sandbox_sdk.encode(sandbox_sdk.ErrorReply(kind=exc.kind, error=exc.error))
        if op == "create":
            link.boxes.add(reply.id)
        elif op == "destroy":
            link.boxes.discard(message.id)
        return sandbox_sdk.encode(reply)

    def _scoped(self, op: str, message: Any, link: RolloutLink) -> Any:
        """``message`` as the host sends it for ``link``'s rollout: its own sandboxes only, labelled
        and metered to it, their model URL its own endpoint."""
        if op in ("create", "run"):
            spec = message.spec
            labels = {**spec.labels, sandbox_sdk.ROLLOUT_LABEL: link.rollout_id, sandbox_sdk.RUN_LABEL: link.run}
            model_url = spec.model_url
            if model_url is not None:
                if not link.base_url:
                    raise sandbox_sdk.SandboxError("invalid_request", "a reward's sandbox reaches no model: leave "
                                                                      "model_url unset")
                model_url = link.base_url
            spec = msgspec.structs.replace(spec, labels=labels, model_url=model_url)
            update: dict[str, Any] = {"spec": spec}
            if op == "create" and message.idempotency_key is not None:
                update["idempotency_key"] = f"{link.rollout_id}/{message.idempotency_key}"
            return msgspec.structs.replace(message, **update)
        if op == "build":  # makes no sandbox: the image is the service's, named by the context's hash
            return message
        if message.id not in link.boxes:
            raise sandbox_sdk.SandboxError("not_found", f"no sandbox {message.id} of rollout {link.rollout_id}")
        return message

    async def _egress(self, args: Any) -> dict[str, Any]:
        url = str(args.get("url") or "")
        if not any(_under(url, allowed) for allowed in self.egress):
            raise PermissionError(f"{url!r} is not an endpoint this environment's run config names (its arguments "
                                  f"give {sorted(self.egress) or 'no URL'}); environment code reaches nothing else")
        if self._egress_client is None:
            import httpx

            self._egress_client = httpx.AsyncClient(timeout=httpx.Timeout(EGRESS_TIMEOUT_S, connect=30.0),
                                                    follow_redirects=False, trust_env=False)
        return await _forward(self._egress_client, url, args, max_bytes=EGRESS_MAX_BYTES)

    async def _program(self, args: Any) -> dict[str, Any]:
        link = self._link(args.get("rollout"))
        return await self.pool.run_program(link, args)


def _editable_folders() -> list[str]:
    """The folders editable installs map packages to (setuptools' finders), which a worker must see."""
    found: list[str] = []
    for name, module in list(sys.modules.items()):
        mapping = getattr(module, "MAPPING", None) if name.startswith("__editable__") else None
        if isinstance(mapping, dict):
            found += [str(p) for p in mapping.values() if isinstance(p, str)]
    return found


@dataclass(frozen=True)
class Layout:
    """What a worker runs: the interpreter, the site folders (their ``.pth`` files processed),
    the other folders on its import path, and the view its sandbox gives it."""

    python: str
    site_dirs: tuple[str, ...]
    path: tuple[str, ...]
    view: View

    def argv(self) -> list[str]:
        """The worker's command line: its packages on the path, then :func:`flywheel.runtime.envworker.main`."""
        boot = (f"import sys, site\nfor d in {list(self.site_dirs)!r}: site.addsitedir(d)\n"
                f"sys.path[:0] = {list(self.path)!r}\n"
                "from flywheel.runtime.envworker import main\nmain()\n")
        return [self.python, "-I", "-S", "-B", "-c", boot]


def worker_layout(settings: WorkersSettings, hidden: Sequence[Path], extra: Sequence[str] = ()) -> Layout:
    """The layout of this process's workers: its own packages (site folders, editable installs,
    the folders on its import path but the working folder), ``extra`` first on the path (an
    environment's own install), the settings' ``read_only`` folders, ``hidden`` covered (the data dir)."""
    cwd = os.path.realpath(os.getcwd())
    base = os.path.realpath(sys.base_prefix)
    site_dirs = [os.path.realpath(d) for d in site.getsitepackages() if os.path.isdir(d)]
    # The working folder is on a service's path by accident (``python -m`` puts it there) and holds
    # the user's own files: a worker sees it only where PYTHONPATH names it.
    explicit = {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    path = []
    for entry in sys.path:
        real = os.path.realpath(entry or ".")
        if (not os.path.isdir(real) or (real == cwd and real not in explicit) or real in site_dirs or real == base
                or real.startswith(base + "/")):
            continue
        # A folder inside a site folder that a package added to this process's path (setuptools'
        # _vendor, once imported): ahead of the site folders in a worker, its old copies would
        # shadow the real packages (typing_extensions).
        if real not in explicit and any(real.startswith(d + "/") for d in site_dirs):
            continue
        path.append(real)
    path = [*extra, *path]
    if settings.isolation == "none":
        return Layout(sys.executable, tuple(dict.fromkeys(site_dirs)), tuple(dict.fromkeys(path)), View())
    python = find_sandbox_python()
    if python is None:
        raise RuntimeError(f"environment workers need a Python {sys.version_info[0]}.{sys.version_info[1]} under /usr "
                           "(the only host folder a worker sees besides its packages): install one (apt-get install "
                           f"python{sys.version_info[0]}.{sys.version_info[1]}), or run the services with one")
    privileged = os.geteuid() == 0
    given = [os.path.realpath(p) for p in settings.read_only if os.path.isdir(p)]
    # The root on the import path (a script run from /) would show workers every file: never.
    visible = [p for p in dict.fromkeys([*site_dirs, *path, *_editable_folders(), *given])
               if p != "/" and (not privileged or readable_by_others(p))]
    skipped = sorted(set(site_dirs + path + given) - set(visible))
    if "/" in skipped:
        log.warning("environment workers do not see / (it is on this process's import path): only the folders of "
                    "their packages")
        skipped.remove("/")
    if skipped:
        log.warning("environment workers cannot read %s (a folder above is closed to other users): their "
                    "packages are not visible to environments", ", ".join(skipped))
    view = View(read_only=tuple(visible), hidden=tuple(str(h) for h in hidden), disk_mb=settings.disk_mb)
    return Layout(python, tuple(d for d in site_dirs if d in visible), tuple(p for p in path if p in visible), view)


class WorkerPool:
    """The workers of one host process (see the module). ``name`` says whose (in process titles
    and errors); ``sandbox`` is the sandbox client rollouts' sandboxes go through (None: none)."""

    def __init__(self, settings: WorkersSettings, data_dir: Path, name: str = "flywheel",
                 sandbox: SandboxClient | None = None) -> None:
        self.settings = settings
        self.data_dir = data_dir.resolve()
        self.name = name
        self.sandbox = sandbox
        self.infos: dict[str, EnvironmentInfo] = {}  # by LoadSpec.key
        self._workers: dict[tuple[str, ...], list[WorkerProcess]] = {}
        self._starting: dict[tuple[str, ...], asyncio.Future[WorkerProcess]] = {}
        self._restarts: dict[tuple[str, ...], int] = {}
        self._isolation: Isolation | None = None
        self._layouts: dict[tuple[str, ...], Layout] = {}
        self._watch: asyncio.Task[None] | None = None
        self._programs: Any = None  # flywheel.runtime.programs.Programs, made on first use
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False

    # --- loading --------------------------------------------------------------------------------

    async def load(self, spec: LoadSpec, tenant: str = "", install_dir: str | None = None) -> WorkerEnvironment:
        """``spec`` loaded in a worker of its environment for ``tenant``; EnvironmentLoadError (the
        worker's message) when it cannot be. ``install_dir``: the environment's own install (its
        folder first on the worker's import path)."""
        key = (tenant, spec.function or spec.env_id.partition("@")[0], spec.env_id, install_dir or "")
        env = WorkerEnvironment(self, key, spec, spec.key, EnvironmentInfo(name=spec.env_id))
        await env.call("ping", None)  # a worker up, the spec loaded: its info is known
        env.info = self.infos[env.spec_key]
        return env

    def label(self, key: tuple[str, ...]) -> str:
        tenant, _, env_id, _ = key
        return f"environment worker of {env_id}" + (f" (tenant {tenant})" if tenant else "")

    # --- workers ------------------------------------------------------------------------------------

    async def worker(self, key: tuple[str, ...]) -> WorkerProcess:
        """The worker of ``key`` with the fewest calls in flight; one more is started when each is
        at ``max_calls`` (up to ``max_per_environment``), the first when there is none."""
        if self._closed:
            raise WorkerError(f"{self.name}'s environment workers are shut down")
        alive = self._workers.get(key, [])
        best = min(alive, key=lambda w: w.in_flight, default=None)
        s = self.settings
        if best is not None and (best.in_flight < s.max_calls or len(alive) >= s.max_per_environment):
            return best
        pending = self._starting.get(key)
        if pending is None:
            pending = self._starting[key] = asyncio.ensure_future(self._start(key))
        try:
            return await asyncio.shield(pending)
        finally:
            if pending.done():
                self._starting.pop(key, None)

    def _isolation_for(self) -> Isolation:
        if self._isolation is None:
            s = self.settings
            self._isolation = Isolation(s.isolation, uid_base=s.uid_base, num_uids=s.num_uids,
                                        cgroup_prefix=f"flywheel-workers-{self.name}")
        return self._isolation

    def layout(self, key: tuple[str, ...]) -> Layout:
        found = self._layouts.get(key)
        if found is None:
            extra = [key[3]] if key[3] else []
            found = self._layouts[key] = worker_layout(self.settings, [self.data_dir], extra)
        return found

    async def _start(self, key: tuple[str, ...]) -> WorkerProcess:
        label = self.label(key)
        failures = self._restarts.get(key, 0)
        if failures:  # a worker that keeps dying at start is not started in a tight loop
            await asyncio.sleep(WORKER_RESTART.delay_s(failures))
        s = self.settings
        worker = await self.start_worker(key, label)
        started = worker.started
        try:
            async with asyncio.timeout(s.start_timeout_s):
                await worker.call("ping", None)
        except (TimeoutError, WorkerError, RemoteError) as exc:
            self._restarts[key] = failures + 1
            code = None
            if not isinstance(exc, TimeoutError):  # a channel that closed: its process is gone, or going
                with contextlib.suppress(TimeoutError):
                    code = await asyncio.wait_for(started.wait(), 1.0)
            await worker.kill(f"{label} did not start: {exc}")
            words = started.last_words()
            if isinstance(exc, TimeoutError):
                how = f"did not answer within {s.start_timeout_s:g}s (workers.start_timeout_s)"
            elif code is not None:
                how = f"exited during start-up (code {code})"
            else:
                how = f"failed at start ({type(exc).__name__}: {exc})"
            raise WorkerError(f"{label} {how}" + (f": {words[-1500:]}" if words else "")) from None
        self._restarts.pop(key, None)
        self._workers.setdefault(key, []).append(worker)
        log.info("%s started (pid %d)", label, worker.pid)
        if self._watch is None:
            self._watch = asyncio.ensure_future(self._watch_workers())
        return worker

    async def start_worker(self, key: tuple[str, ...], label: str) -> WorkerProcess:
        """A worker of ``key`` started in its sandbox, its channel on the worker's stdin and stdout."""
        s = self.settings
        layout = self.layout(key)
        limits = Limits(memory_bytes=s.memory_mb * MiB, pids=s.pids, cpu=s.cpu)
        started = await self._isolation_for().start(layout.argv(), WORKER_ENV, layout.view, limits, name="worker")
        child = started.child

        async def write(data: bytes) -> None:
            child.stdin.write(data)
            await child.stdin.drain()

        return WorkerProcess(self, key, label, started, child.stdout.readexactly, write)

    def forget(self, worker: WorkerProcess) -> None:
        """``worker`` is gone: calls go to the others, or to a new one."""
        alive = self._workers.get(worker.key, [])
        if worker in alive:
            alive.remove(worker)
            if not self._closed:
                log.warning("%s", worker.dead)
        if not alive:
            self._workers.pop(worker.key, None)

    async def _watch_workers(self) -> None:
        """Stop workers idle past ``idle_s``; kill those whose loop does not answer within ``unresponsive_s``."""
        s = self.settings
        while not self._closed:
            await asyncio.sleep(PING_EVERY_S)
            now = time.monotonic()
            for worker in [w for ws in self._workers.values() for w in ws]:
                if worker.in_flight == 0 and not worker.links and now - worker.last_used > s.idle_s:
                    log.info("%s (pid %d): idle for %.0f s, stopped", worker.label, worker.pid, now - worker.last_used)
                    await worker.kill(f"{worker.label} was stopped after {s.idle_s:g}s idle")
                    continue
                try:
                    async with asyncio.timeout(s.unresponsive_s):
                        await worker.channel.call("ping", None)
                except TimeoutError:
                    await worker.kill(f"{worker.label} (pid {worker.pid}) did not answer for {s.unresponsive_s:g}s "
                                      "(its environment's code held its event loop) and was killed")
                except (ChannelClosed, RemoteError):
                    pass  # gone already: its own end says why

    def info(self) -> list[dict[str, Any]]:
        """Its live workers, for the service's heartbeat (``flywheel status``, the run page): each
        one's environment, tenant, pid, calls in flight and served, start time."""
        return [{"environment": env_id, "tenant": tenant, "pid": w.pid, "in_flight": w.in_flight,
                 "calls": w.num_calls, "started_at": w.started_at}
                for (tenant, _, env_id, _), workers in sorted(self._workers.items()) for w in workers]

    async def close(self) -> None:
        """Stop every worker (and the programs' sites); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()
        for pending in self._starting.values():
            pending.cancel()
        await asyncio.gather(*(w.kill(f"{w.label}: its host shut down")
                               for ws in list(self._workers.values()) for w in list(ws)), return_exceptions=True)
        if self._programs is not None:
            await self._programs.close()
        if self._isolation is not None:
            self._isolation.close()

    # --- what workers ask ---------------------------------------------------------------------------

    def release_boxes(self, link: RolloutLink) -> None:
        """Destroy the sandboxes still held for ``link``'s rollout (its worker is gone or it ended)."""
        if link.sandbox is None or not link.boxes:
            return
        client, boxes = link.sandbox, list(link.boxes)
        link.boxes.clear()

        async def destroy() -> None:
            for box in boxes:
                with contextlib.suppress(sandbox_sdk.SandboxError):
                    await client.destroy(box)

        self.background(destroy())

    def background(self, work: Awaitable[None]) -> None:
        """``work`` in the background, held until it is done."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @staticmethod
    def sandbox_requests(op: Any, data: Any) -> Any:
        types = {"create": sandbox_sdk.CreateRequest, "run": sandbox_sdk.RunRequest, "exec": sandbox_sdk.ExecRequest,
                 "write_file": sandbox_sdk.WriteFileRequest, "read_file": sandbox_sdk.ReadFileRequest,
                 "destroy": sandbox_sdk.DestroyRequest, "build": sandbox_sdk.BuildRequest}
        if op not in types:
            raise sandbox_sdk.SandboxError("invalid_request", f"no sandbox operation {op!r}")
        try:
            return msgspec.json.decode(bytes(data or b""), type=types[op])
        except (msgspec.DecodeError, TypeError) as exc:
            raise sandbox_sdk.SandboxError("invalid_request", f"{op}: {exc}") from None

    async def run_program(self, link: RolloutLink, args: Any) -> dict[str, Any]:
        from flywheel.runtime.programs import Programs  # imported here: the relay's HTTP parts for programs only

        if self._programs is None:
            self._programs = Programs(self.settings, self._isolation_for())
        worker_key = next((k for k, ws in self._workers.items() for w in ws if link.rollout_id in w.links), None)
        layout = self.layout(worker_key) if worker_key is not None else worker_layout(self.settings, [self.data_dir])
        result: dict[str, Any] = await self._programs.run(link, layout, args)
        return result


@dataclass
class WorkerEnvironment:
    """An environment loaded in workers of one key: what the host knows of it (``info``) and
    what it can ask. Its workers may come and go; each one loads ``spec`` when first asked."""

    pool: WorkerPool
    key: tuple[str, ...]
    spec: LoadSpec
    spec_key: str  # spec.key, made once
    info: EnvironmentInfo

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def weights(self) -> dict[str, float]:
        return self.info.weights

    @property
    def sampling(self) -> dict[str, Any]:
        return self.info.sampling

    @property
    def description(self) -> str:
        return self.info.description

    async def _on(self) -> tuple[WorkerProcess, int]:
        worker = await self.pool.worker(self.key)
        handle, _ = await worker.handle(self.spec, self.spec_key)
        return worker, handle

    async def call(self, op: str, args: dict[str, Any] | None) -> Any:
        """``op`` on this environment in one of its workers (``handle`` added)."""
        worker, handle = await self._on()
        return await worker.call(op, None if args is None else {"handle": handle, **args})

    async def load_tasks(self, num: int, seed: int = 0) -> list[dict[str, Any]]:
        rows = await self.call("tasks", {"num": num, "seed": seed})
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise EnvironmentLoadError(f"environment {self.name!r}: its task set gave {type(rows).__name__} rows, "
                                       "not JSON objects")
        return rows

    async def prompt_messages(self, task: Mapping[str, Any]) -> list[events.Message]:
        """The task's first messages; EnvironmentLoadError when the row does not fit its task set."""
        return msgspec.convert(await self.call("prompt", {"task": dict(task)}), list[events.Message])

    async def privileged_messages(self, tasks: Sequence[Mapping[str, Any]], context: str | None
                                  ) -> list[list[events.Message] | str]:
        """Each task's first messages with a privileged ``context`` first (None: without), or its error text."""
        answer = await self.call("privileged", {"tasks": [dict(t) for t in tasks], "context": context})
        return msgspec.convert(answer, list[list[events.Message] | str])

    async def references(self, tasks: Sequence[Mapping[str, Any]], contexts: Sequence[str | None] | None = None
                         ) -> list[tuple[list[events.Message], str]]:
        """Each task's first messages (with its context first, if any) and reference answer."""
        contexts = list(contexts) if contexts is not None else [None] * len(tasks)
        answer = await self.call("references", {"tasks": [dict(t) for t in tasks], "contexts": contexts})
        return msgspec.convert(answer, list[tuple[list[events.Message], str]])

    async def start_rollout(self, link: RolloutLink, first_messages: Sequence[events.Message] | None = None
                            ) -> WorkerRollout | HostedChat:
        """A rollout of this environment reaching ``link``, run in one of its workers; or, given the
        task's ``first_messages`` (its :meth:`prompt_messages`) and a plain chat harness with no
        hooks, run here (:class:`HostedChat`): the environment's own code has had its part."""
        turns = self.info.plain_chat_turns
        if first_messages is not None and turns is not None and not self.info.hooks:
            return HostedChat(self.name, turns, list(first_messages), link)
        worker, handle = await self._on()
        worker.links[link.rollout_id] = link
        return WorkerRollout(self, worker, handle, link)

    async def score(self, rollouts: Sequence[events.Rollout], names: Sequence[str], timeout_s: float,
                    links: Sequence[RolloutLink] = (), threads: int = NUM_REWARD_THREADS) -> list[list[RewardOutcome]]:
        """Per rollout, the outcome of each reward of ``names`` (in that order); each under
        ``timeout_s``, sync ones on the worker's ``threads`` threads (set by its first call)."""
        return await self._score("score", rollouts, names, timeout_s, links, threads)

    async def score_group(self, rollouts: Sequence[events.Rollout], names: Sequence[str], timeout_s: float,
                          links: Sequence[RolloutLink] = (), threads: int = NUM_REWARD_THREADS
                          ) -> list[list[RewardOutcome]]:
        """Group rewards ``names`` on the whole group: per rollout, each one's outcome."""
        return await self._score("score_group", rollouts, names, timeout_s, links, threads)

    async def _score(self, op: str, rollouts: Sequence[events.Rollout], names: Sequence[str], timeout_s: float,
                     links: Sequence[RolloutLink], threads: int) -> list[list[RewardOutcome]]:
        if not names or not rollouts:
            return [[] for _ in rollouts]
        worker, handle = await self._on()
        scopes = list(links) or [RolloutLink(r.id, r.run, sandbox=self.pool.sandbox) for r in rollouts]
        for link in scopes:
            worker.links[link.rollout_id] = link
        try:
            answer = await worker.call(op, {"handle": handle, "rollouts": [events.encode(r, events.MSGPACK)
                                                                           for r in rollouts],
                                            "names": list(names), "timeout_s": timeout_s, "threads": threads})
        finally:
            for link in scopes:
                worker.links.pop(link.rollout_id, None)
                self.pool.release_boxes(link)
        outcomes = msgspec.convert(answer, list[list[RewardOutcome]])
        if len(outcomes) != len(rollouts) or any(len(o) != len(names) for o in outcomes):
            raise WorkerError(f"{worker.label} answered {op} with the wrong number of outcomes")
        return [[_checked(o, name) for o, name in zip(row, names, strict=True)] for row in outcomes]


def _in_bounds(value: float) -> bool:
    return math.isfinite(value) and abs(value) <= events.SCORE_LIMIT


def _checked(outcome: RewardOutcome, name: str) -> RewardOutcome:
    """A worker's outcome as the host takes it: its own reward's, a finite value or an error."""
    if outcome.name != name:
        return RewardOutcome(name=name, error=f"the worker answered for {outcome.name!r}, not {name!r}")
    if outcome.error is None and (outcome.value is None or not _in_bounds(outcome.value)
                                  or not all(_in_bounds(v) for v in outcome.components.values())):
        return RewardOutcome(name=name, error=f"reward {name!r} gave {outcome.value!r} (components "
                                              f"{outcome.components}): not a finite number within "
                                              f"±{events.SCORE_LIMIT:g}")
    return outcome


class Hooks(Protocol):
    """An environment's hooks on the model calls of one rollout, as the interception endpoint and
    the eval proxy ask them (:class:`WorkerHooks`: in the rollout's worker)."""

    @property
    def flags(self) -> dict[str, int]:
        """Hook -> calls it flagged."""
        ...

    def __bool__(self) -> bool: ...

    async def before(self, messages: list[events.Message]) -> list[events.Message]:
        """The messages the model is given (raises :class:`flywheel.sdk.hooks.Blocked`)."""
        ...

    async def after(self, messages: list[events.Message], answer: events.Message) -> None: ...

    def metrics(self) -> dict[str, float]: ...


class WorkerHooks:
    """An environment's hooks on the model calls of one rollout running in a worker: the same
    questions as :class:`flywheel.sdk.hooks.CallHooks`, asked of that worker (async)."""

    def __init__(self, rollout: WorkerRollout) -> None:
        self.rollout = rollout
        self.flags: dict[str, int] = {}  # hook -> calls it flagged, known when the rollout ends

    def __bool__(self) -> bool:
        return self.rollout.env.info.hooks

    async def before(self, messages: list[events.Message]) -> list[events.Message]:
        """The messages the model is given (raises :class:`flywheel.sdk.hooks.Blocked`)."""
        answer = await self.rollout.worker.call("hook_before", {"rollout_id": self.rollout.link.rollout_id,
                                                                "messages": messages})
        outcome = msgspec.convert(answer, HookOutcome)
        if outcome.blocked is not None:
            raise Blocked(outcome.blocked_hook or "?", outcome.blocked)
        return messages if outcome.messages is None else outcome.messages

    async def after(self, messages: list[events.Message], answer: events.Message) -> None:
        await self.rollout.worker.call("hook_after", {"rollout_id": self.rollout.link.rollout_id,
                                                      "messages": messages, "answer": answer})

    def metrics(self) -> dict[str, float]:
        return {f"{FLAG_METRIC}{name}": float(n) for name, n in self.flags.items()}


def _unused() -> float:
    return 0.0


class HostedChat:
    """A rollout of a plain chat harness (:func:`flywheel.runtime.envworker.plain_chat_turns`), run by
    its host: the platform's :class:`~flywheel.sdk.harness.ChatHarness` from the task's first
    messages, which the environment's worker gave. Nothing of the environment's runs here, and a
    rollout costs no round trip to a worker. The same interface as :class:`WorkerRollout`."""

    hooks: WorkerHooks | None = None  # a plain chat is hosted only for an environment without hooks

    def __init__(self, name: str, turns: int, first_messages: list[events.Message], link: RolloutLink) -> None:
        # A stand-in that gives the harness the task's first messages; its row and reward are
        # never used (an Environment has at least one of each).
        self.env = Environment(name=name, tasks=[{}], rewards=[Reward(_unused, name="unused")],
                               harness=ChatHarness(max_turns=turns),
                               prompt=lambda task: [message_dict(m) for m in first_messages])
        self.link = link
        self._stop: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def run(self, task: Mapping[str, Any], *, model: str, index: int, timeout_s: float) -> Ran:
        link = self.link
        ctx = RolloutContext(task=dict(task), base_url=link.base_url, api_key=link.api_key, model=model, index=index,
                             timeout_s=timeout_s, http_client=link.http_client, post=link.post,
                             rollout_id=link.rollout_id, run=link.run)
        return await run_only(self.env, ctx, timeout_s, stop=self._stop)

    def stop(self, reason: str) -> None:
        """End the rollout now: its outcome is an error ``stopped: <reason>``."""
        if not self._stop.done():
            self._stop.set_result(reason)


@dataclass
class WorkerRollout:
    """One rollout of an environment, in the worker it runs in: :meth:`run` it once, :meth:`stop`
    it early; ``hooks`` are the environment's on its model calls."""

    env: WorkerEnvironment
    worker: WorkerProcess
    handle: int
    link: RolloutLink
    hooks: WorkerHooks = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.hooks = WorkerHooks(self)

    async def run(self, task: Mapping[str, Any], *, model: str, index: int, timeout_s: float) -> Ran:
        """Run the harness on ``task``; a worker that dies or does not end it within
        ``timeout_s`` (and a margin) gives an error outcome saying so."""
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s + max(10.0, timeout_s * 0.1)):
                answer = await self.worker.call("roll_out", {
                    "handle": self.handle, "rollout_id": self.link.rollout_id, "run": self.link.run,
                    "task": dict(task), "model": model, "index": index, "timeout_s": timeout_s,
                    "api_key": self.link.api_key})
            ran = msgspec.convert(answer["ran"], Ran)
            self.hooks.flags = msgspec.convert(answer.get("flags") or {}, dict[str, int])
            return ran
        except TimeoutError:
            return Ran(f"the environment worker did not end the harness within rollout_timeout_s={timeout_s:g}",
                       {}, False, time.monotonic() - started)
        except (WorkerError, RemoteError, msgspec.ValidationError, KeyError, TypeError) as exc:
            return Ran(f"environment worker failed: {exc}", {}, False, time.monotonic() - started)
        finally:
            self.worker.links.pop(self.link.rollout_id, None)
            self.env.pool.release_boxes(self.link)

    def stop(self, reason: str) -> None:
        """End the rollout now: its outcome is an error ``stopped: <reason>``."""
        async def stop() -> None:
            with contextlib.suppress(WorkerError, RemoteError):
                await self.worker.call("stop", {"rollout_id": self.link.rollout_id, "reason": reason})

        self.env.pool.background(stop())

