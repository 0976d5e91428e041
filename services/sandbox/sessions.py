"""Sessions: live sandboxes by id, their timeouts, the warm pool and the caps.

Three timeouts, each enforced on its own:

- ``ttl_s`` (spec): the sandbox is destroyed that long after it was created, even in the
  middle of an exec (which then fails with kind ``gone``);
- ``idle_ttl_s`` (spec): destroyed when no request has touched it for that long (a running
  exec counts as use);
- ``timeout_s`` (exec): the agent kills the command and all it started at the deadline;
  should the agent not answer within ``exec_grace_s`` (setting ``sandbox.exec_grace_s``)
  after it, the service kills the whole sandbox.

A sandbox that is gone (destroyed, expired, its processes killed) leaves a tombstone, so a
later request says why it is gone instead of "unknown". Caps: at most ``max_alive``
sandboxes handed out at once (a create beyond it is refused with kind ``capacity``), at most
``max_starting`` being started at once (the rest wait). The warm pool keeps ``warm_pool``
sandboxes of the default spec started, so a create of that spec (env, files and labels may
differ) only configures one. A spec with ``network=True`` is refused (kind
``invalid_request``) unless :attr:`ManagerConfig.allow_network` (setting
``sandbox_allow_network``) is on: any bus client may send a spec, so network is the service's
choice. Pool boxes never have network, and such a spec never takes one.

The caps, warm pool and network policy are the flat settings ``sandbox_*``; the limits on
output, files, the grace and the tombstones are the settings' ``sandbox`` section
(:class:`flywheel.contract.settings.SandboxSettings`). :class:`ManagerConfig` holds both, as
:func:`flywheel_sandbox.service.manager_config` reads them, and has no defaults of its own.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import msgspec

from flywheel.contract.bus import wait_at_most
from flywheel.contract.settings import SandboxSettings
from flywheel.runtime.isolation import AgentGone, decode_b64, encode_b64
from flywheel.runtime.relay import SOCKET_DIR, SOCKET_NAME
from flywheel.sdk.sandbox import (
    MODEL_PORT,
    WORKDIR,
    BuildRequest,
    Built,
    Created,
    Destroyed,
    ExecRequest,
    ExecResult,
    FileData,
    FileWritten,
    ReadFileRequest,
    RunRequest,
    SandboxError,
    SandboxSpec,
    WriteFileRequest,
    instance_token,
)
from flywheel_sandbox.backends import Backend, Box

MODEL_SOCKET = f"{SOCKET_DIR}/{SOCKET_NAME}"

log = logging.getLogger(__name__)


@dataclass
class ManagerConfig:
    """The session manager's caps (settings sandbox_max_alive, sandbox_max_starting,
    sandbox_warm_pool), network policy (sandbox_allow_network) and limits (section sandbox)."""

    max_alive: int
    max_starting: int
    warm_pool: int
    allow_network: bool  # off: a spec with network=True is refused
    limits: SandboxSettings


@dataclass
class Session:
    id: str
    spec: SandboxSpec
    box: Box
    created_at: float
    last_used: float
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    busy: bool = False
    key: str | None = None  # its idempotency key


class SessionManager:
    def __init__(self, backend: Backend, instance: str, config: ManagerConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.instance = instance_token(instance)
        self.config = config
        self.clock = clock
        self.sessions: dict[str, Session] = {}
        self.tombstones: OrderedDict[str, str] = OrderedDict()
        self.keys: dict[str, str] = {}  # idempotency key -> sandbox id
        self._creating: dict[str, asyncio.Future[Created]] = {}
        self._reserved = 0  # creates past the cap check, not yet in sessions
        self._starting = asyncio.Semaphore(self.config.max_starting)
        self._pool_spec = SandboxSpec()
        self._pool: deque[Box] = deque()
        self._pool_wanted = asyncio.Event()
        self._pool_filling = 0
        self._background: set[asyncio.Task[None]] = set()  # destroys and stops under way, held till done
        self.closed = False
        # Told of every sandbox destroyed, however (request, expiry, shutdown), with its seconds alive.
        self.on_destroyed: Callable[[Session, float], None] | None = None

    # --- lifecycle -----------------------------------------------------------------------

    async def maintain(self, stopping: asyncio.Event) -> None:
        """Reap expired sandboxes and keep the warm pool full until ``stopping``; then destroy all."""
        filler = asyncio.ensure_future(self._fill_pool(stopping))
        try:
            while not stopping.is_set():
                self.reap()
                await wait_at_most(stopping.wait(), self.config.limits.reap_interval_s)
        finally:
            filler.cancel()
            await asyncio.gather(filler, return_exceptions=True)
            await self.close("the sandbox service stopped")

    def reap(self) -> None:
        now = self.clock()
        for s in list(self.sessions.values()):
            if now >= s.created_at + s.spec.ttl_s:
                self._expire(s, f"its ttl_s={s.spec.ttl_s:g} passed")
            elif not s.busy and now >= s.last_used + s.spec.idle_ttl_s:
                self._expire(s, f"it was idle for idle_ttl_s={s.spec.idle_ttl_s:g}")
            elif not s.box.alive:
                self._expire(s, "its processes were killed from inside")

    def _expire(self, session: Session, reason: str) -> None:
        log.info("sandbox %s destroyed: %s", session.id, reason)
        self._in_background(self._destroy(session, reason))

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self, reason: str) -> None:
        self.closed = True
        await asyncio.gather(*(self._destroy(s, reason) for s in list(self.sessions.values())))
        boxes = list(self._pool)
        self._pool.clear()
        await asyncio.gather(*(b.stop() for b in boxes))

    async def _fill_pool(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            self._pool_wanted.clear()
            while (len(self._pool) + self._pool_filling < self.config.warm_pool
                   and len(self.sessions) + self._reserved < self.config.max_alive and not stopping.is_set()):
                self._pool_filling += 1
                try:
                    box = await self._start(self._pool_spec)
                except SandboxError as exc:
                    log.warning("warm pool: %s", exc)
                    await asyncio.sleep(1.0)  # back off before starting again after a failed start
                    break
                finally:
                    self._pool_filling -= 1
                self._pool.append(box)
            await self._pool_wanted.wait()

    async def _start(self, spec: SandboxSpec) -> Box:
        async with self._starting:
            return await self.backend.start(spec)

    def _take_pooled(self, spec: SandboxSpec) -> Box | None:
        if self.backend.pool_key(spec) != self.backend.pool_key(self._pool_spec):
            return None
        while self._pool:
            box = self._pool.popleft()
            self._pool_wanted.set()
            if box.alive:
                return box
            self._in_background(box.stop())
        self._pool_wanted.set()
        return None

    # --- requests ------------------------------------------------------------------------

    def get(self, sandbox_id: str) -> Session:
        session = self.sessions.get(sandbox_id)
        if session is not None:
            return session
        if sandbox_id in self.tombstones:
            raise SandboxError("gone", f"sandbox {sandbox_id} is gone: {self.tombstones[sandbox_id]}")
        raise SandboxError("not_found", f"no sandbox {sandbox_id!r} here: ids come from create, and a sandbox lives "
                                        "until destroy, its ttl_s or its idle_ttl_s")

    async def create(self, spec: SandboxSpec, idempotency_key: str | None = None) -> Created:
        self._check_network(spec)
        if idempotency_key is not None:
            known = self.keys.get(idempotency_key)
            if known in self.sessions:
                return Created(id=known, reused=True)
            if idempotency_key in self._creating:
                created = await asyncio.shield(self._creating[idempotency_key])
                return Created(id=created.id, reused=True)
            future: asyncio.Future[Created] = asyncio.get_running_loop().create_future()
            self._creating[idempotency_key] = future
            try:
                created = await self._create(spec)
                self.keys[idempotency_key] = created.id
                self.sessions[created.id].key = idempotency_key
                future.set_result(created)
                return created
            except BaseException as exc:
                future.set_exception(exc)
                future.exception()  # retrieved: waiters re-raise it
                raise
            finally:
                del self._creating[idempotency_key]
        return await self._create(spec)

    async def _create(self, spec: SandboxSpec) -> Created:
        if self.closed:
            raise SandboxError("unavailable", "the sandbox service is stopping")
        self._check_files(spec.files)
        if len(self.sessions) + self._reserved >= self.config.max_alive:
            raise SandboxError("capacity", f"{self.config.max_alive} sandboxes are alive here (setting "
                                           "sandbox_max_alive): destroy some, or retry later")
        self._reserved += 1
        try:
            box = self._take_pooled(spec) or await self._start(spec)
            try:
                await box.channel.call({"op": "configure", "env": spec.env, "workdir": WORKDIR,
                                        "limits": self.backend.limits(spec),
                                        **({"model_port": MODEL_PORT, "model_socket": MODEL_SOCKET}
                                           if spec.model_url is not None else {})})
                for path, data in spec.files.items():
                    await self._write(box, path, data, 0o644)
            except (SandboxError, AgentGone):
                await box.stop()
                raise
            now = self.clock()
            session = Session(f"{secrets.token_hex(8)}@{self.instance}", spec, box, now, now)
            self.sessions[session.id] = session
        finally:
            self._reserved -= 1
        return Created(id=session.id)

    def _check_network(self, spec: SandboxSpec) -> None:
        """Network is the service's choice, not the caller's: any bus client may send a spec."""
        if spec.network and not self.config.allow_network:
            raise SandboxError("invalid_request", "spec.network=true: this sandbox service gives sandboxes no "
                                                  "network (setting sandbox_allow_network, "
                                                  "FLYWHEEL_SANDBOX_ALLOW_NETWORK, is off): leave network unset, "
                                                  "or turn the setting on where the service runs")

    def _check_files(self, files: dict[str, bytes]) -> None:
        for path, data in files.items():
            self._check_size(path, len(data))

    def _check_size(self, path: str, size: int) -> None:
        if size > self.config.limits.max_file_bytes:
            raise SandboxError("too_large", f"file {path!r} is {size} bytes, over the limit of "
                                            f"{self.config.limits.max_file_bytes} bytes a file (setting "
                                            "sandbox.max_file_bytes): split it, or write it in parts and join them "
                                            "with exec")

    async def _write(self, box: Box, path: str, data: bytes, mode: int) -> int:
        reply = await box.channel.call({"op": "write_file", "path": path, "data": encode_b64(data), "mode": mode})
        _check(reply, f"write_file {path!r}")
        return int(reply["size_bytes"])

    async def _use(self, sandbox_id: str, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """One agent call on a session, with the session's use recorded and the outer deadline."""
        session = self.get(sandbox_id)
        async with session.lock:
            session = self.get(sandbox_id)  # it may have gone while this waited
            session.busy = True
            try:
                async with asyncio.timeout(timeout_s):  # not wait_for: see flywheel.contract.bus.wait_at_most
                    return await session.box.channel.call(request)
            except TimeoutError:
                reason = f"its agent did not answer within {timeout_s:g} s, so the service killed it"
                await self._destroy(session, reason)
                raise SandboxError("gone", f"sandbox {sandbox_id} is gone: {reason}") from None
            except AgentGone:
                await self._destroy(session, "its processes were killed from inside")
                raise SandboxError("gone", f"sandbox {sandbox_id} is gone: {self.tombstones[sandbox_id]}") from None
            finally:
                session.busy = False
                session.last_used = self.clock()

    async def exec(self, req: ExecRequest) -> ExecResult:
        request = {"op": "exec", "cmd": req.cmd, "cwd": req.cwd, "env": req.env, "stdin": encode_b64(req.stdin),
                   "timeout_s": req.timeout_s, "max_output_bytes": self.config.limits.max_output_bytes}
        reply = await self._use(req.id, request, req.timeout_s + self.config.limits.exec_grace_s)
        _check(reply, "exec")
        return ExecResult(
            exit_code=reply["exit_code"], stdout=decode_b64(reply["stdout"]).decode(errors="replace"),
            stderr=decode_b64(reply["stderr"]).decode(errors="replace"), stdout_truncated=reply["stdout_truncated"],
            stderr_truncated=reply["stderr_truncated"], timed_out=reply["timed_out"], duration_s=reply["duration_s"])

    async def write_file(self, req: WriteFileRequest) -> FileWritten:
        self._check_size(req.path, len(req.data))
        request = {"op": "write_file", "path": req.path, "data": encode_b64(req.data), "mode": req.mode}
        reply = await self._use(req.id, request, 30.0)
        _check(reply, f"write_file {req.path!r}")
        return FileWritten(size_bytes=reply["size_bytes"])

    async def read_file(self, req: ReadFileRequest) -> FileData:
        request = {"op": "read_file", "path": req.path, "max_bytes": self.config.limits.max_file_bytes}
        reply = await self._use(req.id, request, 30.0)
        if reply.get("kind") == "too_large":
            raise SandboxError("too_large", f"{req.path!r} is larger than {self.config.limits.max_file_bytes} "
                                            "bytes, the limit a read (setting sandbox.max_file_bytes): read it in "
                                            "parts with exec (head -c, split)")
        _check(reply, f"read_file {req.path!r}")
        return FileData(data=decode_b64(reply["data"]))

    async def destroy(self, sandbox_id: str) -> Destroyed:
        session = self.sessions.get(sandbox_id)
        if session is None:
            if sandbox_id not in self.tombstones:
                self.get(sandbox_id)  # raises not_found: a typo is worth telling apart from "already gone"
            return Destroyed(count=0)
        await self._destroy(session, "destroyed on request")
        return Destroyed(count=1)

    async def destroy_by_label(self, labels: dict[str, str]) -> Destroyed:
        chosen = [s for s in self.sessions.values() if all(s.spec.labels.get(k) == v for k, v in labels.items())]
        await asyncio.gather(*(self._destroy(s, f"destroyed by label {labels}") for s in chosen))
        return Destroyed(count=len(chosen))

    async def build(self, req: BuildRequest) -> Built:
        if self.closed:
            raise SandboxError("gone", "the sandbox service is stopping")
        return await self.backend.build(req, self.config.limits)

    async def run(self, req: RunRequest) -> ExecResult:
        self._check_files(req.files)
        created = await self.create(msgspec.structs.replace(req.spec, files={**req.spec.files, **req.files}))
        try:
            return await self.exec(ExecRequest(id=created.id, cmd=req.cmd, stdin=req.stdin, timeout_s=req.timeout_s))
        finally:
            if created.id in self.sessions:
                await self._destroy(self.sessions[created.id], "the one-shot run finished")

    async def _destroy(self, session: Session, reason: str) -> None:
        if self.sessions.pop(session.id, None) is None:
            return
        if self.on_destroyed is not None:
            self.on_destroyed(session, self.clock() - session.created_at)
        self.tombstones[session.id] = reason
        if session.key is not None and self.keys.get(session.key) == session.id:
            del self.keys[session.key]
        while len(self.tombstones) > self.config.limits.num_tombstones:
            self.tombstones.popitem(last=False)
        await session.box.stop()


def _check(reply: dict[str, Any], what: str) -> None:
    if not reply.get("ok"):
        raise SandboxError(reply.get("kind") or "failed", f"{what}: {reply.get('error')}")
