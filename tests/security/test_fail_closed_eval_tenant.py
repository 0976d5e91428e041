"""What a run spawns is its tenant's: the eval runs of a run's ``[[evals]]`` (the orchestrator's
run owner runs them) and ``flywheel eval --record`` of a run's model are registered as the
run's tenant's, so its owner's key reads them on the gateway and another tenant's gets the 404
of a run that does not exist (real nats-server, the real gateway app, the CLI as a process).

Found: both registered their eval runs as tenant ``default``, so the run's owner got 403 on them.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from flywheel.contract import events
from flywheel.contract.bus import Bus
from flywheel.contract.config import RunConfig
from flywheel.contract.runs import get_run
from flywheel.contract.settings import Settings
from flywheel.runtime.natsserver import NatsServer
from flywheel_orchestrator.owner import RunOwner
from tests.helpers import worker_pool
from tests.scripted_openai import ScriptedOpenAI
from tests.security.fail_closed import SERVICE_TOKEN, call, keyed_gateway, make_keys

RUN = "acme-run"


async def test_a_runs_eval_runs_are_its_tenants(nats_server: NatsServer, bus: Bus, tmp_path: Path) -> None:
    cfg = RunConfig.parse({"run": RUN, "env": "reverse_text", "tenant": "a",
                           "evals": [{"id": "reverse_text", "name": "held-out", "num_tasks": 1}]})
    state = events.RunState(id=RUN, tenant="a", config=cfg.model_dump())
    await (await bus.runs_kv()).put(RUN, events.encode(state))
    step = 3
    with ScriptedOpenAI({f"{RUN}@{step}": ["olleh"], RUN: ["olleh"]}) as model:
        # The orchestrator's run owner, as it runs the evals of a step's weights.
        settings = Settings(nats_url=nats_server.url, data_dir=tmp_path / "data", auth="keys",
                            service_token=SERVICE_TOKEN, inference_url=model.base_url)
        async with worker_pool("orchestrator") as workers:
            owner = RunOwner(bus, settings, state, "orchestrator-test", workers)
            await owner._eval(cfg.evals[0], step)
        # flywheel eval --record of the run's model, as a user runs it.
        env = os.environ | {"FLYWHEEL_NATS_URL": nats_server.url, "FLYWHEEL_DATA_DIR": str(tmp_path / "cli")}
        proc = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).with_name("flywheel")), "eval", "reverse_text", "--model", RUN,
            "--base-url", model.base_url, "-n", "1", "--record", "--run-id", "cli-eval",
            "--out", str(tmp_path / "cli.jsonl"), env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        output, _ = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, output.decode()
    eval_runs = [f"{RUN}-eval-held-out-{step}", "cli-eval"]
    for eval_run in eval_runs:
        registered = await get_run(bus, eval_run)
        assert registered is not None and (registered.kind, registered.tenant) == ("eval", "a"), registered

    async with keyed_gateway(nats_server.url, tmp_path / "gateway") as app:
        made = await make_keys(app.state.bus)
        for eval_run in eval_runs:
            mine = await call(app, "GET", f"/v1/runs/{eval_run}", made["a"])
            assert mine.status_code == 200 and mine.json()["tenant"] == "a", mine.text
            for other in ("b", "default"):
                theirs = await call(app, "GET", f"/v1/runs/{eval_run}", made[other])
                assert theirs.status_code == 404, (other, theirs.text)
