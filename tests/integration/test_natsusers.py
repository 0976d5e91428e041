"""The NATS users against a real nats-server running natsusers.server_config: each service's
user finds the streams the operator made, does what every service does (beat, read runs,
consume its durables) and publishes what that service publishes; everything else it publishes
is refused, at once, naming the subject and the user. What each user may do on every stream and
bucket, and the reply-subject writes, are tried in tests/security/test_nats_permissions.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from flywheel.contract import natsusers
from flywheel.contract.bus import Bus, BusConfig, NotProvisioned, PermissionDenied
from flywheel.contract.runs import get_run
from flywheel.contract.settings import Settings
from flywheel.runtime.natsserver import NatsServer

# A subject of each kind a service might publish to, and the users that may.
SUBJECTS = {
    "tasks.r1.echo": {"orchestrator", "gateway"},
    "rollouts.r1.echo.3": {"orchestrator", "inference"},
    "traces.r1.echo": {"inference"},
    "scores.r1.echo.s": {"orchestrator", "scorer"},
    "signals.r1.echo.t": {"inference"},
    "weights.r1": {"trainer"},
    "usage.r1.sandbox": {"trainer", "inference", "sandbox", "training_api"},
    "dead.TASKS": {"recorder", "inference"},
    "dead.ROLLOUTS": {"trainer", "recorder", "inference", "scorer"},
    "$KV.flywheel-runs.r1": {"orchestrator", "trainer", "gateway"},
    "$KV.flywheel-keys.k1": {"gateway"},
    "$KV.flywheel-admission.r1": {"inference"},
    "$KV.flywheel-partitions.scorer.partition.3": {"scorer"},
    "$KV.flywheel-services.gateway.i1": {"gateway", "scorer"},  # a scorer beats under its own name
    "$O.flywheel-weights.C.x": {"trainer"},
}
# A consumer each user pulls from, with its filter.
DURABLES: dict[str, tuple[str, str, str | None] | None] = {
    "orchestrator": None, "trainer": ("ROLLOUTS", "trainer-r1-rollouts", "rollouts.r1.>"), "gateway": None,
    "recorder": ("TASKS", "recorder-tasks", None), "inference": ("TASKS", "inference", None),
    "scorer": ("ROLLOUTS", "scorer-p3", "rollouts.*.*.3"), "sandbox": None, "training_api": None}


@pytest.fixture
def users_server(tmp_path: Path):
    passwords = natsusers.load_or_create(tmp_path)
    server = NatsServer(tmp_path / "nats", config=natsusers.server_config(passwords)).start()
    try:
        yield server, passwords
    finally:
        server.stop()


async def publishes(bus: Bus, subject: str) -> bool:
    """Whether the server takes a publish of ``user`` to ``subject`` (False: refused)."""
    try:
        await bus.publish_raw(subject, b"{}", {"Nats-Msg-Id": f"{bus.user}-{subject}"})
    except PermissionDenied as exc:
        assert f"user {bus.user!r}" in str(exc) and repr(subject) in str(exc), exc
        return False
    return True


@pytest.mark.parametrize("user", natsusers.SERVICE_USERS)
async def test_each_user_does_its_service_s_work_and_publishes_only_its_subjects(users_server, user: str) -> None:
    server, passwords = users_server
    operator = await Bus.connect(natsusers.with_user(server.url, natsusers.OPERATOR, passwords["operator"]), "op")
    try:
        # What every service does: connect and find its streams, beat, read a run, consume.
        bus = await Bus.connect(natsusers.with_user(server.url, user, passwords[user]), user,
                                BusConfig(request_timeout_s=0.5, publish_timeout_s=5))
        try:
            await (await bus.services_kv()).put(f"{user}.test", b"{}")
            if user not in ("sandbox", "training_api"):  # which read no runs
                assert await get_run(bus, "nope") is None
            pulls = DURABLES[user]
            if pulls is not None:
                stream, durable, subject = pulls
                # As flywheel.contract.bus.Consumer makes its durable, then pulls from it.
                await bus.js.add_consumer(stream, ConsumerConfig(durable_name=durable, filter_subject=subject,
                                                                 ack_policy=AckPolicy.EXPLICIT))
                consumer = await bus.js.pull_subscribe_bind(durable, stream)
                with pytest.raises(TimeoutError):
                    await consumer.fetch(1, timeout=0.2)
            taken = dict(zip(SUBJECTS, await asyncio.gather(*(publishes(bus, s) for s in SUBJECTS)), strict=True))
            assert taken == {s: user in allowed for s, allowed in SUBJECTS.items()}
            with pytest.raises(PermissionDenied, match=r"(?i)the publish to .\$JS\.API\.STREAM\.PURGE\.TASKS"):
                await bus.retry(lambda: bus.js.purge_stream("TASKS"))
        finally:
            await bus.close()
        # What was refused never reached a stream.
        assert (await operator.js.stream_info("WEIGHTS")).state.messages == (1 if user == "trainer" else 0)
    finally:
        await operator.close()


async def test_a_service_finds_the_streams_made_and_names_one_missing(users_server) -> None:
    """Only the operator makes streams: a service connecting before them stops, naming the first
    missing one and who makes it; once the operator has made them, it connects."""
    server, passwords = users_server
    url = natsusers.with_user(server.url, "scorer", passwords["scorer"])
    with pytest.raises(NotProvisioned, match=r"the NATS KV bucket flywheel-services does not exist, and user "
                                             r"'scorer' may not make it: .*`flywheel up` does at start.*"
                                             r"flywheel\.ops\.provision"):
        await Bus.connect(url, "scorer")
    await (await Bus.connect(natsusers.with_user(server.url, "operator", passwords["operator"]), "op")).close()
    await (await Bus.connect(url, "scorer")).close()


def test_the_passwords_file_is_its_owners_alone_and_a_broken_one_is_named(tmp_path: Path) -> None:
    made = natsusers.load_or_create(tmp_path)
    assert set(made) == set(natsusers.USERS) and len(set(made.values())) == len(made)
    assert (tmp_path / natsusers.USERS_FILE).stat().st_mode & 0o777 == 0o600
    assert natsusers.load_or_create(tmp_path) == made == natsusers.read(tmp_path)  # made once
    # A file of a stack made before a user was added gets that user's password, the rest kept.
    (tmp_path / natsusers.USERS_FILE).write_text('{"operator": "x", "scorer": "y"}')
    grown = natsusers.load_or_create(tmp_path)
    assert set(grown) == set(natsusers.USERS) and (grown["operator"], grown["scorer"]) == ("x", "y")
    assert natsusers.read(tmp_path) == grown and (tmp_path / natsusers.USERS_FILE).stat().st_mode & 0o777 == 0o600
    (tmp_path / natsusers.USERS_FILE).write_text('{"scorer": "y"}')
    with pytest.raises(ValueError, match=r"nats-users\.json has no password for NATS user operator"):
        natsusers.read(tmp_path)
    assert natsusers.read(tmp_path / "elsewhere") is None


def test_urls_carry_the_login_and_show_no_password() -> None:
    url = natsusers.with_user("nats://127.0.0.1:4222", "scorer", "s3cret")
    assert url == "nats://scorer:s3cret@127.0.0.1:4222"
    assert natsusers.with_user(url, "gateway", "other") == "nats://gateway:other@127.0.0.1:4222"
    assert natsusers.redacted(url) == "nats://scorer:***@127.0.0.1:4222"
    assert natsusers.redacted("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"


def test_a_clusters_urls_each_carry_the_login() -> None:
    nodes = "nats://127.0.0.1:4222,nats://127.0.0.1:4223"
    url = natsusers.with_user(nodes, "scorer", "s,3cret")
    assert url == "nats://scorer:s%2C3cret@127.0.0.1:4222,nats://scorer:s%2C3cret@127.0.0.1:4223"
    assert natsusers.split_login(url) == (nodes, "scorer", "s,3cret")
    assert natsusers.redacted(url) == "nats://scorer:***@127.0.0.1:4222,nats://scorer:***@127.0.0.1:4223"
    settings = Settings(nats_port=4300, nats_cluster=3, data_dir=Path("/nonexistent"))
    assert settings.nats_server_url == "nats://127.0.0.1:4300,nats://127.0.0.1:4301,nats://127.0.0.1:4302"
    with pytest.raises(ValueError, match=r"nats_url must start with nats://.*'127\.0\.0\.1:4223'"):
        Settings(nats_url="nats://127.0.0.1:4222,127.0.0.1:4223")


async def test_a_password_with_url_characters_logs_in(tmp_path: Path) -> None:
    """A deployment's own password may hold what a URL quotes: it reaches the server as it is."""
    passwords = {user: f"{user}-p@ss/w:rd %x?#" for user in natsusers.USERS}
    server = NatsServer(tmp_path / "nats", config=natsusers.server_config(passwords)).start()
    try:
        url = natsusers.with_user(server.url, "scorer", passwords["scorer"])
        assert natsusers.split_login(url) == (server.url, "scorer", passwords["scorer"])
        bus = await Bus.connect(url, "test", ensure=False)
        assert bus.user == "scorer"
        await bus.close()
    finally:
        server.stop()


# What nats-server would read as another kind of value were it not quoted: a date, a size, a
# number, a variable, a boolean; and quotes and backslashes.
AWKWARD = ("12-ab", "5Kb", "7", "1.5J", "$HOME", "true", 'a"b\\c')


@pytest.mark.parametrize("password", AWKWARD)
async def test_the_deployments_config_takes_any_password_from_the_environment(
        tmp_path: Path, password: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m flywheel.contract.natsusers FILE`` (what the compose nats container runs at
    start) writes each NATS_<USER>_PASSWORD as the string it is: the server starts and the
    scorer logs in with it, where a ``$VARIABLE`` reference of such a value stops the server."""
    for user in natsusers.USERS:
        monkeypatch.setenv(natsusers.password_variable(user), password if user == "scorer" else f"x{user}")
    config = tmp_path / "nats.conf"
    assert natsusers.main([str(config)]) == 0
    assert config.stat().st_mode & 0o777 == 0o600
    server = NatsServer(tmp_path / "nats", config=config.read_text()).start()
    try:
        bus = await Bus.connect(natsusers.with_user(server.url, "scorer", password), "test", ensure=False)
        assert bus.user == "scorer"
        await bus.close()
    finally:
        server.stop()


def test_the_deployments_config_names_a_missing_password(tmp_path: Path) -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    environ |= {natsusers.password_variable(user): "pw" for user in natsusers.USERS if user != "sandbox"}
    proc = subprocess.run([sys.executable, "-m", "flywheel.contract.natsusers", str(tmp_path / "nats.conf")],
                          env=environ, capture_output=True, text=True, check=False)
    assert proc.returncode == 1
    assert "set NATS_SANDBOX_PASSWORD (in compose/.env)" in proc.stderr
    assert not (tmp_path / "nats.conf").exists()
