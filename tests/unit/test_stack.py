"""The supervisor's restart policy alone (the stack itself runs in tests/e2e/test_up_supervisor.py)."""

from __future__ import annotations

import socket

import pytest

from flywheel.contract.retry import Backoff
from flywheel.contract.settings import Settings
from flywheel.ops.stack import Stack, StackError, check_ports
from flywheel.runtime.natsserver import free_port
from flywheel.runtime.supervise import RestartBackoff, child_env, metrics_port


def test_restart_backoff_doubles_in_a_crash_loop_and_resets_after_a_healthy_stretch() -> None:
    backoff = RestartBackoff(Backoff(first_s=1.0, max_s=8.0), healthy_after_s=30.0)
    assert [backoff.after_exit(healthy_for_s=2.0) for _ in range(7)] == [0, 1, 2, 4, 8, 8, 8]
    assert backoff.num_failures == 7 and backoff.delay_s == 8
    assert backoff.after_exit(healthy_for_s=30.0) == 0 and backoff.num_failures == 1
    assert backoff.after_exit(healthy_for_s=0.0) == 1
    assert RestartBackoff(Backoff(max_s=60.0)).after_exit(0.0) == 0  # a first exit: at once
    many = RestartBackoff(Backoff(first_s=1.0, max_s=60.0), num_failures=5000)
    assert many.after_exit(0.0) == 60  # no overflow however long the loop


def test_each_service_of_a_stack_serves_its_figures_on_its_own_port() -> None:
    assert [metrics_port(Settings(metrics_port=9464), i) for i in range(3)] == [
        {"FLYWHEEL_METRICS_PORT": str(9464 + i)} for i in range(3)]
    assert metrics_port(Settings(metrics_port=0), 4) == {"FLYWHEEL_METRICS_PORT": "0"}  # each a free one
    assert metrics_port(Settings(), 4) == {}  # not served



def test_a_stack_with_a_nats_server_of_its_own_passes_weights_through_files(tmp_path) -> None:
    own = Stack(Settings(data_dir=tmp_path))
    folder = tmp_path.resolve() / "weights"
    assert own.settings.trainer.weights_dir == folder
    assert all(s.env["FLYWHEEL_TRAINER__WEIGHTS_DIR"] == str(folder) for s in own.services)
    # A NATS of the user's: services may run elsewhere, so the weights stay in the bus's object store,
    # and the unset setting stays unset in the services' environment (not the text "null").
    theirs = Stack(Settings(data_dir=tmp_path, nats_url="nats://127.0.0.1:4222"))
    assert theirs.settings.trainer.weights_dir is None
    assert all("FLYWHEEL_TRAINER__WEIGHTS_DIR" not in s.env for s in theirs.services)
    assert "FLYWHEEL_TRAINER__WEIGHTS_DIR" not in child_env(Settings())


def test_a_data_folder_is_held_by_one_stack_and_names_its_holder(tmp_path) -> None:
    import os
    import subprocess
    import time
    from pathlib import Path

    import pytest

    from flywheel.ops.stack import DataFolderLock, StackError

    first = DataFolderLock(tmp_path)
    first.acquire({"pid": os.getpid(), "command": "flywheel up", "since": "now", "ports": {"NATS": 4222}})
    holder = rf"in use by another stack \(pid {os.getpid()} \(flywheel up\), NATS port 4222"
    with pytest.raises(StackError, match=holder):
        DataFolderLock(tmp_path).acquire({"pid": 1})
    first.release()
    # Released (or its holder gone: the system lets go of an flock with the process): free again.
    second = DataFolderLock(tmp_path)
    second.acquire({"pid": os.getpid()})
    # A nats-server its last holder started, still running on the store, keeps the folder taken.
    sleeper = subprocess.Popen(["bash", "-c", "exec -a nats-server sleep 60"])
    for _ in range(500):  # until it has exec'd (a fresh fork shows its parent's command line)
        if b"nats-server" in Path(f"/proc/{sleeper.pid}/cmdline").read_bytes():
            break
        time.sleep(0.01)  # noqa: sleep - a bounded poll (5 s at most) for the child's exec
    try:
        second.update({"nats_pids": [sleeper.pid]})
        assert second._fd is not None
        os.close(second._fd)  # the holder dies without tidying up (its lock file still names the server)
        second._fd = None
        with pytest.raises(StackError, match=rf"nats-server of the stack that last ran on .* \(pid {sleeper.pid}\)"):
            DataFolderLock(tmp_path).acquire({"pid": 1})
    finally:
        sleeper.kill()
        sleeper.wait()
    DataFolderLock(tmp_path).acquire({"pid": 1})  # the server gone: free


def test_a_taken_port_is_refused_only_for_a_service_the_stack_starts() -> None:
    # `flywheel eval --model` starts no gateway: a gateway on its port elsewhere is no obstacle.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings = Settings(nats_port=free_port(), inference_port=free_port(), gateway_port=taken.getsockname()[1])
        check_ports(settings, {"inference", "sandbox"})
        with pytest.raises(StackError, match=r"\(gateway_port\) is taken: choose a free one with --gateway-port"):
            check_ports(settings, {"gateway", "inference"})
