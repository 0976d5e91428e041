"""Tenant checks fail closed: a run whose owner cannot be read is nobody's, refused to every
tenant's key, on inference and on the gateway (real nats-server, the real apps with keys on).

Found: inference treated a run whose state does not decode (``BadRunState``) as nobody's and
served it to any key, 200 with logprobs; a run whose entry was deleted while it was hosted
likewise. The gateway, for a run whose entry does not decode, took the trace store's copy of
its tenant, which may predate the run's registration (``default``'s, for an event recorded
first): a key of ``default`` then read another tenant's rollouts.
"""

from __future__ import annotations

from pathlib import Path

from flywheel.contract.bus import Bus
from flywheel.runtime.natsserver import NatsServer
from tests.security.fail_closed import (
    ROLLOUT,
    RUN,
    SERVICE_TOKEN,
    TASK,
    call,
    completion,
    keyed_gateway,
    keyed_inference,
    make_keys,
    own_things,
    same_answer,
)

NOT_A_RUN_STATE = b'{"written": "by something other than Flywheel"}'


async def test_inference_refuses_a_run_whose_owner_it_cannot_read(nats_server: NatsServer, bus: Bus, tmp_path: Path,
                                                                   tiny_model_dir: Path) -> None:
    made = await make_keys(bus)
    async with keyed_inference(nats_server.url, tmp_path / "data", bus, tiny_model_dir) as app:
        served = await call(app, "POST", "/v1/completions", made["a"], json=completion(RUN))
        assert served.status_code == 200 and served.json()["choices"][0]["logprobs"], served.text
        missing = await call(app, "POST", "/v1/completions", made["b"], json=completion("no-such-run"))
        assert missing.status_code == 404, missing.text
        kv = await bus.runs_kv()
        registered = (await kv.get(RUN)).value
        assert registered is not None
        for broken in ("undecodable", "deleted"):
            if broken == "undecodable":
                await kv.put(RUN, NOT_A_RUN_STATE)
            else:
                await kv.delete(RUN)
            for key in (made["b"], made["a"]):  # nobody's: not even the tenant that owned it
                for model, missing_model in ((RUN, "no-such-run"), (f"{RUN}@0", "no-such-run@0")):
                    refused = await call(app, "POST", "/v1/completions", key, json=completion(model))
                    assert refused.status_code == 404, (broken, model, refused.text)
                    missing = await call(app, "POST", "/v1/completions", key, json=completion(missing_model))
                    same_answer(refused, missing, {"no-such-run": RUN})
            models = await call(app, "GET", "/v1/models", made["a"])
            assert models.status_code == 200 and RUN not in models.text, (broken, models.text)
            # The deployment's own services still reach it (the operator mends the entry).
            operator = await call(app, "POST", "/v1/completions", SERVICE_TOKEN, json=completion(RUN))
            assert operator.status_code == 200, (broken, operator.text)
            await kv.put(RUN, registered)


async def test_the_gateway_refuses_a_run_whose_owner_it_cannot_read(nats_server: NatsServer, bus: Bus,
                                                                    tmp_path: Path) -> None:
    async with keyed_gateway(nats_server.url, tmp_path / "data") as app:
        made = await make_keys(app.state.bus)
        # The store's copy says default: the recorder stored an event before the run was registered.
        node = await own_things(app, store_tenant="default")
        urls = [f"/v1/rollouts/{ROLLOUT}", f"/v1/traces/{ROLLOUT}", f"/v1/traces/{ROLLOUT}/branches/{node}",
                f"/v1/tasks/{TASK}", f"/v1/runs/{RUN}/metrics", f"/v1/runs/{RUN}", f"/v1/usage?run={RUN}",
                f"/runs/{RUN}", f"/rollouts/{ROLLOUT}"]
        for url in urls:
            answer = await call(app, "GET", url, made["a"])
            assert answer.status_code == 200, (url, answer.text)
            for other in ("default", "b"):  # the bucket says a's: refused (test_fail_closed_not_found: how)
                refused = await call(app, "GET", url, made[other])
                assert refused.status_code in (403, 404), (url, other, refused.text)

        await (await bus.runs_kv()).put(RUN, NOT_A_RUN_STATE)
        for url in urls:
            for tenant in ("default", "b", "a"):  # nobody's, whatever the store says
                refused = await call(app, "GET", url, made[tenant])
                assert refused.status_code == 404, (url, tenant, refused.text)
                assert "2+2" not in refused.text, (url, tenant, refused.text)  # nothing of the run's data
            for method, action in (("POST", "stop"), ("POST", "pause"), ("POST", "resume")):
                refused = await call(app, method, f"/v1/runs/{RUN}/{action}", made["a"])
                assert refused.status_code == 404, (action, refused.text)
        # A task for it: the id is taken, and by nobody the key may act for.
        taken = await call(app, "POST", "/v1/tasks", made["a"], json={"run": RUN, "env": "math", "data": {}})
        assert taken.status_code == 409 and "taken" in taken.json()["detail"], taken.text
        # The operator still sees it, and what is wrong with it.
        operator = await call(app, "GET", f"/v1/runs/{RUN}", SERVICE_TOKEN)
        assert operator.status_code == 409 and "is not a run state" in operator.json()["detail"], operator.text
        assert (await call(app, "GET", f"/v1/rollouts/{ROLLOUT}", SERVICE_TOKEN)).status_code == 200
