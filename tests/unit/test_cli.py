"""The ``flywheel`` command without a server: parsing, settings, --help cost, status tables."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from flywheel.contract import events
from flywheel.ops import cli
from flywheel.ops.commands import runs, tasks
from flywheel.ops.commands import stack as stack_commands
from flywheel.runtime.natsserver import free_port


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings read FLYWHEEL_*: keep the caller's out of these tests."""
    for name in ("CONFIG", "DATA_DIR", "NATS_URL", "NATS_PORT", "DATABASE_URL", "GATEWAY_HOST", "GATEWAY_PORT",
                 "GATEWAY_URL", "LOG_LEVEL"):
        monkeypatch.delenv(f"FLYWHEEL_{name}", raising=False)


def parse(*argv: str):
    return cli.build_parser().parse_args(argv)


def test_up_options_override_settings_of_the_same_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_GATEWAY_PORT", "9001")
    monkeypatch.setenv("FLYWHEEL_NATS_PORT", "4300")
    args = parse("up", "--data-dir", "/tmp/fw", "--gateway-port", "9002", "--database-url", "sqlite+aiosqlite:///x.db")
    assert args.func is stack_commands.cmd_up
    settings = cli.settings_from(args)
    assert settings.data_dir == Path("/tmp/fw")
    assert settings.gateway_port == 9002  # the option beats the variable
    assert settings.nats_port == 4300  # no option: the variable stands
    assert settings.database_url == "sqlite+aiosqlite:///x.db"


def test_config_file_is_read_and_options_win(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "flywheel.toml"
    config.write_text('nats_url = "nats://10.0.0.1:4222"\ngateway_port = 9100\n')
    monkeypatch.setenv("FLYWHEEL_CONFIG", str(config))
    settings = cli.settings_from(parse("status", "--gateway-port", "9200"))
    assert settings.nats_url == "nats://10.0.0.1:4222"
    assert settings.gateway_port == 9200


def test_runs_commands_and_the_runs_table() -> None:
    from datetime import UTC, timedelta

    from flywheel.ops.runs import format_runs

    assert parse("runs", "stop", "r1").func is runs.cmd_runs_stop and parse("runs", "stop", "r1").run == "r1"
    assert parse("runs", "list").setting_names == cli.NATS_SETTINGS
    assert "data_dir" in parse("runs", "resume", "r1").setting_names  # it may start the embedded stack
    assert parse("export", "r1", "out", "--step", "3").step == 3
    created = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    states = [
        events.RunState(id="old", status="finished", trainer_step=8, config={"trainer": {"num_steps": 8}},
                        created_at=created),
        events.RunState(id="gone", status="running", trainer_step=3, config={"trainer": {"num_steps": 8}},
                        owner="flywheel-run pid 7 on box", lease_expires_at=created,
                        created_at=created + timedelta(hours=1)),
        events.RunState(id="evals", kind="eval", tenant="acme", created_at=created + timedelta(hours=2)),
    ]
    lines = format_runs(states).splitlines()
    assert lines[0].split() == ["run", "kind", "status", "step", "tenant", "created", "owner"]
    assert [line.split()[:5] for line in lines[1:]] == [["evals", "eval", "created", "0", "acme"],
                                                        ["gone", "train", "abandoned", "3/8", "default"],
                                                        ["old", "train", "finished", "8/8", "default"]]
    assert lines[2].endswith("flywheel-run pid 7 on box")
    assert format_runs([]) == "no runs (`flywheel run CONFIG` starts one)"


def test_each_command_takes_only_the_settings_it_uses() -> None:
    assert parse("status").setting_names == cli.NATS_SETTINGS + cli.GATEWAY_SETTINGS
    with pytest.raises(SystemExit):
        parse("status", "--database-url", "sqlite+aiosqlite:///x.db")
    with pytest.raises(SystemExit):
        parse("schema", "--nats-url", "nats://127.0.0.1:1")


def test_tasks_publish_arguments() -> None:
    args = parse("tasks", "publish", "reverse-text", "--run", "r1", "--file", "rows.jsonl")
    assert (args.func, args.env, args.run, args.file) == (tasks.cmd_tasks_publish, "reverse-text", "r1", "rows.jsonl")
    assert (args.num_rollouts, args.tenant) == (1, "default")
    args = parse("tasks", "publish", "e", "--run", "r", "--file", "f", "--num-rollouts", "8", "--tenant", "acme",
                 "--nats-url", "nats://127.0.0.1:5000")
    assert (args.num_rollouts, args.tenant, args.nats_url) == (8, "acme", "nats://127.0.0.1:5000")
    with pytest.raises(SystemExit):
        parse("tasks", "publish", "e", "--file", "f")  # --run is required


def test_bad_setting_is_an_error_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "--nats-url", "localhost:4222"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("flywheel: error: bad settings (nats_url: nats_url must start with nats://")
    assert "Traceback" not in err


def test_schema_prints_and_writes_every_event(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(events.json_schema()))
    assert set(events.EVENT_TYPES) <= {d.get("properties", {}).get("type", {}).get("enum", [None])[0]
                                       for d in printed["$defs"].values()}
    out = tmp_path / "events.schema.json"
    assert cli.main(["schema", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == printed


def test_up_refuses_taken_ports_naming_the_settings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = cli.main(["up", "--data-dir", str(tmp_path), "--nats-port", str(port), "--gateway-port", str(port)])
        assert code == 1
        err = capsys.readouterr().err
        assert "nats_port and gateway_port are both" in err
        code = cli.main(["up", "--data-dir", str(tmp_path), "--nats-port", str(port),
                         "--gateway-port", str(free_port())])
        err = capsys.readouterr().err
        assert code == 1
        assert f"port {port} (nats_port) is taken" in err and "--nats-port / FLYWHEEL_NATS_PORT" in err
        code = cli.main(["up", "--data-dir", str(tmp_path), "--nats-port", str(free_port()),
                         "--gateway-port", str(port)])
        err = capsys.readouterr().err
        assert code == 1
        assert f"port {port} (gateway_port) is taken" in err and "--gateway-port / FLYWHEEL_GATEWAY_PORT" in err
    assert not (tmp_path / "logs").exists()  # refused before anything started


HEAVY = ("fastapi", "sqlalchemy", "torch", "uvicorn", "alembic", "pydantic", "nats", "msgspec", "httpx")


@pytest.mark.parametrize("argv", [["--help"], ["up", "--help"], ["status", "--help"], ["tasks", "publish", "--help"],
                                  ["runs", "stop", "--help"], ["export", "--help"]])
def test_help_imports_nothing_heavy(argv: list[str]) -> None:
    code = (
        "import sys\n"
        "import flywheel.ops.cli\n"
        f"try:\n    flywheel.ops.cli.main({argv!r})\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert "usage: flywheel" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_run_help_config_prints_the_reference_generated_from_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    from flywheel.contract.config import reference

    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "--help-config"])  # no CONFIG.toml needed, as with --help
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out == reference()
    assert "## [trainer]" in out and '`type = "deepspeed"`' in out
    assert "`zero_stage` (int, >= 0, <= 3; default 0)" in out
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    assert "--help-config" in capsys.readouterr().out


# --- status tables ------------------------------------------------------------------------


REPORT = {
    "nats_url": "nats://127.0.0.1:4233",
    "gateway": {"url": "http://127.0.0.1:8420", "ok": True, "status_code": 200, "detail": {"status": "ok"}},
    "services": [
        {"service": "gateway", "instance": "vm-10", "pid": 10, "host": "vm", "status": "ok", "age_s": 1.25,
         "stale": False, "uptime_s": 3725.0, "info": {"metrics_port": 9464}},
        {"service": "recorder", "instance": "vm-1234", "pid": 1234, "host": "vm", "status": "ok", "age_s": 19.0,
         "stale": True, "uptime_s": 75.0},
    ],
    "stacks": [
        {"instance": "vm-7", "pid": 7, "host": "vm", "status": "ok", "age_s": 0.4, "stale": False, "uptime_s": 600.0,
         "nats_url": "nats://127.0.0.1:4233", "log_dir": "/d/logs", "restart_backoff_s": 1.0, "max_backoff_s": 60.0,
         "healthy_after_s": 30.0, "failing": ["inference"], "processes": [
             {"name": "nats-server", "pid": 8, "state": "running", "num_restarts": 0, "num_failures": 0,
              "backoff_s": 0.0, "last_exit": None, "last_exit_at": None, "healthy_since": "2025-01-02T03:04:05+00:00",
              "next_start_at": None, "next_start_in_s": None, "log": "/d/logs/nats-server.log"},
             {"name": "inference", "pid": 1301, "state": "backing off", "num_restarts": 6, "num_failures": 7,
              "backoff_s": 32.0, "last_exit": "code 1", "last_exit_at": "2025-01-02T03:14:05+00:00",
              "healthy_since": None, "next_start_at": "2025-01-02T03:14:37+00:00", "next_start_in_s": 31.4,
              "log": "/d/logs/inference.log"},
         ]},
    ],
    "streams": [
        {"stream": "TASKS", "messages": 12, "bytes": 1536, "consumers": 2, "replicas": 3, "leader": "n2",
         "replicas_behind": ["n3"]},
        {"stream": "ROLLOUTS", "messages": 0, "bytes": 0, "consumers": 1, "replicas": 1, "leader": None,
         "replicas_behind": []},
    ],
    "consumers": [
        {"stream": "TASKS", "consumer": "inference", "num_pending": 7, "num_ack_pending": 3, "num_redelivered": 1,
         "num_waiting": 0, "run": None, "pulled": True, "last_active": "2025-01-02T03:10:00+00:00"},
        {"stream": "TASKS", "consumer": "recorder-tasks", "num_pending": 0, "num_ack_pending": 0,
         "num_redelivered": 0, "num_waiting": 1, "run": None, "pulled": True, "last_active": None},
        {"stream": "ROLLOUTS", "consumer": "scorer-gone-p0", "num_pending": 40, "num_ack_pending": 0,
         "num_redelivered": 0, "num_waiting": 0, "run": None, "pulled": False,
         "last_active": "2025-01-02T03:10:00+00:00"},
    ],
}


def test_status_tables() -> None:
    text = stack_commands.format_status(REPORT)
    assert text.splitlines()[:2] == [
        "NATS     nats://127.0.0.1:4233  ok",
        "gateway  http://127.0.0.1:8420  ok",
    ]
    services, stack, streams, consumers, idle = text.split("\n\n")[1:]
    next_try = datetime.fromisoformat("2025-01-02T03:14:37+00:00").astimezone().strftime("%H:%M:%S")
    assert stack.splitlines() == [
        ("stack pid 7 on vm (last beat 0.4s ago): a crash loop waits 1s, doubling up to 60s; a process healthy 30s is "
         "restarted at once"),
        "PROCESS       PID  STATE                                RESTARTS  LAST EXIT  LOG",
        "nats-server     8  running                                     0  -          /d/logs/nats-server.log",
        f"inference    1301  backing off until {next_try} (in 31s)         6  code 1     /d/logs/inference.log",
        (f"inference is failing: last exit code 1, 7 exits in a row, 6 restarts; next try in 31s, at {next_try}; "
         "see /d/logs/inference.log"),
    ]
    assert services.splitlines() == [
        "SERVICE   INSTANCE   PID  STATUS  LAST BEAT  UP     METRICS",
        "gateway   vm-10       10  ok      1.2s       1h02m  vm:9464/metrics",
        "recorder  vm-1234   1234  stale   19.0s      1m15s  -",
    ]
    assert streams.splitlines() == [
        "STREAM    MESSAGES  SIZE     CONSUMERS  REPLICAS",
        "TASKS           12  1.5 KiB          2  3 (leader n2; behind: n3)",
        "ROLLOUTS         0  0 B              1  1",
    ]
    last = datetime.fromisoformat("2025-01-02T03:10:00+00:00").astimezone().strftime("%H:%M:%S")
    assert consumers.splitlines() == [
        "STREAM    CONSUMER        PENDING  ACK PENDING  REDELIVERED  READ BY",
        "TASKS     inference             7            3            1  a process",
        "TASKS     recorder-tasks        0            0            0  a process",
        f"ROLLOUTS  scorer-gone-p0       40            0            0  idle (last delivery {last})",
    ]
    assert idle.startswith("1 consumer(s) no process reads now") and "`flywheel consumers rm STREAM NAME`" in idle


def test_status_tables_say_what_is_missing() -> None:
    report = REPORT | {
        "gateway": {"url": "http://127.0.0.1:8420", "ok": False, "error": "ConnectError: connection refused"},
        "services": [], "stacks": [], "streams": [], "consumers": [],
    }
    text = stack_commands.format_status(report)
    assert "gateway  http://127.0.0.1:8420  unreachable (ConnectError: connection refused)" in text
    assert "no services running" in text and "no Flywheel streams yet" in text and "no consumers" in text
    unhealthy = REPORT | {"gateway": {"url": "http://g", "ok": False, "status_code": 503,
                                      "detail": {"checks": {"database": "down"}}}}
    assert "unhealthy (HTTP 503: {'checks': {'database': 'down'}})" in stack_commands.format_status(unhealthy)


@pytest.mark.parametrize("num_bytes, text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"),
                                             (3 * 1024 * 1024 // 2, "1.5 MiB"), (5 * 1024**4, "5120.0 GiB")])
def test_size(num_bytes: int, text: str) -> None:
    from flywheel.ops.tables import size

    assert size(num_bytes) == text


def test_defaults_in_option_help_match_the_settings() -> None:
    from flywheel.contract.settings import Settings

    num_stated = 0
    for name, (_, help_text) in cli.SETTING_OPTIONS.items():
        assert name in Settings.model_fields, name
        if stated := re.search(r"\(default (\S+)\)", help_text):
            assert stated.group(1) == str(Settings.model_fields[name].default), name
            num_stated += 1
    assert num_stated == 16


def test_model_tiny_writes_a_loadable_hf_folder(tmp_path, capsys) -> None:
    from flywheel.ops.cli import main
    from flywheel.sdk import models

    assert main(["model", "tiny", str(tmp_path / "tiny")]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(tmp_path / "tiny")
    model, tok = models.load_model(tmp_path / "tiny")
    assert tok.chat_template and model.config.model_type == "qwen2"


def test_follow_ends_with_the_runs_summary_or_says_where_it_is(tmp_path: Path) -> None:
    """After a followed run ended: its summary from the run folder, as `flywheel run` prints it;
    where this machine has none (its owner ran elsewhere), where it would be."""
    import io  # imported here: this test's own output buffer

    from flywheel.contract.settings import Settings
    from flywheel.ops.runs import _say_summary

    settings = Settings(data_dir=tmp_path)
    out = io.StringIO()
    _say_summary(settings, "r1", out)
    assert out.getvalue() == (f"run r1: no summary on this machine ({tmp_path / 'runs' / 'r1' / 'summary.json'}): "
                              "its owner writes it in its own data dir\n")
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    (tmp_path / "runs" / "r1" / "summary.json").write_text(json.dumps({"steps": 3, "reward_last": 0.5}))
    out = io.StringIO()
    _say_summary(settings, "r1", out)
    assert out.getvalue() == "summary:\n  steps        3\n  reward_last  0.500\n"
