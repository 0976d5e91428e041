"""The compose deployment, checked without an engine: the files parse for both profiles, every
setting they pass is one the services read, and every command they run exists.

``docker-compose config`` validates the files where docker-compose is installed
(scripts/setup-docker.sh; CI installs it); the other checks read the YAML directly. The
deployment itself runs in tests/e2e/test_compose.py (marker ``docker``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from flywheel.contract import natsusers
from flywheel.contract.settings import SECTIONS, Settings

COMPOSE_DIR = Path(__file__).resolve().parents[2] / "compose"
FILES = ("docker-compose.yml", "docker-compose.override.yml", "docker-compose.host.yml")
PROFILES = ("cpu", "gpu")
# Read by Settings itself to find the TOML file; not a setting.
META_VARIABLES = {"FLYWHEEL_CONFIG"}
PYTHON_IMAGE_FILES = {"Dockerfile", "vllm.Dockerfile"}


def setting_defaults() -> dict[str, Any]:
    """Every FLYWHEEL_* variable Settings reads, with its default: a flat setting's, and each
    field of a section as FLYWHEEL_<SECTION>__<FIELD>."""
    found = {f"FLYWHEEL_{name.upper()}": f.default for name, f in Settings.model_fields.items() if name not in SECTIONS}
    for section in SECTIONS:
        section_class = Settings.model_fields[section].annotation
        for name, f in section_class.model_fields.items():  # type: ignore[union-attr]  # sections are settings classes
            found[f"FLYWHEEL_{section.upper()}__{name.upper()}"] = f.default
    return found


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((COMPOSE_DIR / name).read_text())


def services() -> dict[str, dict[str, Any]]:
    """Every service of both files (the host file's entries merged over the main file's)."""
    merged: dict[str, dict[str, Any]] = {}
    for name in FILES:
        for service, spec in load(name)["services"].items():
            merged.setdefault(service, {})
            merged[service] = {**merged[service], **spec,
                               "environment": {**merged[service].get("environment", {}), **spec.get("environment", {})}}
    return merged


NATS_PASSWORDS = {natsusers.password_variable(user): f"{user}-secret" for user in natsusers.USERS}


def compose_config(*args: str, password: str | None = "secret",
                   nats_passwords: dict[str, str] = NATS_PASSWORDS) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "POSTGRES_PASSWORD" and k not in NATS_PASSWORDS}
    env |= nats_passwords
    if password is not None:
        env["POSTGRES_PASSWORD"] = password
    return subprocess.run(["docker-compose", "--project-directory", str(COMPOSE_DIR), *args, "config"],
                          env=env, capture_output=True, text=True, timeout=60, check=False)


needs_compose = pytest.mark.skipif(shutil.which("docker-compose") is None,
                                   reason="docker-compose not installed: run scripts/setup-docker.sh (as root)")


@needs_compose
@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("host_network", [False, True], ids=["compose-network", "host-network"])
def test_docker_compose_config_accepts_both_profiles(profile: str, host_network: bool) -> None:
    override = FILES[2] if host_network else FILES[1]
    proc = compose_config("-f", str(COMPOSE_DIR / FILES[0]), "-f", str(COMPOSE_DIR / override), "--profile", profile)
    assert proc.returncode == 0, proc.stderr
    config = yaml.safe_load(proc.stdout)
    expected = {"nats", "postgres", "gateway", "recorder", "scorer", "sandbox"} | (
        {"inference-cpu", "trainer-cpu"} if profile == "cpu" else {"inference", "trainer"})
    assert expected <= set(config["services"])
    for name in expected:
        assert config["services"][name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    if host_network:  # every service on the host network, none publishing a port
        assert {s.get("network_mode") for s in config["services"].values()} == {"host"}
        assert not any(s.get("ports") for s in config["services"].values())
    else:
        assert config["services"]["gateway"]["ports"]


@needs_compose
def test_docker_compose_config_refuses_a_missing_password() -> None:
    proc = compose_config("-f", str(COMPOSE_DIR / FILES[0]), password=None)
    assert proc.returncode != 0
    assert "set POSTGRES_PASSWORD" in proc.stderr


@needs_compose
def test_docker_compose_config_refuses_a_missing_nats_password() -> None:
    missing = {k: v for k, v in NATS_PASSWORDS.items() if k != "NATS_SCORER_PASSWORD"}
    proc = compose_config("-f", str(COMPOSE_DIR / FILES[0]), nats_passwords=missing)
    assert proc.returncode != 0
    assert "set NATS_SCORER_PASSWORD (in compose/.env)" in proc.stderr


def test_nats_conf_is_the_users_table_and_each_service_logs_in_as_its_own_user() -> None:
    """The nats container writes natsusers.server_config from its environment at start (moving a
    store made before into the operator's account) and runs nats-server on it; it gets every
    password, each Flywheel service its own user and that user's password alone, the trainer
    service (the orchestrator) also its trainers' login, and only nats-init, which makes the
    streams, the operator's."""
    specs = services()
    assert set(specs["nats"]["environment"]) == set(NATS_PASSWORDS)
    commands = {name: " ".join(load(name)["services"]["nats"]["command"]) for name in FILES
                if "command" in load(name)["services"].get("nats", {})}
    assert set(commands) == {"docker-compose.yml", "docker-compose.host.yml"}
    for name, command in commands.items():
        written = re.search(r"python3 -m flywheel\.contract\.natsusers (\S+) --store /nats && exec nats-server .*"
                            r"--store_dir /nats .*--config (\S+)", command, re.S)
        assert written and written.group(1) == written.group(2), (name, command)
    expected = {"gateway": "gateway", "recorder": "recorder", "scorer": "scorer", "sandbox": "sandbox",
                "inference": "inference", "inference-cpu": "inference", "trainer": "orchestrator",
                "trainer-cpu": "orchestrator", "nats-init": "operator", "training-api": "training_api"}
    for service, user in expected.items():
        env = specs[service]["environment"]
        assert (env["FLYWHEEL_NATS_USER"], env["FLYWHEEL_NATS_PASSWORD"]) == (
            user, "${" + natsusers.password_variable(user) + "}"), service
        passwords = {k for k, v in env.items() if "PASSWORD" in k and "NATS" in v}
        assert passwords == {"FLYWHEEL_NATS_PASSWORD"} | ({"FLYWHEEL_NATS_TRAINER_PASSWORD"} if user == "orchestrator"
                                                          else set()), service
        if user == "orchestrator":
            assert env["FLYWHEEL_NATS_TRAINER_PASSWORD"] == "${NATS_TRAINER_PASSWORD}", service
    assert set(expected) | {"nats", "postgres", "otel-collector", "prometheus"} == set(specs)  # the last two: no NATS


def test_only_nats_init_makes_the_streams_and_every_service_waits_for_it() -> None:
    """The services may not make streams: nats-init makes them as the operator once nats is
    healthy, and every service that uses the bus starts after it completed."""
    specs = load("docker-compose.yml")["services"]
    assert specs["nats-init"]["command"] == ["python", "-m", "flywheel.ops.provision"]
    assert specs["nats-init"]["depends_on"] == {"nats": {"condition": "service_healthy"}}
    for service, spec in specs.items():
        if "FLYWHEEL_NATS_USER" in spec.get("environment", {}) and service != "nats-init":
            assert spec["depends_on"]["nats-init"] == {"condition": "service_completed_successfully"}, service


def test_every_flywheel_variable_is_a_setting() -> None:
    fields = set(setting_defaults())
    passed = {var for spec in services().values() for var in spec.get("environment", {}) if var.startswith("FLYWHEEL_")}
    assert passed, "compose passes no FLYWHEEL_* settings"
    unknown = passed - fields - META_VARIABLES
    assert not unknown, f"compose passes variables no Settings field reads: {sorted(unknown)}"


def test_passed_through_settings_keep_their_defaults() -> None:
    """``FLYWHEEL_X: ${FLYWHEEL_X:-D}`` hands a user's setting on; unset, it must mean what
    unset means everywhere else: D is the setting's own default."""
    passed = 0
    for spec in services().values():
        for var, value in spec.get("environment", {}).items():
            match = re.fullmatch(r"\$\{(FLYWHEEL_\w+):-([^}]*)\}", str(value))
            if match and match.group(1) == var:
                default = setting_defaults()[var]
                assert match.group(2) == str(default), f"{var}: compose default {match.group(2)!r}, " \
                                                       f"Settings default {default!r}"
                passed += 1
    assert passed >= 3  # gateway_port, inference_port, sandbox_image at least


def test_mounted_toml_holds_only_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    toml = COMPOSE_DIR / "flywheel.toml"
    keys = set(tomllib.loads(toml.read_text()))
    assert keys and keys <= set(Settings.model_fields), keys - set(Settings.model_fields)
    for var in [v for v in os.environ if v.startswith("FLYWHEEL_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("FLYWHEEL_CONFIG", str(toml))
    settings = Settings()  # extra="forbid": a key that is no setting fails here
    assert {k: getattr(settings, k) for k in keys} == tomllib.loads(toml.read_text())
    mounts = [v for spec in services().values() for v in spec.get("volumes", []) if isinstance(v, str)]
    assert "./flywheel.toml:/etc/flywheel/flywheel.toml:ro" in mounts


def test_every_service_command_exists() -> None:
    """Each command answers --help (thin entry points: no heavy imports); binaries exist."""
    bin_dir = Path(sys.executable).parent
    checked = set()
    for name, spec in services().items():
        command = spec.get("command")
        if name == "postgres":
            assert command is not None and command[0] == "postgres"  # the official image's own command
            continue
        if name in ("prometheus", "otel-collector"):  # their images' own entry points, given a config we ship
            assert command is not None and any(arg.startswith("--config") for arg in command), command
            assert all((COMPOSE_DIR / volume.split(":")[0]).is_file() for volume in spec["volumes"]
                       if volume.startswith("./")), spec["volumes"]
            continue
        assert command, f"{name} has no command"
        if command[0] in ("python", "python3"):
            assert command[1] == "-m", command
            subcommand = command[3:4] if len(command) > 3 and not command[3].startswith("-") else []
            argv = [sys.executable, *command[1:3], *subcommand, "--help"]
        elif command[0] == "flywheel":
            argv = [str(bin_dir / "flywheel"), command[1], "--help"]
        else:
            assert (bin_dir / command[0]).exists() or shutil.which(command[0]), f"{name}: {command[0]} not found"
            continue
        if tuple(argv) in checked:
            continue
        checked.add(tuple(argv))
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, f"{name}: {' '.join(command)} --help failed:\n{proc.stderr[-2000:]}"


def test_healthchecks_and_files_the_images_need_exist() -> None:
    assert (COMPOSE_DIR / "healthcheck.py").is_file()
    for spec in services().values():
        test = spec.get("healthcheck", {}).get("test", [])
        if "flywheel-healthcheck" in test:
            assert test[0] == "CMD" and len(test) == 3, test
    for dockerfile in PYTHON_IMAGE_FILES:
        text = (COMPOSE_DIR / dockerfile).read_text()
        assert "compose/healthcheck.py" in text and "compose/requirements.py" in text
    run_config = Path(COMPOSE_DIR, "..", "examples", "reverse-text.toml").resolve()
    assert run_config.is_file()  # the trainer's default RUN_CONFIG


def test_env_example_names_only_variables_compose_reads() -> None:
    text = "".join((COMPOSE_DIR / name).read_text() for name in FILES)
    names = [line.split("=", 1)[0] for line in (COMPOSE_DIR / ".env.example").read_text().splitlines()
             if line and not line.startswith("#")]
    assert "POSTGRES_PASSWORD" in names
    unread = [name for name in names if "${" + name not in text]
    assert not unread, f".env.example sets variables no compose file reads: {unread}"


def test_requirements_script_expands_extras() -> None:
    script, pyproject = str(COMPOSE_DIR / "requirements.py"), str(COMPOSE_DIR.parent / "pyproject.toml")
    proc = subprocess.run([sys.executable, script, pyproject, "inference,gateway"], capture_output=True, text=True,
                          check=True)
    lines = proc.stdout.split()
    assert "torch==2.13.0" in lines and "msgspec>=0.19" in lines
    assert not any(line.startswith("flywheel-rl") for line in lines)
    bad = subprocess.run([sys.executable, script, pyproject, "nope"], capture_output=True, text=True, check=False)
    assert bad.returncode != 0 and "extra 'nope'" in bad.stderr


@needs_compose
@pytest.mark.parametrize("profile", PROFILES)
def test_the_cluster_override_routes_three_nodes_and_gives_every_service_each(profile: str) -> None:
    """docker-compose.cluster.yml (bridge network): three nats nodes, each named once and routed to
    the other two, each writing its users' config; every Flywheel service lists all three and
    makes its streams with three replicas."""
    proc = compose_config("-f", str(COMPOSE_DIR / FILES[0]), "-f", str(COMPOSE_DIR / FILES[1]),
                          "-f", str(COMPOSE_DIR / "docker-compose.cluster.yml"), "--profile", profile)
    assert proc.returncode == 0, proc.stderr
    config = yaml.safe_load(proc.stdout)["services"]
    nodes = {"nats": "n1", "nats-2": "n2", "nats-3": "n3"}
    for service, name in nodes.items():
        command = " ".join(config[service]["command"])
        assert "python3 -m flywheel.contract.natsusers /tmp/nats-users.conf && exec nats-server" in command
        assert re.search(rf"--name {name} --cluster_name flywheel --cluster nats://0\.0\.0\.0:6222 ", command), command
        routes = re.search(r"--routes (\S+)", command)
        assert routes is not None, command
        assert set(routes.group(1).split(",")) == {f"nats://{other}:6222" for other in nodes if other != service}
        assert set(config[service]["environment"]) == set(NATS_PASSWORDS), service
    flywheel_services = [s for s, spec in config.items() if "FLYWHEEL_DATA_DIR" in spec.get("environment", {})]
    assert len(flywheel_services) >= 6, flywheel_services
    for service in flywheel_services:
        env = config[service]["environment"]
        assert env["FLYWHEEL_NATS_URL"].split(",") == [f"nats://{node}:4222" for node in nodes], service
        assert env["FLYWHEEL_NATS_CLUSTER"] == "3", service


def test_the_trainer_services_start_trainer_ranks_ranks() -> None:
    """``TRAINER_RANKS=N docker compose up``: each run's trainer runs N data-parallel ranks."""
    for service in ("trainer", "trainer-cpu"):
        assert services()[service]["environment"]["FLYWHEEL_TRAINER__RANKS"] == "${TRAINER_RANKS:-1}", service


def test_the_sandbox_services_relay_folder_has_one_path_in_its_container_and_on_the_engines_host() -> None:
    spec = services()["sandbox"]
    folder = spec["environment"]["FLYWHEEL_SANDBOX_RELAY_DIR"]
    assert f"{folder}:{folder}" in spec["volumes"]
