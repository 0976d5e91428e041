"""`flywheel run` starts its run while the embedded stack starts: a service that dies during
start-up fails the run with the stack's reason, while the bus is still up to record it."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from flywheel.contract.config import RunConfig
from flywheel.contract.settings import Settings
from flywheel.ops import run as run_module
from flywheel.ops.run import MainJob
from flywheel.ops.stack import SERVICES, StackError
from flywheel.runtime.natsserver import free_port
from flywheel.runtime.supervise import ServiceSpec, heartbeat_of


async def test_a_service_dying_at_start_fails_the_run_with_the_stacks_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Inference dies during its start-up (it never beats), once the orchestrator has claimed the
    # run (its folder has the config): the order the test is about, whatever either's start-up costs.
    claimed = tmp_path / "runs" / "doomed" / "config.json"
    dies = (f"import pathlib, time\ndeadline = time.monotonic() + 120\n"
            f"while not pathlib.Path({str(claimed)!r}).exists() and time.monotonic() < deadline:\n"
            f"    time.sleep(0.05)\nraise SystemExit(3)\n")  # noqa: sleep - a bounded poll in the stand-in program
    services = {"orchestrator": SERVICES["orchestrator"], "scorer": SERVICES["scorer"],
                "inference": ServiceSpec(("-c", dies), heartbeat_of("inference"))}
    monkeypatch.setattr(run_module, "SERVICES", services)
    cfg = RunConfig.parse({"run": "doomed", "env": "reverse_text", "sft": {"steps": 0},
                           "trainer": {"num_steps": 2}})
    settings = Settings(data_dir=tmp_path, nats_port=free_port(), gateway_port=free_port(),
                        inference_port=free_port(), fork_services=False)
    out = io.StringIO()
    with pytest.raises(StackError, match="inference exited with code 3 during start-up"):
        await MainJob(cfg, settings, out=out).run()
    text = out.getvalue()
    assert "run doomed: failed (the embedded stack failed: inference exited with code 3 during start-up" in text
    # The run was registered and its trainer started before the stack failed; both were
    # stopped before the nats-server was, so nothing talked to a server that was gone.
    assert text.index("run doomed: failed") < text.index("stopped nats-server")
    assert json.loads((tmp_path / "runs" / "doomed" / "summary.json").read_text())["steps"] == 0
