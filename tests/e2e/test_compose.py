"""The compose deployment brought up for real: images built here, the CPU profile, a run scored.

Where a Docker engine can be started (tests/docker_engine.py), this builds the Flywheel
image from the locally made Debian base (pip installs from a wheelhouse that the host's pip
fills and a loopback HTTP server serves, so the build needs no registry of its own) and a
PostgreSQL image from the same base (Debian's package: the official image cannot be pulled
here), then brings up ``compose/docker-compose.yml`` with ``docker-compose.host.yml`` and
the ``cpu`` profile: every container on the host network, bound to 127.0.0.1, on free
ports. The trainer container runs a short run config; the test publishes tasks of its own
to that run through the gateway and waits until ``GET /v1/rollouts`` shows them scored and
``GET /v1/traces`` shows their trace graphs. Then ``down --volumes`` and a check that no
container or volume of the project is left. The two images stay, tagged, in the engine's
cache folder on purpose: the next run's build reuses their layers.

The sandbox service (docker backend) gets this engine's socket and runs a command in a
sandbox made from the same Debian base.

Not covered: the gpu profile (vLLM image, GPU reservations).
"""

from __future__ import annotations

import asyncio
import functools
import http.server
import json
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from flywheel.contract import natsusers
from flywheel.contract.bus import Bus
from flywheel.runtime.natsserver import free_port
from flywheel.sdk.sandbox import ExecResult, SandboxClient
from tests.docker_engine import REPO_ROOT, DockerEngine, cache_dir
from tests.e2e.test_up import refused_as_scorer

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]

COMPOSE_DIR = REPO_ROOT / "compose"
IMAGE = "flywheel-local/flywheel:compose-test"
POSTGRES_IMAGE = "flywheel-local/postgres:compose-test"
SERVICES = ("nats", "postgres", "gateway", "recorder", "scorer", "sandbox", "inference-cpu", "trainer-cpu")
UP_TIMEOUT_S = 600.0
HEALTHY_TIMEOUT_S = 300.0
SCORED_TIMEOUT_S = 600.0  # the SFT warm-up first: seconds alone, minutes on a busy machine
NUM_TASKS = 3
NUM_ROLLOUTS = 2
# The wheelhouse's URL is a build argument, and a changed argument misses the build cache:
# a fixed address keeps it the same from run to run.
WHEELHOUSE_ADDRESS = ("127.0.0.1", 38383)

T = TypeVar("T")

# Few tasks of its own and steps it cannot reach: the run stays live, and no backlog delays
# the tasks the test publishes to it; `down` stops it.
RUN_CONFIG = """\
run = "compose-smoke"
env = "reverse_text"
group_size = 4
num_tasks = 4

[model]
name = "tiny"

[sampling]
max_tokens = 12

# The format first (letters, then stop), as in examples/reverse-text.toml: the test checks
# the deployment, not what an untrained model's random bytes do to the store.
[sft]
steps = 60
batch_size = 32
lr = 3e-3

[trainer]
batch_size = 8
num_steps = 100000
max_off_policy_steps = 1
"""


@pytest.fixture(scope="module")
def wheelhouse_url() -> Iterator[str]:
    """Every requirement of the image as wheels (the host's pip downloads them, honouring its
    own config), served on a loopback port for the duration of the builds."""
    wheels = cache_dir() / "wheels"
    requirements = subprocess.run([sys.executable, str(COMPOSE_DIR / "requirements.py"),
                                   str(REPO_ROOT / "pyproject.toml"), "all"],
                                  capture_output=True, text=True, check=True).stdout.split()
    download = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(wheels),
                               "setuptools>=69", "wheel", *requirements], capture_output=True, text=True, timeout=1200,
                              check=False)
    assert download.returncode == 0, f"pip download of the image's requirements failed:\n{download.stderr[-3000:]}"
    handler = functools.partial(QuietHandler, directory=str(wheels))
    try:
        server = http.server.ThreadingHTTPServer(WHEELHOUSE_ADDRESS, handler)
    except OSError:  # taken: any free port works, only the build cache is missed
        server = http.server.ThreadingHTTPServer((WHEELHOUSE_ADDRESS[0], 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def build(engine: DockerEngine, tag: str, dockerfile: Path, context: Path, **args: str) -> float:
    """``docker build`` on the host network (the builds reach loopback servers and apt's mirror);
    returns the seconds it took."""
    started = time.monotonic()
    build_args = [a for name, value in args.items() for a in ("--build-arg", f"{name}={value}")]
    engine.docker("build", "--network", "host", "--quiet", "-f", str(dockerfile), "-t", tag, *build_args, str(context),
                  timeout_s=1800)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def images(docker_engine: DockerEngine, debian_base: str, wheelhouse_url: str) -> dict[str, str]:
    flywheel_s = build(docker_engine, IMAGE, COMPOSE_DIR / "Dockerfile", REPO_ROOT, BASE_IMAGE=debian_base,
                       PIP_ARGS=f"--no-index --find-links {wheelhouse_url}")
    postgres_dir = Path(__file__).with_name("postgres_image")
    postgres_s = build(docker_engine, POSTGRES_IMAGE, postgres_dir / "Dockerfile", postgres_dir, BASE_IMAGE=debian_base)
    # A rebuild leaves the previous image untagged: remove it (only this engine's dangling images).
    docker_engine.docker("image", "prune", "--force")
    print(f"built {IMAGE} in {flywheel_s:.0f}s, {POSTGRES_IMAGE} in {postgres_s:.0f}s")
    return {"IMAGE": IMAGE, "POSTGRES_IMAGE": POSTGRES_IMAGE}


class Deployment:
    """One compose project on the host network; ``compose(...)`` runs docker-compose on it."""

    def __init__(self, engine: DockerEngine, env: dict[str, str], project: str) -> None:
        self.engine = engine
        self.env = env
        self.project = project
        self.gateway = f"http://127.0.0.1:{env['FLYWHEEL_GATEWAY_PORT']}"
        self.sandboxes_before = self.sandboxes()  # other tests' in this engine are not this deployment's

    def compose(self, *args: str, timeout_s: float = 300.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = ["docker-compose", "--project-name", self.project, "--project-directory", str(COMPOSE_DIR),
               "-f", str(COMPOSE_DIR / "docker-compose.yml"), "-f", str(COMPOSE_DIR / "docker-compose.host.yml"),
               "--profile", "cpu", *args]
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout_s, check=False)
        if check and proc.returncode != 0:
            raise AssertionError(f"docker-compose {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
                                 f"\n{proc.stderr[-3000:]}\n{self.logs()}")
        return proc

    def logs(self) -> str:
        proc = self.compose("logs", "--no-color", "--tail", "30", check=False, timeout_s=60)
        return f"--- service logs (last lines) ---\n{proc.stdout[-12000:]}"

    def healthy(self) -> set[str]:
        """The services of the project whose containers' healthchecks pass."""
        lines = self.engine.docker("ps", "--filter", f"label=com.docker.compose.project={self.project}", "--format",
                                   '{{.Label "com.docker.compose.service"}} {{.Status}}').stdout.splitlines()
        return {line.split()[0] for line in lines if "(healthy)" in line}

    def listeners(self) -> list[str]:
        """Every TCP socket the project's processes listen on (``ss``: address:port process)."""
        pids: set[str] = set()
        for container in self.engine.docker("ps", "--quiet", "--filter",
                                            f"label=com.docker.compose.project={self.project}").stdout.split():
            top = self.engine.docker("top", container, "-eo", "pid").stdout.split()[1:]
            pids.update(top)
        found = []
        for line in subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines():
            fields = line.split()
            owners = re.findall(r"pid=(\d+)", line)
            if any(pid in pids for pid in owners):
                found.append(f"{fields[3]} {fields[-1]}")
        return found

    def num_dead_letters(self) -> int:
        """Messages in the DEAD stream, read by ``flywheel status`` from this machine."""
        proc = subprocess.run([str(Path(sys.executable).with_name("flywheel")), "status", "--json",
                               "--nats-url", self.operator_url, "--gateway-url", self.gateway],
                              capture_output=True, text=True, timeout=60, check=True)
        return next(s["messages"] for s in json.loads(proc.stdout)["streams"] if s["stream"] == "DEAD")

    @property
    def operator_url(self) -> str:
        """The deployment's nats-server, logging in as the operator (the command line's user)."""
        url = f"nats://127.0.0.1:{self.env['FLYWHEEL_NATS_PORT']}"
        return natsusers.with_user(url, natsusers.OPERATOR, self.env[natsusers.password_variable(natsusers.OPERATOR)])

    def sandboxes(self) -> set[str]:
        """Ids of the engine's sandbox containers (the sandbox service labels them)."""
        return set(self.engine.docker("ps", "--all", "--quiet", "--no-trunc", "--filter",
                                      "label=flywheel.sdk.sandbox").stdout.split())

    def leftovers(self) -> list[str]:
        label = f"label=com.docker.compose.project={self.project}"
        containers = self.engine.docker("ps", "--all", "--quiet", "--filter", label).stdout.split()
        # The sandbox service removes the containers it started when it stops.
        containers += sorted(self.sandboxes() - self.sandboxes_before)
        volumes = self.engine.docker("volume", "ls", "--quiet", "--filter", label).stdout.split()
        return containers + volumes


@pytest.fixture
def deployment(docker_engine: DockerEngine, debian_base: str, images: dict[str, str],
               tmp_path: Path) -> Iterator[Deployment]:
    if subprocess.run(["docker-compose", "version"], capture_output=True, check=False).returncode != 0:
        pytest.skip("docker-compose not installed: run scripts/setup-docker.sh (as root)")
    run_config = tmp_path / "run.toml"
    run_config.write_text(RUN_CONFIG)
    ports = {name: str(free_port()) for name in ("FLYWHEEL_NATS_PORT", "NATS_MONITOR_PORT", "POSTGRES_PORT",
                                                  "FLYWHEEL_GATEWAY_PORT", "FLYWHEEL_INFERENCE_PORT")}
    # The sandbox service starts its containers in this engine, from the base (it has python3).
    passwords = {natsusers.password_variable(user): secrets.token_urlsafe(16) for user in natsusers.USERS}
    env = {**docker_engine.env, **images, **ports, **passwords, "POSTGRES_PASSWORD": secrets.token_hex(12),
           "RUN_CONFIG": str(run_config), "DOCKER_SOCKET": str(docker_engine.socket),
           "FLYWHEEL_SANDBOX_IMAGE": debian_base}
    # Settings of the test process itself must not leak into the containers' interpolation.
    for name in [n for n in env if n.startswith("FLYWHEEL_") and n not in ports and n != "FLYWHEEL_SANDBOX_IMAGE"]:
        del env[name]
    deployed = Deployment(docker_engine, env, f"fwsmoke{secrets.token_hex(4)}")
    try:
        yield deployed
    finally:
        deployed.compose("down", "--volumes", "--remove-orphans", "--timeout", "20", timeout_s=180)
        left = deployed.leftovers()
        assert not left, f"docker-compose down left containers or volumes behind: {left}"


def wait_for(what: str, deployment: Deployment, timeout_s: float, check: Callable[[], T | None]) -> T:
    """Poll ``check()`` until it returns something truthy; fail with the services' logs."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except httpx.HTTPError as exc:
            last_error = exc
        time.sleep(1.0)  # noqa: sleep - the polling interval of this bounded wait
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what} (last error: {last_error})\n"
                         f"{deployment.logs()}")


async def run_in_sandbox(deployment: Deployment, cmd: str) -> ExecResult:
    """One command in a sandbox of the deployed sandbox service (docker backend), as a verifier runs it."""
    bus = await Bus.connect(deployment.operator_url, "compose-smoke", ensure=False)
    try:
        return await SandboxClient(bus).run(cmd, timeout_s=60.0)
    finally:
        await bus.close()


def test_cpu_profile_scores_published_tasks(deployment: Deployment) -> None:
    started = time.monotonic()
    # `up` returns once every container runs, each started after its dependencies were healthy.
    deployment.compose("up", "--detach", "--no-build", *SERVICES, timeout_s=UP_TIMEOUT_S)
    up_s = time.monotonic() - started
    wait_for("every service's healthcheck to pass", deployment, HEALTHY_TIMEOUT_S,
             lambda: set(SERVICES) <= deployment.healthy())
    healthy_s = time.monotonic() - started
    if shutil.which("ss"):  # loopback only: no service of the stack listens beyond this machine
        listeners = deployment.listeners()
        assert len(listeners) >= 5, listeners  # nats (2), postgres, gateway, inference at least
        assert all(line.startswith("127.0.0.1:") for line in listeners), listeners

    result = asyncio.run(run_in_sandbox(deployment, "python3 -c 'print(6 * 7)'"))
    assert (result.exit_code, result.stdout) == (0, "42\n"), result
    # Its nats-server has a user a service: the scorer's cannot publish weights; no login, no bus.
    passwords = {user: deployment.env[natsusers.password_variable(user)] for user in natsusers.USERS}
    asyncio.run(refused_as_scorer(int(deployment.env["FLYWHEEL_NATS_PORT"]), passwords))

    with httpx.Client(base_url=deployment.gateway, timeout=10.0) as http:
        health = http.get("/healthz")
        assert health.status_code == 200, health.text

        def registered_run() -> str | None:
            runs = http.get("/v1/runs").raise_for_status().json()["items"]
            # `flywheel run --resume` trains the run the config names, under its own id.
            return next((r["id"] for r in runs if r["id"] == "compose-smoke"), None)

        run = wait_for("the trainer container to register its run", deployment, 120.0, registered_run)
        rows = [{"text": text} for text in ("abcd", "hgfe", "jiab")[:NUM_TASKS]]
        accepted = http.post("/v1/tasks", json=[{"run": run, "env": "reverse_text", "data": row,
                                                 "num_rollouts": NUM_ROLLOUTS} for row in rows])
        assert accepted.status_code in (200, 201, 202), accepted.text
        task_ids = set(accepted.json()["ids"])

        def scored_rollouts() -> list[dict] | None:
            if num_dead := deployment.num_dead_letters():  # a dead letter never turns into a rollout: fail now
                raise AssertionError(f"{num_dead} messages dead-lettered (see the DEAD stream)\n{deployment.logs()}")
            items: list[dict] = []
            cursor: str | None = None
            while True:
                params: dict[str, str | int] = {"run": run, "limit": 500}
                if cursor:
                    params["cursor"] = cursor
                page = http.get("/v1/rollouts", params=params).raise_for_status().json()
                items += [r for r in page["items"] if r["task_id"] in task_ids and r["reward"] is not None]
                cursor = page["next_cursor"]
                if cursor is None:
                    break
            return items if len(items) >= NUM_TASKS * NUM_ROLLOUTS else None

        rollouts = wait_for("the published tasks' scored rollouts", deployment, SCORED_TIMEOUT_S, scored_rollouts)
        assert {r["task_id"] for r in rollouts} == task_ids
        assert all(0.0 <= r["reward"] <= 1.0 for r in rollouts), rollouts
        detail = http.get(f"/v1/rollouts/{rollouts[0]['id']}").raise_for_status().json()
        assert detail["scores"] and detail["task_data"] in rows
        trace = http.get(f"/v1/traces/{rollouts[0]['id']}").raise_for_status().json()
        assert trace["nodes"], trace
    # The backups of docs/deployment.md: the trace store dumped while it runs, a volume read by the image's tar.
    dump = deployment.compose("exec", "-T", "postgres", "pg_dump", "-U", "flywheel", "flywheel", timeout_s=120).stdout
    assert "CREATE TABLE public.rollouts" in dump and rollouts[0]["id"] in dump
    volume = f"{deployment.project}_data"
    listing = deployment.engine.docker("run", "--rm", "--network", "none", "-v", f"{volume}:/v:ro",
                                       "--entrypoint", "sh", IMAGE, "-c", "tar -czf - -C /v . | tar -tzf -").stdout
    assert f"./runs/{run}/config.json" in listing.split(), listing[:2000]
    print(f"compose up {up_s:.0f}s, all healthy after {healthy_s:.0f}s, "
          f"scored rollouts after {time.monotonic() - started:.0f}s")
