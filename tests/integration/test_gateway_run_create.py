"""``POST /v1/runs``: a tenant starts a run over HTTP (the gateway in process, API keys, a real
nats-server), and the orchestrator's owner prepares a config registered that way.

Covers: a TOML config registered as the key's tenant's, unprepared, and shown by ``GET``; the
same errors as the CLI for a bad field, and refusals naming what to change (an import path, a
config naming another tenant, a body that is neither TOML nor JSON, a run that exists); the
tenant's quotas as 429s naming the limit; another tenant's key does not see the run. Then the
owner of such a run loads its environments and writes the config as registered, and a run whose
environment does not load fails, saying why.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from flywheel.contract import keys
from flywheel.contract.bus import Bus
from flywheel.contract.config import RunConfig
from flywheel.contract.runs import claim_run, get_run, register_run
from flywheel.contract.settings import QuotaSettings, Settings
from flywheel.runtime.natsserver import NatsServer
from flywheel.runtime.runs import prepare_run
from flywheel_gateway.app import create_app
from flywheel_gateway.hub import inspect_package
from flywheel_orchestrator.owner import RunOwner
from tests.helpers import until
from tests.inprocess import InProcessPool
from tests.unit.test_hub import wheel

CONFIG = """\
run = "{run}"
env = "reverse_text"

[model]
name = "tiny"

[trainer]
num_steps = 2
"""


@pytest.fixture
async def gateway(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[FastAPI]:
    application = create_app(Settings(nats_url=nats_server.url, data_dir=tmp_path / "data", auth="keys",
                                      quotas=QuotaSettings(runs=2)))
    async with application.router.lifespan_context(application):
        application.state.keys.ttl_s = 0.0
        yield application


async def client_of(app: FastAPI, tenant: str) -> httpx.AsyncClient:
    key, _ = await keys.create_key(app.state.bus, tenant, ["read", "write"])
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway",
                             headers={"Authorization": f"Bearer {key}"})


async def post_toml(client: httpx.AsyncClient, run: str, extra: str = "", head: str = "") -> httpx.Response:
    """POST /v1/runs of the config of ``run``, ``head`` above it and ``extra`` below ([trainer])."""
    return await client.post("/v1/runs", content=head + CONFIG.format(run=run) + extra,
                             headers={"Content-Type": "application/toml"})


async def test_a_tenant_starts_a_run_over_http_within_its_quotas(gateway: FastAPI) -> None:
    acme, beta = await client_of(gateway, "acme"), await client_of(gateway, "beta")
    async with acme, beta:
        created = await post_toml(acme, "first")
        assert created.status_code == 201, created.text
        run = created.json()
        assert (run["id"], run["tenant"], run["status"], run["config"]["tenant"]) == ("first", "acme", "created",
                                                                                       "acme")
        state = await get_run(gateway.state.bus, "first")
        assert state is not None and not state.prepared and state.config["trainer"]["num_steps"] == 2
        assert (await acme.get("/v1/runs/first")).json()["status"] == "created"
        assert (await beta.get("/v1/runs/first")).status_code == 404  # another tenant's: not there for it

        again = await post_toml(acme, "first")
        assert again.status_code == 409 and "run 'first' exists already" in again.text, again.text
        bad = await post_toml(acme, "bad", "lr = \"fast\"\n")
        assert bad.status_code == 422 and "trainer.lr" in bad.json()["detail"], bad.text
        imported = await post_toml(acme, "imported", '[trainer.advantage]\ntype = "os:getcwd"\n')
        assert imported.status_code == 422 and "not among the modules the operator trusts" in imported.text, \
            imported.text
        theirs = await post_toml(acme, "theirs", head='tenant = "beta"\n')
        assert theirs.status_code == 403 and "leave tenant out" in theirs.text, theirs.text
        html = await acme.post("/v1/runs", content="<p>", headers={"Content-Type": "text/html"})
        assert html.status_code == 415 and "application/toml" in html.text
        garbled = await acme.post("/v1/runs", content="run = ", headers={"Content-Type": "application/toml"})
        assert garbled.status_code == 422 and "not valid TOML" in garbled.text
        as_json = await acme.post("/v1/runs", json={"run": "second", "env": "reverse_text"})
        assert as_json.status_code == 201, as_json.text
        # Two runs not ended: the quota (quotas.runs = 2) is reached, for acme alone.
        over = await post_toml(acme, "third")
        assert over.status_code == 429 and "quota runs: tenant 'acme' has 2 runs not ended" in over.text, over.text
        assert (await post_toml(beta, "beta-first")).status_code == 201
        # Hub environments: the public ones, its own private ones and the platform's; another
        # tenant's private one is refused as an id nobody pushed is (the orchestrator would install it).
        package = inspect_package("beta/secret", "0.1.0", dict([wheel("beta_secret", "0.1.0", "beta/secret")]), 1 << 20)
        await gateway.state.store.hub_push(package, "beta", private=True, pushed_by=None)
        said = []
        for env_id in ("beta/secret", "nobody/nothing"):
            refused = await acme.post("/v1/runs", json={"run": f"named-{env_id.split('/')[0]}", "env": env_id})
            assert refused.status_code == 422, refused.text
            said.append(refused.json()["detail"].replace(env_id, "ID"))
        assert said[0] == said[1] and "env: 'ID' is no environment this tenant may run" in said[0], said
        evals = await acme.post("/v1/runs", json={"run": "evals", "env": "flywheel/reverse-text",
                                                  "evals": [{"id": "beta/secret@0.1.0", "every": 1}]})
        assert evals.status_code == 422 and "evals.0.id: 'beta/secret@0.1.0'" in evals.text, evals.text
        assert (await beta.post("/v1/runs", json={"run": "beta-secret", "env": "beta/secret"})).status_code == 201
        assert (await acme.post("/v1/runs/first/stop")).status_code == 200
        assert (await post_toml(acme, "third")).status_code == 201
        assert await get_run(gateway.state.bus, "third") is not None


async def test_the_owner_prepares_a_run_registered_over_http(bus: Bus, nats_server: NatsServer,
                                                             tmp_path: Path) -> None:
    settings = Settings(nats_url=nats_server.url, data_dir=tmp_path)
    await register_run(bus, "r", "acme", config={"run": "r", "env": "reverse_text", "tenant": "acme"},
                       prepared=False)
    state = await claim_run(bus, "r", "orchestrator me", 60.0)
    assert state is not None
    owner = RunOwner(bus, settings, state, "orchestrator me", InProcessPool())
    cfg = await owner._prepare()
    assert cfg is not None
    prepared = await get_run(bus, "r")
    assert prepared is not None and prepared.prepared and prepared.config == cfg.model_dump()
    expected, _ = await prepare_run(InProcessPool(), RunConfig.parse(state.config), tenant="acme")
    assert prepared.scorers and prepared.config == expected.model_dump()  # as `flywheel run` registers it
    assert any("loads its environments (reverse_text)" in note for note in prepared.notes)

    await register_run(bus, "broken", "acme", config={"run": "broken", "env": "no_such_env", "tenant": "acme"},
                       prepared=False)
    claimed = await claim_run(bus, "broken", "orchestrator me", 60.0)
    assert claimed is not None
    await RunOwner(bus, settings, claimed, "orchestrator me", InProcessPool()).run()

    async def failed() -> bool:
        found = await get_run(bus, "broken")
        return found is not None and found.status == "failed"

    await until(failed, what="the run whose environment does not load to fail")
    ended = await get_run(bus, "broken")
    assert ended is not None and "no_such_env" in (ended.reason or ""), ended
