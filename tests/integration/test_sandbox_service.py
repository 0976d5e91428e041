"""The sandbox service over a real nats-server, on the local backend (real bubblewrap).

Covers: sessions that keep files and folder between execs, argv commands, stdin and env,
output truncation, files in and out, the one-shot run, network refused unless setting
``sandbox_allow_network`` allows it (and what it gives then), a model URL as a sandbox's one
way out (the model relay), idempotent create, destroy and
destroy by label across two replicas, each timeout on its own (exec timeout, TTL, idle TTL),
the caps, clear error replies to bad requests with the service still serving, and
``python -m flywheel_sandbox`` as a process (heartbeat, clean stop on SIGTERM).
Hostile programs are in test_sandbox_security.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from flywheel.contract import events
from flywheel.contract.bus import Bus
from flywheel.contract.service import read_heartbeats
from flywheel.runtime import relay
from flywheel.runtime.natsserver import NatsServer
from flywheel.sdk.environment import GroupReward, Reward
from flywheel.sdk.sandbox import (
    ROLLOUT_LABEL,
    RUN_LABEL,
    WORKDIR,
    ErrorReply,
    SandboxClient,
    SandboxError,
    SandboxSpec,
    subject,
)
from flywheel.sdk.scoring import Scoring
from flywheel_sandbox.backends import LocalBackend
from tests.helpers import until
from tests.sandbox_service import ServedSandboxClient, backend_named, serving
from tests.scripted_openai import ScriptedOpenAI, make_rollout


@pytest.fixture
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[LocalBackend]:
    async with backend_named("local", request) as b:
        yield b


@pytest.fixture
async def client(bus: Bus, backend: LocalBackend) -> AsyncIterator[ServedSandboxClient]:
    async with serving(bus, backend, warm_pool=1, max_alive=8, max_file_bytes=64 * 1024,
                       max_output_bytes=1000) as c:
        yield c


async def test_a_session_keeps_files_and_its_folder(client: ServedSandboxClient) -> None:
    async with client.session() as box:
        first = await client.exec(box, "mkdir -p src && cd src && echo 'print(6 * 7)' > main.py && pwd")
        assert (first.exit_code, first.stdout) == (0, f"{WORKDIR}/src\n")
        again = await client.exec(box, "pwd && python3 main.py")
        assert again.stdout == f"{WORKDIR}/src\n42\n" and again.duration_s > 0
        argv = await client.exec(box, ["ls", f"{WORKDIR}/src"])
        assert argv.stdout == "main.py\n"
        assert (await client.exec(box, "cat", stdin="from stdin")).stdout == "from stdin"
        env = await client.exec(box, "echo $A-$B", env={"B": "exec"})
        assert env.stdout == "-exec\n"
        failing = await client.exec(box, "echo oops >&2; exit 3")
        assert (failing.exit_code, failing.stderr) == (3, "oops\n")
        missing = await client.exec(box, ["no-such-program"])
        assert missing.exit_code == 127 and "no-such-program" in missing.stderr
        no_dir = await client.exec(box, "true", cwd=f"{WORKDIR}/nowhere")
        assert no_dir.exit_code == 127 and f"{WORKDIR}/nowhere: No such file or directory" in no_dir.stderr
        await client.exec(box, "mkdir /tmp/gone && cd /tmp/gone && rmdir /tmp/gone")
        assert (await client.exec(box, "pwd")).stdout == f"{WORKDIR}\n"  # its folder vanished: back to the workdir


async def test_stdin_a_command_never_reads_leaves_the_session_alive(client: ServedSandboxClient) -> None:
    async with client.session() as box:
        for _ in range(10):  # large enough that the command exits before the pipe takes it all
            assert (await client.exec(box, "true", stdin="x" * 200_000)).exit_code == 0
        assert (await client.exec(box, "echo alive")).stdout == "alive\n"
        await client.write_file(box, "locked", "secret", mode=0)
        assert (await client.exec(box, "stat -c %a locked")).stdout == "0\n"
        assert (await client.exec(box, "printf y | yes | head -c 3")).stdout == "y\ny"  # SIGPIPE is back for commands


async def test_spec_env_files_and_file_round_trip(client: ServedSandboxClient) -> None:
    spec = SandboxSpec(env={"A": "spec"}, files={"data/in.txt": b"\x00binary\xff"})
    async with client.session(spec) as box:
        assert (await client.exec(box, "echo $A; wc -c < data/in.txt")).stdout == "spec\n8\n"
        assert await client.read_file(box, "data/in.txt") == b"\x00binary\xff"
        assert await client.write_file(box, "/tmp/x/y.sh", "echo written", mode=0o755) == 12
        assert (await client.exec(box, "/tmp/x/y.sh")).stdout == "written\n"
        with pytest.raises(SandboxError) as missing:
            await client.read_file(box, "nope.txt")
        assert missing.value.kind == "failed" and "nope.txt" in str(missing.value)


CONNECT = """
import socket, sys
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2).close()
    print("CONNECTED")
except OSError as e:
    print("refused", e)
"""


async def test_network_is_refused_unless_the_service_allows_it(bus: Bus, client: ServedSandboxClient) -> None:
    """A caller cannot give itself the host's network: only the service's setting can."""
    refused = await raw(bus, "create", b'{"spec": {"network": true}}')
    assert refused.kind == "invalid_request", refused
    for named in ("spec.network", "sandbox_allow_network", "FLYWHEEL_SANDBOX_ALLOW_NETWORK"):
        assert named in refused.error, refused.error
    with pytest.raises(SandboxError) as run:
        await client.run("true", spec=SandboxSpec(network=True))
    assert run.value.kind == "invalid_request" and "sandbox_allow_network" in str(run.value)
    with pytest.raises(SandboxError) as keyed:
        await client.create(SandboxSpec(network=True), idempotency_key="k-net")
    assert keyed.value.kind == "invalid_request"
    assert not client.manager.sessions
    assert (await client.run("echo still serving")).stdout == "still serving\n"


async def test_network_when_the_service_allows_it_shares_the_host_network(bus: Bus, backend: LocalBackend) -> None:
    """The opt-in (setting ``sandbox_allow_network``): on the local backend ``network=True``
    shares the host's network namespace, so the host's loopback services are in reach; a
    sandbox that does not ask still has none (the security suite checks the default)."""
    accepted: list[str] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(str(writer.get_extra_info("peername")))
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = str(server.sockets[0].getsockname()[1])
    try:
        async with serving(bus, backend, warm_pool=1, allow_network=True) as c:
            shared = await c.run(["python3", "connect.py", port], files={"connect.py": CONNECT},
                                 spec=SandboxSpec(network=True))
            assert shared.stdout == "CONNECTED\n", shared
            await until(lambda: len(accepted) == 1, what="the host's listener to see the sandbox's connection")
            none = await c.run(["python3", "connect.py", port], files={"connect.py": CONNECT})
            assert none.stdout.startswith("refused"), none
            links = "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '"
            host_links = [line.split(":")[0].strip() for line in Path("/proc/net/dev").read_text().splitlines()[2:]]
            assert (await c.run(links, spec=SandboxSpec(network=True))).stdout.split() == host_links
            assert (await c.run(links)).stdout.split() == ["lo"]
            assert len(accepted) == 1
    finally:
        server.close()
        await server.wait_closed()


MODEL_CLIENT = """
import http.client, json, socket, sys
conn = http.client.HTTPConnection("127.0.0.1", 8377, timeout=10)
def post(path, body):
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", "Authorization": "Bearer k"})
    r = conn.getresponse()
    return r.status, r.read().decode()
for _ in range(2):  # two requests on one kept-alive connection
    status, text = post("/v1/chat/completions", {"model": "agent", "messages": [{"role": "user", "content": "hi"}]})
    print(status, json.loads(text)["choices"][0]["message"]["content"])
status, text = post("/v1/chat/completions", {"model": "agent", "stream": True,
                                             "messages": [{"role": "user", "content": "hi"}]})
print(status, "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                      for line in text.splitlines() if line.startswith("data: {")))
for path in ("/v2/models", "/v1/../secret", "/v1/%2e%2e/secret"):
    conn = http.client.HTTPConnection("127.0.0.1", 8377, timeout=10)
    status, text = post(path, {})
    print(status, "reaches only its model endpoint" in text)
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2).close()
    print("CONNECTED")
except OSError as e:
    print("refused")
"""


async def test_a_model_url_is_the_one_way_out_of_a_sandbox(client: ServedSandboxClient) -> None:
    """``spec.model_url``: a program inside reaches that endpoint (kept-alive and streamed
    answers) at MODEL_BASE_URL, and nothing else: no other path of it, no climbing out of
    its prefix, not the host's port it is served on."""
    await only_the_model_url(client)


@pytest.mark.docker
async def test_a_model_url_is_the_one_way_out_of_a_docker_sandbox(bus: Bus, request: pytest.FixtureRequest) -> None:
    """The same through the docker backend: the relay's folder bound into the container."""
    async with backend_named("docker", request) as docker_backend, serving(bus, docker_backend, warm_pool=0) as c:
        await only_the_model_url(c)


async def only_the_model_url(client: ServedSandboxClient) -> None:
    def relays() -> set[Path]:
        return set(Path(tempfile.gettempdir()).glob(f"{relay.PREFIX}*"))

    before = relays()  # other processes' (a service killed by an earlier test leaves its folders)
    with ScriptedOpenAI({"agent": ["one", "two", "three"]}) as server:
        spec = SandboxSpec(model_url=server.base_url)
        result = await client.run(["python3", "client.py", str(server.port)], files={"client.py": MODEL_CLIENT},
                                  spec=spec)
        assert result.exit_code == 0, result
        assert result.stdout.splitlines() == ["200 one", "200 two", "200 three", "403 True", "403 True", "403 True",
                                              "refused"], result
        assert len(server.requests) == 3 and server.requests[2]["stream"] is True
        assert server.requests[0]["messages"] == [{"role": "user", "content": "hi"}]
        without = await client.run(["python3", "client.py", str(server.port)], files={"client.py": MODEL_CLIENT})
        # Without a model_url nothing listens on the port: the first request fails.
        assert without.exit_code == 1 and without.stdout == "" and len(server.requests) == 3, without
    assert not client.manager.sessions
    await until(lambda: not relays() - before, what="each relay's folder to go with its sandbox")


async def test_a_bad_model_url_is_refused_naming_the_field(bus: Bus, client: ServedSandboxClient) -> None:
    refused = await raw(bus, "create", b'{"spec": {"model_url": "file:///etc/passwd"}}')
    assert refused.kind == "invalid_request" and "$.spec.model_url" in refused.error, refused.error
    assert (await client.run("echo still serving")).stdout == "still serving\n"


async def test_output_is_cut_and_flagged(client: ServedSandboxClient) -> None:
    async with client.session() as box:
        result = await client.exec(box, "head -c 5000 /dev/zero | tr '\\0' a; echo done >&2")
        assert result.stdout == "a" * 1000 and result.stdout_truncated
        assert result.stderr == "done\n" and not result.stderr_truncated


async def test_one_shot_run_leaves_no_sandbox(client: ServedSandboxClient) -> None:
    result = await client.run("python3 -m unittest -q test_add 2>&1 | tail -1",
                              files={"test_add.py": "import unittest\nclass T(unittest.TestCase):\n"
                                                    "    def test_add(self):\n        self.assertEqual(1 + 1, 2)\n"})
    assert result.exit_code == 0 and result.stdout == "OK\n"
    assert not client.manager.sessions


async def test_a_sandbox_labelled_with_a_run_is_metered_once_destroyed(bus: Bus, client: ServedSandboxClient) -> None:
    metered: list[events.Usage] = []

    async def meter(msg: Any) -> None:
        metered.append(events.Decoder(events.Usage).decode(msg.data))

    sub = await bus.nc.subscribe("usage.>", cb=meter)
    labelled = await client.create(SandboxSpec(labels={RUN_LABEL: "r1", ROLLOUT_LABEL: "ro1"}))
    plain = await client.create(SandboxSpec())
    await client.exec(labelled, "sleep 0.3")
    assert await client.destroy(labelled) and await client.destroy(plain)
    await until(lambda: len(metered) == 1, what="the labelled sandbox's usage")
    await asyncio.sleep(0.2)  # noqa: sleep - room for a second (wrong) usage event to arrive
    await sub.unsubscribe()
    (usage,) = metered  # the unlabelled one names no run: not metered
    assert (usage.run, usage.source, usage.rollout_id, usage.id) == ("r1", "sandbox", "ro1", f"sandbox.{labelled}")
    assert 0.3 <= usage.sandbox_s < 30


async def test_sandboxes_a_reward_makes_are_metered_to_the_rollouts_run(bus: Bus,
                                                                       client: ServedSandboxClient) -> None:
    metered: list[events.Usage] = []

    async def meter(msg: Any) -> None:
        metered.append(events.Decoder(events.Usage).decode(msg.data))

    async def passes(completion: str) -> float:  # a verifier's one-shot sandbox
        return float((await client.run(["python3", "-c", f"print({completion!r})"])).exit_code == 0)

    async def same_answers(completions: list[str]) -> list[float]:  # a group reward's session sandbox
        async with client.session() as box:
            await client.exec(box, "true")
        return [1.0] * len(completions)

    sub = await bus.nc.subscribe("usage.>", cb=meter)
    group = [msgspec.structs.replace(make_rollout("e", {"id": "t"}, [{"role": "assistant", "content": "hi"}],
                                                  index=i), run="r7") for i in range(2)]
    scored = await Scoring().score_group([Reward(passes), GroupReward(same_answers)], group)
    assert [[s.value for s in row] for row in scored] == [[1.0, 1.0], [1.0, 1.0]]
    await until(lambda: len(metered) == 3, what="the usage of the rewards' three sandboxes")
    await sub.unsubscribe()
    assert all((u.run, u.source) == ("r7", "sandbox") and u.sandbox_s > 0 for u in metered)
    # Each rollout's reward sandbox names its rollout; the group reward's names none.
    assert sorted(u.rollout_id or "" for u in metered) == sorted(["", *(r.id for r in group)])
    assert not client.manager.sessions


async def test_idempotent_create_and_destroy(client: ServedSandboxClient) -> None:
    first, second = await asyncio.gather(client.create(idempotency_key="k1"), client.create(idempotency_key="k1"))
    assert first == second
    assert await client.destroy(first) is True
    assert await client.destroy(first) is False  # gone already: not an error
    with pytest.raises(SandboxError) as gone:
        await client.exec(first, "true")
    assert gone.value.kind == "gone" and "destroyed on request" in str(gone.value)


async def test_destroy_by_label_reaches_every_replica(bus: Bus, backend: LocalBackend) -> None:
    async with serving(bus, backend, instance="replica-a", warm_pool=0) as a, \
               serving(bus, backend, instance="replica-b", warm_pool=0):
        # The queue group shares creates at random: create until both replicas hold some (six
        # creates all landing on one replica is a 1-in-32 chance; 24 in a row is negligible).
        boxes: list[str] = []
        while len(boxes) < 6 or (len({b.split("@")[1] for b in boxes}) < 2 and len(boxes) < 24):
            boxes.append(await a.create(SandboxSpec(labels={"rollout": "r1", "i": str(len(boxes))})))
        other = await a.create(SandboxSpec(labels={"rollout": "r2"}))
        assert {b.split("@")[1] for b in boxes} == {"replica-a", "replica-b"}
        for box in boxes:  # each op finds the replica that holds its sandbox
            assert (await a.exec(box, "echo $HOSTNAME; true")).exit_code == 0
        assert await a.destroy_by_label({"rollout": "r1"}) == len(boxes)
        assert await a.destroy_by_label({"rollout": "r1"}) == 0
        assert (await a.exec(other, "echo alive")).stdout == "alive\n"
        await a.destroy(other)


async def test_exec_timeout_kills_the_command_and_the_session_lives(client: ServedSandboxClient) -> None:
    async with client.session() as box:
        started = time.monotonic()
        result = await client.exec(box, "echo before; sleep 30 & while :; do :; done", timeout_s=1)
        assert result.timed_out and result.exit_code == -9 and result.stdout == "before\n"
        assert time.monotonic() - started < 4
        left = await client.exec(box, "cat /proc/[0-9]*/comm")
        assert sorted(left.stdout.split()) == ["bash", "bwrap", "python3"]  # this exec's shell, the agent, bwrap


async def test_ttl_expires_even_during_an_exec(client: ServedSandboxClient) -> None:
    box = await client.create(SandboxSpec(ttl_s=1.0))
    started = time.monotonic()
    with pytest.raises(SandboxError) as gone:
        await client.exec(box, "sleep 20", timeout_s=20)
    assert gone.value.kind == "gone" and "ttl_s=1" in str(gone.value)
    assert time.monotonic() - started < 5


async def test_idle_ttl_expires_an_unused_sandbox_only(client: ServedSandboxClient) -> None:
    idle = await client.create(SandboxSpec(idle_ttl_s=0.6))
    busy = await client.create(SandboxSpec(idle_ttl_s=0.6))
    assert (await client.exec(busy, "sleep 1.2; echo still here", timeout_s=5)).stdout == "still here\n"
    with pytest.raises(SandboxError) as gone:
        await client.exec(idle, "true")
    assert gone.value.kind == "gone" and "idle_ttl_s=0.6" in str(gone.value)
    await client.destroy(busy)


async def test_caps_refuse_creates_past_max_alive(bus: Bus, backend: LocalBackend) -> None:
    async with serving(bus, backend, warm_pool=0, max_alive=2, max_starting=1) as c:
        boxes = list(await asyncio.gather(c.create(), c.create()))
        with pytest.raises(SandboxError) as refused:
            await c.create()
        assert refused.value.kind == "capacity" and "sandbox_max_alive" in str(refused.value)
        await c.destroy(boxes[0])
        boxes[0] = await c.create()  # room again
        for box in boxes:
            await c.destroy(box)


async def test_requests_past_max_in_flight_are_refused_at_once(bus: Bus, backend: LocalBackend) -> None:
    async with serving(bus, backend, warm_pool=0, max_in_flight=2) as c:
        boxes = [await c.create(), await c.create()]
        slow = [asyncio.ensure_future(c.exec(b, "sleep 1; echo done")) for b in boxes]
        await asyncio.sleep(0.3)  # noqa: sleep - both execs are in flight by now
        with pytest.raises(SandboxError) as busy:
            await c.create()
        assert busy.value.kind == "capacity" and "2 requests are in flight" in str(busy.value)
        assert [r.stdout for r in await asyncio.gather(*slow)] == ["done\n", "done\n"]
        for b in boxes:  # room again
            await c.destroy(b)


async def raw(bus: Bus, op: str, payload: bytes, instance: str | None = "test-1") -> ErrorReply:
    msg = await bus.nc.request(subject(op, instance), payload, timeout=10)
    reply = msgspec.json.decode(msg.data, type=ErrorReply)
    assert reply.error
    return reply


async def test_bad_requests_get_clear_errors_and_the_service_keeps_serving(bus: Bus,
                                                                          client: ServedSandboxClient) -> None:
    unknown = await raw(bus, "exec", b'{"id": "0000@test-1", "cmd": "ls"}')
    assert unknown.kind == "not_found" and "0000@test-1" in unknown.error
    invalid = await raw(bus, "create", b'{"spec": {"memory_mb": 1}}')
    assert invalid.kind == "invalid_request" and "$.spec.memory_mb" in invalid.error
    typo = await raw(bus, "create", b'{"spec": {"memroy_mb": 64}}')
    assert typo.kind == "invalid_request" and "memroy_mb" in typo.error
    garbage = await raw(bus, "run", b"not json")
    assert garbage.kind == "invalid_request" and "RunRequest" in garbage.error
    with pytest.raises(SandboxError) as image:
        await client.create(SandboxSpec(image="debian"))
    assert image.value.kind == "invalid_request" and "image" in str(image.value)
    box = await client.create()
    with pytest.raises(SandboxError) as big:
        await client.write_file(box, "big.bin", b"x" * (64 * 1024 + 1))
    assert big.value.kind == "too_large" and "65537 bytes" in str(big.value)
    await client.exec(box, "head -c 70000 /dev/zero > big.bin")
    with pytest.raises(SandboxError) as big_read:
        await client.read_file(box, "big.bin")
    assert big_read.value.kind == "too_large"
    with pytest.raises(SandboxError) as bad_id:
        await client.exec("no-instance", "ls")
    assert bad_id.value.kind == "invalid_request"
    assert (await client.exec(box, "echo still serving")).stdout == "still serving\n"
    await client.destroy(box)


async def test_no_service_is_a_clear_error(bus: Bus) -> None:
    with pytest.raises(SandboxError) as none:
        await SandboxClient(bus).run("true")
    assert none.value.kind == "unavailable" and "python -m flywheel_sandbox" in str(none.value)


async def test_the_service_process_heartbeats_and_stops_cleanly(nats_server: NatsServer, bus: Bus) -> None:
    env = dict(os.environ, FLYWHEEL_NATS_URL=nats_server.url, FLYWHEEL_SANDBOX_WARM_POOL="1")
    env.pop("FLYWHEEL_SANDBOX_ALLOW_NETWORK", None)  # the default: no network
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "flywheel_sandbox", env=env)
    try:
        client = SandboxClient(bus)
        for _ in range(200):
            if any(b.service == "sandbox" and b.pid == proc.pid for b in await read_heartbeats(bus)):
                break
            await asyncio.sleep(0.05)  # noqa: sleep - the polling interval of this bounded wait
        box = await client.create(SandboxSpec(labels={"t": "1"}))
        assert (await client.exec(box, "echo $((6 * 7))")).stdout == "42\n"
        with pytest.raises(SandboxError) as no_network:  # the composition root passes the setting, off
            await client.create(SandboxSpec(network=True))
        assert no_network.value.kind == "invalid_request" and "sandbox_allow_network" in str(no_network.value)
        assert await client.destroy_by_label({"t": "1"}) == 1
        box = await client.create()
        pending = asyncio.ensure_future(client.exec(box, "sleep 30", timeout_s=30))
        await asyncio.sleep(0.3)  # noqa: sleep - let the exec start before the signal
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        with pytest.raises(SandboxError) as stopped:
            await pending
        assert stopped.value.kind == "gone" and "stopped" in str(stopped.value)
        assert not [b for b in await read_heartbeats(bus) if b.service == "sandbox"]
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.parametrize("env, says", [
    ({"PATH": "/nonexistent"}, "needs bubblewrap"),
    ({"FLYWHEEL_SANDBOX_BACKEND": "docker", "DOCKER_HOST": "unix:///nonexistent/docker.sock"},
     "cannot reach a Docker engine"),
])
def test_a_backend_that_cannot_run_fails_at_start_saying_why(env: dict[str, str], says: str) -> None:
    out = subprocess.run([sys.executable, "-m", "flywheel_sandbox"], env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 1 and says in out.stderr, out.stderr


async def test_a_start_cancelled_while_the_agent_boots_leaves_nothing_running(
        backend: LocalBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm-pool start cancelled by the service stopping, while the sandbox's agent has not
    answered yet: the sandbox is killed, not left running (nor handed to the pool after all)."""
    import psutil

    from flywheel_sandbox import backends

    silent = b"import time\ntime.sleep(600)\n"  # an agent that never answers its first frame
    monkeypatch.setattr(backends, "agent_preamble", lambda: b"%d\n" % len(silent) + silent)
    me = psutil.Process()

    def sandboxes() -> list[psutil.Process]:
        return [p for p in me.children() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                and "bwrap" in p.name()]

    before = {p.pid for p in sandboxes()}
    starting = asyncio.ensure_future(backend.start(SandboxSpec()))
    await until(lambda: bool({p.pid for p in sandboxes()} - before), what="the sandbox's process running")
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    await until(lambda: not {p.pid for p in sandboxes()} - before, what="the sandbox's process gone")
