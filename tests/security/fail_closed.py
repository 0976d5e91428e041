"""What the fail-closed tests share (tests/security/test_fail_closed_*.py): the gateway and
inference apps with API keys on, their lifespans running against the test's nats-server, tenant
``a``'s things in them, and one way to call them.

Tenant ``a`` owns a run (``RUN``) with a task, a rollout and its trace, usage, and a private
environment on the hub; ``b`` is another tenant with every scope. Each id has a twin that exists
nowhere (``MISSING``), so a test can ask for both and compare the answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from flywheel.contract import events, keys
from flywheel.contract.bus import Bus
from flywheel.contract.settings import Settings
from flywheel.sdk import models
from flywheel_gateway.app import create_app as create_gateway_app
from flywheel_gateway.hub import inspect_package
from flywheel_gateway.store import Store
from flywheel_inference.app import create_app as create_inference_app
from tests.integration.test_inference_worker import create_run, publish_weights
from tests.unit.test_hub import wheel
from tests.unit.test_store import rollout

SERVICE_TOKEN = "the-deployments-own-secret"
RUN = "owned-by-a"
TASK = "task-of-a"
ROLLOUT = "rollout-of-a"
HUB_ENV = "a/quiz"
HUB_WHEEL = "a_quiz-0.1.0-py3-none-any.whl"
# Each path parameter's value naming a's thing, and one naming nothing at all.
OWNED = {"run_id": RUN, "rollout_id": ROLLOUT, "task_id": TASK, "owner": "a", "name": "quiz", "project": "a-quiz",
         "filename": HUB_WHEEL, "tenant": "a"}
MISSING = {"run_id": "no-such-run", "rollout_id": "no-such-rollout", "task_id": "no-such-task", "owner": "a",
           "name": "no-such-env", "project": "a-no-such-env", "filename": "a_no_such_env-0.1.0-py3-none-any.whl",
           "key_id": "fedcba9876543210", "tenant": "no-such-tenant"}


@dataclass
class Keys:
    """API keys by name: ``a`` and ``b`` (every scope each), ``default`` (a tenant named so)."""

    tokens: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, name: str) -> str:
        return self.tokens[name]

    def id_of(self, name: str) -> str:
        return self.tokens[name].split("_")[1]


async def make_keys(bus: Bus) -> Keys:
    made = Keys()
    for tenant in ("a", "b", "default"):
        made.tokens[tenant] = (await keys.create_key(bus, tenant, ["read", "write", "admin"]))[0]
    return made


@asynccontextmanager
async def keyed_gateway(nats_url: str, data_dir: Path) -> AsyncIterator[FastAPI]:
    """The gateway with API keys (and the service token), a revoked key refused at once."""
    app = create_gateway_app(Settings(nats_url=nats_url, data_dir=data_dir, auth="keys",
                                      service_token=SERVICE_TOKEN))
    async with app.router.lifespan_context(app):
        app.state.keys.ttl_s = 0.0
        yield app


async def own_things(app: FastAPI, *, store_tenant: str = "a") -> str:
    """a's run (in the run-state bucket, and in the store as ``store_tenant``'s: the store's copy
    of an event recorded before the run was registered is ``default``'s), its task, rollout,
    trace and usage, and a's private environment on the hub. The rollout's last node's id."""
    bus: Bus = app.state.bus
    store: Store = app.state.store
    state = events.RunState(id=RUN, tenant="a", status="running")
    await (await bus.runs_kv()).put(RUN, events.encode(state))
    await store.upsert_runs([events.RunState(id=RUN, tenant=store_tenant, status="running")])
    task = events.Task(id=TASK, run=RUN, env="math", data={"q": "2+2"})
    recorded = rollout(ROLLOUT, task_id=TASK, run=RUN)
    await store.record([task, recorded, events.Usage(run=RUN, source="trainer", step=1, trained_tokens=4,
                                                     rollout_ids=[ROLLOUT])])
    package = inspect_package(HUB_ENV, "0.1.0", dict([wheel("a_quiz", "0.1.0", HUB_ENV)]), 1 << 20)
    await store.hub_push(package, "a", private=True, pushed_by=None)
    return recorded.nodes[-1].id


@asynccontextmanager
async def keyed_inference(nats_url: str, data_dir: Path, bus: Bus, model_dir: Path,
                          **inference: Any) -> AsyncIterator[FastAPI]:
    """Inference with API keys (and the service token), hosting a's run ``RUN`` with weights of
    step 0 loaded (so a request that passes its checks is answered at once)."""
    settings = Settings(nats_url=nats_url, data_dir=data_dir, auth="keys", service_token=SERVICE_TOKEN,
                        inference=inference)
    app = create_inference_app(settings)
    async with app.router.lifespan_context(app):
        app.state.keys.ttl_s = 0.0
        cfg = await create_run(bus, model_dir, RUN)
        await (await bus.runs_kv()).put(RUN, events.encode(events.RunState(id=RUN, tenant="a",
                                                                           config=cfg.model_dump())))
        await publish_weights(bus, RUN, 0, models.load_model(model_dir)[0])
        hosted = await app.state.worker.hosted(RUN)
        await asyncio.wait_for(hosted.policy.wait_ready(), 30)
        yield app


async def call(app: FastAPI, method: str, url: str, key: str | None, **kwargs: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://service") as client:
        return await client.request(method, url, headers=headers, **kwargs)


def completion(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": "abc", "max_tokens": 3}


def same_answer(owned: httpx.Response, missing: httpx.Response, renamed: dict[str, str]) -> None:
    """``owned`` (the answer about a's thing) is ``missing`` (about a thing that does not exist),
    but for the ids in its text (``renamed``: the missing id -> a's): status, content type, body."""
    text = missing.text
    for missing_id, owned_id in renamed.items():
        text = text.replace(missing_id, owned_id)
    assert (owned.status_code, owned.headers.get("content-type"), owned.text) == (
        missing.status_code, missing.headers.get("content-type"), text), (
        f"{owned.request.method} {owned.request.url}: another tenant's answers otherwise than a missing one")
