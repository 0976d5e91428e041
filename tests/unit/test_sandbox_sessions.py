"""The sandbox's messages and session manager, without processes: a hand-written fake
backend whose agent answers in memory, and a fake clock for the timeouts.

Covers: spec validation naming the field, ids and subjects, the timeouts each on its own
(TTL even when busy, idle TTL only when idle), tombstones that say why, the caps, the warm
pool (used only for a matching spec, refilled), idempotent creates (also when concurrent),
the file size limit, and network refused unless the service's setting allows it. Real
sandboxes and NATS: tests/integration/test_sandbox_*.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import msgspec
import pytest

from flywheel.contract.settings import SandboxSettings
from flywheel.runtime.isolation import AgentChannel, AgentGone, encode_b64
from flywheel.sdk.sandbox import (
    BuildRequest,
    Built,
    CreateRequest,
    ExecRequest,
    ReadFileRequest,
    RunRequest,
    SandboxError,
    SandboxSpec,
    WriteFileRequest,
    build_tag,
    instance_of,
    instance_token,
    subject,
)
from flywheel_sandbox.backends import pool_key
from flywheel_sandbox.sessions import Session, SessionManager
from tests.helpers import until
from tests.sandbox_service import manager_config


class FakeBox:
    """An agent in memory: files in a dict, ``echo`` and ``pwd`` as its only commands."""

    def __init__(self, spec: SandboxSpec) -> None:
        self.spec = spec
        self.files: dict[str, str] = {}
        self.env: dict[str, str] = {}
        self._stopped = asyncio.Event()
        self.channel = AgentChannel(self._read, self._write)
        self.replies: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.hang = False

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    @property
    def alive(self) -> bool:
        return not self.stopped

    async def _write(self, data: bytes) -> None:
        import json

        if self.stopped:
            raise BrokenPipeError("the agent's stdin is closed")
        request = json.loads(data[4:])
        if request["op"] == "configure":
            self.env = request["env"]
            reply: dict[str, Any] = {"ok": True}
        elif request["op"] == "write_file":
            self.files[request["path"]] = request["data"]
            reply = {"ok": True, "size_bytes": len(request["data"])}
        elif request["op"] == "read_file":
            reply = {"ok": True, "data": self.files[request["path"]]}
        else:
            out = request["cmd"].removeprefix("echo ").encode() + b"\n"
            reply = {"ok": True, "exit_code": 0, "stdout": encode_b64(out), "stderr": "", "stdout_truncated": False,
                     "stderr_truncated": False, "timed_out": False, "duration_s": 0.001}
        if not self.hang:
            self.replies.put_nowait(reply)

    async def _read(self, n: int) -> bytes:
        import json
        import struct

        if not hasattr(self, "_pending"):
            self._pending = b""
        while len(self._pending) < n:
            if self.stopped:
                raise asyncio.IncompleteReadError(self._pending, n)
            get = asyncio.ensure_future(self.replies.get())
            stop = asyncio.ensure_future(self._wait_stopped())
            done, _ = await asyncio.wait([get, stop], return_when=asyncio.FIRST_COMPLETED)
            get.cancel()
            stop.cancel()
            if get in done and not get.cancelled():
                body = json.dumps(get.result()).encode()
                self._pending += struct.pack(">I", len(body)) + body
        data, self._pending = self._pending[:n], self._pending[n:]
        return data

    async def _wait_stopped(self) -> None:
        await self._stopped.wait()

    async def stop(self) -> None:
        self._stopped.set()


class FakeBackend:
    name = "fake"

    def __init__(self) -> None:
        self.started: list[FakeBox] = []
        self.built: list[BuildRequest] = []

    async def start(self, spec: SandboxSpec) -> FakeBox:
        box = FakeBox(spec)
        self.started.append(box)
        return box

    def limits(self, spec: SandboxSpec) -> dict[str, int]:
        return {}

    def pool_key(self, spec: SandboxSpec) -> tuple[Any, ...]:
        return pool_key(spec)

    async def build(self, request: BuildRequest, limits: SandboxSettings) -> Built:
        self.built.append(request)
        return Built(image=build_tag(request.context), cached=len(self.built) > 1, size_mb=1.0, duration_s=0.0)

    async def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def manager(clock: Clock) -> SessionManager:
    return SessionManager(FakeBackend(), "host.example-12", manager_config(max_alive=3, warm_pool=0,
                                                                           max_file_bytes=100), clock=clock)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)  # noqa: sleep - yields so the tasks reap() started run (fake backend, no I/O)


def test_spec_errors_name_the_field() -> None:
    decoder = msgspec.json.Decoder(CreateRequest)
    with pytest.raises(msgspec.ValidationError, match=r"\$\.spec\.pids"):
        decoder.decode(b'{"spec": {"pids": 0}}')
    with pytest.raises(msgspec.ValidationError, match="ttl_s"):
        decoder.decode(b'{"spec": {"ttl_s": -1}}')
    with pytest.raises(msgspec.ValidationError, match="netwrok"):
        decoder.decode(b'{"spec": {"netwrok": true}}')
    with pytest.raises(msgspec.ValidationError, match=r"\$\.cmd"):
        msgspec.json.decode(b'{"id": "a@b", "cmd": []}', type=ExecRequest)
    spec = decoder.decode(b'{"spec": {"files": {"a.txt": "aGk="}}}').spec
    assert spec.files == {"a.txt": b"hi"} and not spec.network  # bytes are base64 on the wire; no network by default


def test_ids_and_subjects() -> None:
    assert instance_token("host.example-12") == "host_example-12"
    assert subject("create") == "sandbox.create" and subject("run") == "sandbox.run"
    assert subject("exec", "host.example-12") == "sandbox.host_example-12.exec"
    assert instance_of("abc@host_example-12") == "host_example-12"
    for bad in ("abc", "abc@", "abc@a.b", "abc@a*"):
        with pytest.raises(SandboxError) as err:
            instance_of(bad)
        assert err.value.kind == "invalid_request"


async def test_create_exec_and_files(manager: SessionManager) -> None:
    created = await manager.create(SandboxSpec(env={"A": "1"}, files={"x": b"data"}))
    assert created.id.endswith("@host_example-12")
    box = manager.sessions[created.id].box
    assert isinstance(box, FakeBox)
    assert box.env == {"A": "1"} and box.files == {"x": encode_b64(b"data")}
    result = await manager.exec(ExecRequest(id=created.id, cmd="echo hi"))
    assert result.stdout == "hi\n" and result.exit_code == 0
    await manager.write_file(WriteFileRequest(id=created.id, path="y", data=b"abc"))
    assert (await manager.read_file(ReadFileRequest(id=created.id, path="y"))).data == b"abc"
    with pytest.raises(SandboxError) as big:
        await manager.write_file(WriteFileRequest(id=created.id, path="z", data=b"x" * 101))
    assert big.value.kind == "too_large" and "101 bytes" in big.value.error
    with pytest.raises(SandboxError) as big_spec:
        await manager.create(SandboxSpec(files={"big": b"x" * 101}))
    assert big_spec.value.kind == "too_large"


async def test_ttl_and_idle_ttl_each_on_its_own(manager: SessionManager, clock: Clock) -> None:
    short_ttl = (await manager.create(SandboxSpec(ttl_s=10, idle_ttl_s=100))).id
    short_idle = (await manager.create(SandboxSpec(ttl_s=100, idle_ttl_s=5))).id
    clock.now += 4
    await manager.exec(ExecRequest(id=short_idle, cmd="echo touch"))  # use resets the idle clock
    clock.now += 4
    manager.reap()
    await settle()
    assert set(manager.sessions) == {short_ttl, short_idle}
    destroyed: dict[str, float] = {}

    def on_destroyed(session: Session, seconds: float) -> None:
        assert session.id not in destroyed
        destroyed[session.id] = seconds

    manager.on_destroyed = on_destroyed
    clock.now += 2.5  # 10.5 s after creation, 6.5 s after the exec
    manager.reap()
    await settle()
    assert not manager.sessions
    assert destroyed == {short_ttl: 10.5, short_idle: 10.5}  # told once each, with its seconds alive (metering)
    for sid, why in ((short_ttl, "ttl_s=10 passed"), (short_idle, "idle for idle_ttl_s=5")):
        with pytest.raises(SandboxError) as gone:
            await manager.exec(ExecRequest(id=sid, cmd="echo x"))
        assert gone.value.kind == "gone" and why in gone.value.error


async def test_busy_sandbox_is_not_idle_but_ttl_still_ends_it(manager: SessionManager, clock: Clock) -> None:
    sid = (await manager.create(SandboxSpec(ttl_s=50, idle_ttl_s=5))).id
    box = manager.sessions[sid].box
    box.hang = True  # type: ignore[attr-defined]  # the agent takes its time
    pending = asyncio.ensure_future(manager.exec(ExecRequest(id=sid, cmd="echo slow", timeout_s=100)))
    await settle()
    clock.now += 20
    manager.reap()
    await settle()
    assert sid in manager.sessions  # busy: idle TTL does not apply
    clock.now += 40
    manager.reap()
    with pytest.raises(SandboxError) as gone:
        await pending
    assert gone.value.kind == "gone" and "ttl_s=50" in gone.value.error


async def test_exec_past_its_timeout_and_grace_kills_the_sandbox(clock: Clock) -> None:
    manager = SessionManager(FakeBackend(), "h", manager_config(warm_pool=0, exec_grace_s=0.01), clock=clock)
    sid = (await manager.create(SandboxSpec())).id
    manager.sessions[sid].box.hang = True  # type: ignore[attr-defined]  # FakeBackend starts FakeBoxes
    with pytest.raises(SandboxError) as gone:
        await manager.exec(ExecRequest(id=sid, cmd="echo stuck", timeout_s=0.05))
    assert gone.value.kind == "gone" and "did not answer" in gone.value.error
    assert sid not in manager.sessions


async def test_unknown_and_destroyed(manager: SessionManager) -> None:
    with pytest.raises(SandboxError) as unknown:
        await manager.destroy("nope@h")
    assert unknown.value.kind == "not_found"
    sid = (await manager.create(SandboxSpec())).id
    assert (await manager.destroy(sid)).count == 1
    assert (await manager.destroy(sid)).count == 0


async def test_caps(manager: SessionManager) -> None:
    ids = [(await manager.create(SandboxSpec())).id for _ in range(3)]
    with pytest.raises(SandboxError) as refused:
        await manager.create(SandboxSpec())
    assert refused.value.kind == "capacity" and "sandbox_max_alive" in refused.value.error
    await manager.destroy(ids[0])
    await manager.create(SandboxSpec())


async def test_max_starting_bounds_concurrent_starts() -> None:
    backend = FakeBackend()
    running = peak = 0
    original = backend.start

    async def slow_start(spec: SandboxSpec) -> FakeBox:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)  # noqa: sleep - a start that takes time
        running -= 1
        return await original(spec)

    backend.start = slow_start  # type: ignore[method-assign]  # this test's own fake, slowed on purpose
    manager = SessionManager(backend, "h", manager_config(max_starting=2, warm_pool=0, max_alive=10))
    await asyncio.gather(*(manager.create(SandboxSpec()) for _ in range(6)))
    assert peak == 2 and len(manager.sessions) == 6


async def test_idempotency_key(manager: SessionManager) -> None:
    a, b = await asyncio.gather(manager.create(SandboxSpec(), "key"), manager.create(SandboxSpec(), "key"))
    assert a.id == b.id and [a.reused, b.reused].count(True) == 1
    assert (await manager.create(SandboxSpec(), "key")).reused
    await manager.destroy(a.id)
    assert "key" not in manager.keys  # keys do not outlive their sandbox
    assert (await manager.create(SandboxSpec(), "key")).id != a.id  # the old one is gone: a new one


async def test_warm_pool_serves_matching_specs_and_refills() -> None:
    backend = FakeBackend()
    manager = SessionManager(backend, "h", manager_config(warm_pool=2, max_alive=10, reap_interval_s=0.01))
    stopping = asyncio.Event()
    task = asyncio.ensure_future(manager.maintain(stopping))
    for _ in range(100):
        if len(manager._pool) == 2:
            break
        await asyncio.sleep(0.01)  # noqa: sleep - the polling interval of this bounded wait
    pooled = list(manager._pool)
    created = await manager.create(SandboxSpec(env={"X": "1"}, labels={"l": "1"}))  # env and labels may differ
    assert manager.sessions[created.id].box is pooled[0]
    other = await manager.create(SandboxSpec(memory_mb=64))  # a different limit: not from the pool
    assert manager.sessions[other.id].box not in pooled
    for _ in range(100):
        if len(manager._pool) == 2:
            break
        await asyncio.sleep(0.01)  # noqa: sleep - the polling interval of this bounded wait
    assert len(manager._pool) == 2 and len(backend.started) == 4
    stopping.set()
    await task
    assert not manager.sessions and all(b.stopped for b in backend.started)


async def test_network_is_refused_unless_the_service_allows_it(clock: Clock) -> None:
    backend = FakeBackend()
    manager = SessionManager(backend, "h", manager_config(warm_pool=0), clock=clock)
    networked = SandboxSpec(network=True)
    attempts = (lambda: manager.create(networked), lambda: manager.create(networked, "key"),
                lambda: manager.run(RunRequest(cmd="echo x", spec=networked)))
    for attempt in attempts:
        with pytest.raises(SandboxError) as refused:
            await attempt()
        assert refused.value.kind == "invalid_request", refused.value
        assert "spec.network" in refused.value.error and "sandbox_allow_network" in refused.value.error
    assert not backend.started and not manager.sessions and not manager.keys  # refused before anything started
    allowing = SessionManager(backend, "h", manager_config(warm_pool=0, allow_network=True), clock=clock)
    created = await allowing.create(networked)
    box = allowing.sessions[created.id].box
    assert isinstance(box, FakeBox) and box.spec.network
    # a networked spec never takes a warm-pool box (those are started without network)
    assert backend.pool_key(networked) != backend.pool_key(SandboxSpec())


async def test_a_refused_network_spec_leaves_the_warm_pool_alone() -> None:
    backend = FakeBackend()
    manager = SessionManager(backend, "h", manager_config(warm_pool=1, max_alive=4, reap_interval_s=0.01))
    stopping = asyncio.Event()
    task = asyncio.ensure_future(manager.maintain(stopping))
    await until(lambda: len(manager._pool) == 1, what="the warm pool to fill")
    pooled = manager._pool[0]
    with pytest.raises(SandboxError):
        await manager.create(SandboxSpec(network=True))
    assert list(manager._pool) == [pooled] and len(backend.started) == 1
    stopping.set()
    await task


def test_the_composition_root_passes_the_network_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from flywheel.contract.settings import Settings
    from flywheel_sandbox.service import manager_config

    monkeypatch.delenv("FLYWHEEL_CONFIG", raising=False)
    monkeypatch.delenv("FLYWHEEL_SANDBOX_ALLOW_NETWORK", raising=False)
    assert not manager_config(Settings()).allow_network  # off unless said
    monkeypatch.setenv("FLYWHEEL_SANDBOX_ALLOW_NETWORK", "true")
    assert manager_config(Settings()).allow_network


async def test_agent_gone_is_reported(manager: SessionManager) -> None:
    sid = (await manager.create(SandboxSpec())).id
    box = manager.sessions[sid].box
    await box.stop()
    with pytest.raises(SandboxError) as gone:
        await manager.exec(ExecRequest(id=sid, cmd="echo x"))
    assert gone.value.kind == "gone"
    with pytest.raises(AgentGone):
        await box.channel.call({"op": "exec", "cmd": "echo x"})


def test_entry_point_help_is_fast_and_imports_no_backend() -> None:
    code = ("import sys; from flywheel_sandbox.__main__ import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n"
            "    pass\nassert 'flywheel_sandbox.backends' not in sys.modules and 'docker' not in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    assert "sandbox_backend" in out.stdout


async def test_a_build_goes_to_the_backend_with_the_service_limits_until_it_stops(manager: SessionManager) -> None:
    request = BuildRequest(context=b"ctx")
    built = await manager.build(request)
    assert built.image == build_tag(b"ctx") and manager.backend.built == [request]  # type: ignore[attr-defined]
    await manager.close("the sandbox service stopped")
    with pytest.raises(SandboxError, match="stopping") as stopped:
        await manager.build(request)
    assert stopped.value.kind == "gone"
