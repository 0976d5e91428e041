"""The training API with tenants' keys (``auth = "keys"``), against a real nats-server (the keys
bucket, the USAGE stream) and the real gateway served on HTTP (the usage a quota counts).

Every route of the API's OpenAPI is walked with no key, a malformed, an unknown and a read-only
key, and the deployment's service token: refused (401, 403) before anything is made. Tenant b's
key, given tenant a's session, model, sampler, future and checkpoint path, gets the answer of one
that does not exist, word for word, and a's model is as it was. Each request that works is
metered: ``usage`` events of source ``training_api`` with a's tenant, the tokens a
``forward_backward`` trained and a sample drew, which the gateway sums under a's key and not
b's. ``[quotas] trained_tokens_per_day``: a ``forward_backward`` past the day's limit fails its
future naming the quota, the model's weights untouched and its next request served in order.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker

from flywheel.contract import events, keys
from flywheel.contract.bus import Bus, decode_message
from flywheel.contract.settings import QuotaSettings, Settings
from flywheel.runtime.natsserver import NatsServer
from flywheel_gateway.app import create_app as create_gateway_app
from flywheel_trainer.tinker_api import create_app
from tests.helpers import serving_app, until
from tests.integration.test_tinker_api import reverse_data

types = tinker.types
SERVICE_TOKEN = "the-deployments-own-secret"
DAILY_TOKENS = 60  # the quota: one batch of four reverse-text rows (49 tokens) fits it, two do not


class Stack:
    def __init__(self, url: str, gateway: str, data_dir: Path, made: dict[str, str], app: Any, api: Any) -> None:
        self.url, self.gateway, self.data_dir, self.made, self.app, self.api = url, gateway, data_dir, made, app, api
        self.clients: list[Any] = []

    def sdk(self, who: str) -> Any:
        """An SDK client with tenant ``who``'s key, closed with the stack (its heartbeat thread stops)."""
        client = tinker.ServiceClient(base_url=self.url, api_key=f"tml-{self.made[who]}")
        self.clients.append(client)
        return client


@pytest.fixture
async def stack(nats_server: NatsServer, bus: Bus, tmp_path: Path) -> AsyncIterator[Stack]:
    made = {name: (await keys.create_key(bus, tenant, scopes))[0]
            for name, tenant, scopes in [("a", "a", ["read", "write"]), ("b", "b", ["read", "write"]),
                                         ("a_read", "a", ["read"])]}
    common = Settings(nats_url=nats_server.url, auth="keys", service_token=SERVICE_TOKEN, data_dir=tmp_path / "gateway")
    gateway_app = create_gateway_app(common)
    async with serving_app(gateway_app, lifespan="on") as gateway:
        app = create_app(common.model_copy(update={"data_dir": tmp_path / "data", "gateway_url": gateway, "quotas":
                                                   QuotaSettings(trained_tokens_per_day=DAILY_TOKENS)}), bus="required")
        async with serving_app(app, lifespan="on") as url:
            app.state.api.keys.ttl_s = 0.0
            gateway_app.state.keys.ttl_s = 0.0
            served = Stack(url, gateway, tmp_path / "data", made, gateway_app, app.state.api)
            try:
                yield served
            finally:
                for client in served.clients:
                    await asyncio.to_thread(finish, client)


def finish(client: Any) -> None:
    client.close("success").result()


async def in_thread(fn: Callable[[], Any]) -> Any:
    return await asyncio.to_thread(fn)


def owned_by_a(stack: Stack) -> dict[str, Any]:
    """Tenant a's things, made with the SDK: a session, a trained model, a checkpoint, a sampler and a future."""
    service = stack.sdk("a")
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    data = reverse_data(stack.data_dir, ["abc", "stone"])
    done = training.forward_backward(data, "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    trained = done.result().metrics["loss:sum"]
    path = training.save_state("a-ckpt").result().path
    sampler = training.save_weights_and_get_sampling_client().result()
    drawn = sampler.sample(types.ModelInput.from_ints(data[0].model_input.to_ints()[:4]), 2,
                           types.SamplingParams(max_tokens=5, seed=1)).result()
    held = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
    api = stack.api  # the ids the SDK keeps to itself, read off the server
    (session_id,) = api.sessions
    (sampler_id,) = api.samplers
    return {"service": service, "training": training, "data": data, "model_id": training.model_id, "path": path,
            "sampler_id": sampler_id, "request_id": next(iter(api.results)), "session_id": session_id,
            "trained": trained, "held": held, "sampled": sum(len(s.tokens) for s in drawn.sequences)}


async def post(url: str, path: str, body: Any, key: str | None, method: str = "POST") -> httpx.Response:
    headers = {"X-API-Key": key} if key is not None else {}
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        return await http.request(method, path, json=body, headers=headers)


async def test_every_route_wants_a_tenants_key_with_write(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        routes = (await http.get("/openapi.json")).json()["paths"]
    assert {"/api/v1/forward_backward", "/api/v1/retrieve_future", "/api/v1/asample"} <= set(routes)
    for path, operations in routes.items():
        if path == "/api/v1/healthz":
            continue
        url = re.sub(r"\{\w+\}", "session-0000:sample:0", path)
        for method in operations:
            for key, status, words in [(None, 401, "no API key"), ("fw_not_tml", 401, "no API key"),
                                       ("tml-fw_0123456789abcdef_not-a-real-key-at-all", 401, "unknown"),
                                       ("tml-not-a-flywheel-key", 401, "malformed"),
                                       (f"tml-{stack.made['a_read']}", 403, "needs 'write'"),
                                       (f"tml-{SERVICE_TOKEN}", 403, "service token trains no models")]:
                answer = await post(stack.url, url, {}, key, method.upper())
                assert answer.status_code == status and words in answer.text, (method, path, key, answer.text)


async def test_another_tenants_key_finds_nothing_of_a(stack: Stack) -> None:
    a = await in_thread(lambda: owned_by_a(stack))
    b = f"tml-{stack.made['b']}"
    b_session = (await post(stack.url, "/api/v1/create_session", {"tags": [], "user_metadata": {},
                                                                  "sdk_version": "0.38.0", "type": "create_session"},
                            b)).json()["session_id"]

    async def both(path: str, body: Callable[[str], Any], theirs: str, none: str, method: str = "POST"
                   ) -> None:
        """b asking for a's thing gets the words of asking for one that does not exist."""
        got = await post(stack.url, path.format(theirs), body(theirs), b, method)
        missing = await post(stack.url, path.format(none), body(none), b, method)
        assert got.status_code == missing.status_code, (path, got.text, missing.text)
        assert got.text.replace(theirs, "ID") == missing.text.replace(none, "ID"), (path, got.text, missing.text)
        assert "logprobs" not in got.text and "loss" not in got.text

    gone_model, gone_path = "session-00000000:train:0", "tinker://session-00000000:train:0/weights/a-ckpt"
    await both("/api/v1/get_info", lambda m: {"model_id": m, "type": "get_info"}, a["model_id"], gone_model)
    await both("/api/v1/optim_step", lambda m: {"model_id": m, "adam_params": {"learning_rate": 1.0},
                                                "type": "optim_step"}, a["model_id"], gone_model)
    await both("/api/v1/save_weights", lambda m: {"model_id": m, "path": "stolen", "type": "save_weights"},
               a["model_id"], gone_model)
    await both("/api/v1/save_weights_for_sampler", lambda m: {"model_id": m, "sampling_session_seq_id": 9,
                                                              "type": "save_weights_for_sampler"},
               a["model_id"], gone_model)
    await both("/api/v1/load_weights", lambda p: {"model_id": None, "session_id": b_session, "model_seq_id": 0,
                                                  "path": p, "optimizer": True, "type": "load_weights"},
               a["path"], gone_path)
    await both("/api/v1/create_sampling_session", lambda p: {"session_id": b_session, "sampling_session_seq_id": 1,
                                                             "model_path": p, "type": "create_sampling_session"},
               a["path"], gone_path)
    await both("/api/v1/samplers/{}", lambda _: None, a["sampler_id"], "session-00000000:sample:0", "GET")
    await both("/api/v1/asample", lambda s: {"sampling_session_id": s, "num_samples": 1, "prompt": {
        "chunks": [{"tokens": [1, 2], "type": "encoded_text"}]}, "sampling_params": {"max_tokens": 2}},
               a["sampler_id"], "session-00000000:sample:0")
    await both("/api/v1/retrieve_future", lambda r: {"request_id": r}, a["request_id"], "0" * 24)
    await both("/api/v1/session_heartbeat", lambda s: {"session_id": s, "type": "session_heartbeat"},
               a["session_id"], "session-00000000")
    await both("/api/v1/create_model", lambda s: {"session_id": s, "model_seq_id": 7, "base_model": "tiny",
                                                  "lora_config": {"rank": 4}, "type": "create_model"},
               a["session_id"], "session-00000000")
    await both("/api/v1/sessions/{}/finish", lambda _: None, a["session_id"], "session-00000000")
    proto = tinker.proto.tinker_public_pb2.ForwardBackwardRequest(model_id=a["model_id"], seq_id=99,
                                                                  loss_fn="cross_entropy")
    async with httpx.AsyncClient(base_url=stack.url) as http:
        stolen = await http.post("/api/v1/forward_backward", content=proto.SerializeToString(),
                                 headers={"X-API-Key": b, "Content-Type": "application/x-protobuf"})
    assert stolen.status_code == 404 and "no such model" in stolen.text
    # a's model is as a left it; its checkpoint is only under a's folder.
    held = await in_thread(lambda: a["training"].forward(a["data"], "cross_entropy").result().metrics["loss:sum"])
    assert held == a["held"]
    assert [p.relative_to(stack.data_dir / "tinker").parts[0] for p in (stack.data_dir / "tinker").rglob("*.pt")] \
        == ["a"]


async def test_each_request_is_metered_for_its_tenant(stack: Stack, bus: Bus) -> None:
    a = await in_thread(lambda: owned_by_a(stack))
    tokens = sum(len(d.model_input.to_ints()) for d in a["data"])

    decoder: events.Decoder[events.Usage] = events.Decoder(events.Usage)

    async def counted() -> list[events.Usage]:
        info = await bus.js.stream_info("USAGE", subjects_filter="usage.*.training_api")
        found = [decode_message(decoder, await bus.js.get_msg("USAGE", seq))
                 for seq in range(info.state.first_seq, info.state.last_seq + 1)]
        return [u for u in found if u.source == "training_api"]

    await until(lambda: _has(counted, 3), what="the API's three usage counts")
    usage = await counted()
    assert {u.tenant for u in usage} == {"a"} and {u.run for u in usage} == {a["session_id"]}
    assert sum(u.trained_tokens for u in usage) == tokens  # the forward_backward
    assert sum(u.prompt_tokens for u in usage) == tokens + 4  # the forward, the sampling prompt
    assert sum(u.sampled_tokens for u in usage) == a["sampled"]
    await stack.app.state.store.record(usage)  # what the recorder does with them
    for who, expected in (("a", tokens), ("b", 0)):
        async with httpx.AsyncClient(base_url=stack.gateway) as http:
            answer = await http.get("/v1/usage", headers={"Authorization": f"Bearer {stack.made[who]}"})
        assert answer.status_code == 200, answer.text
        rows = [r for r in answer.json()["items"] if r["source"] == "training_api"]
        assert sum(r["trained_tokens"] for r in rows) == expected, (who, rows)


async def _has(counted: Callable[[], Any], n: int) -> bool:
    return len(await counted()) >= n


async def test_a_request_past_the_daily_quota_fails_and_runs_nothing(stack: Stack) -> None:
    def loop() -> dict[str, Any]:
        training = stack.sdk("a").create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
        data = reverse_data(stack.data_dir, ["abc", "hello", "stone", "river"])
        first = training.forward_backward(data, "cross_entropy").result()  # fits the day's tokens
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        before = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
        with pytest.raises(tinker.RequestFailedError) as over:
            training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # nothing accumulated: no change
        after = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
        return {"tokens": sum(len(d.model_input.to_ints()) for d in data), "first": first, "said": str(over.value),
                "before": before, "after": after}

    got = await in_thread(loop)
    assert got["tokens"] <= DAILY_TOKENS < 2 * got["tokens"], got["tokens"]
    assert "quota trained_tokens_per_day: tenant 'a' trained on" in got["said"], got["said"]
    assert f"quotas.trained_tokens_per_day = {DAILY_TOKENS}" in got["said"]
    assert got["after"] == got["before"]
