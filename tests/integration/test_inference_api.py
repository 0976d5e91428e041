"""The inference process's OpenAI-compatible API in process (httpx + ASGI), its lifespan
running the worker against a real nats-server, with the tiny model.

Not covered here: the uvicorn process itself (``python -m flywheel_inference``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from flywheel.contract.bus import Bus
from flywheel.contract.settings import Settings
from flywheel.ops.natsserver import NatsServer
from flywheel.sdk import models
from flywheel.sdk.environment import load_environment
from flywheel_inference.app import create_app
from tests.helpers import until
from tests.integration.test_inference_worker import create_run, publish_weights


@pytest.fixture
async def served(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """The app with its lifespan running (worker included), and a client that calls it in process."""
    app = create_app(Settings(nats_url=nats_server.url, data_dir=tmp_path / "data"))
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://x") as client:
        yield app, client


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


async def test_completions_from_the_current_policy_with_logprobs(served: tuple[FastAPI, httpx.AsyncClient],
                                                                 bus: Bus, tiny_model_dir: Path) -> None:
    app, client = served
    chat = {"model": "r1", "messages": [{"role": "system", "content": "Reverse the text."},
                                        {"role": "user", "content": "abc"}], "max_tokens": 5, "n": 2, "seed": 3}
    error = error_of(await client.post("/v1/chat/completions", json=chat), 404)
    assert "'r1'" in error["message"] and error["param"] == "model" and error["code"] == "model_not_found"

    assert (await client.get("/v1/models")).json() == {"object": "list", "data": []}
    await create_run(bus, tiny_model_dir)
    (model,) = (await client.get("/v1/models")).json()["data"]
    assert (model["id"], model["object"]) == ("r1", "model")  # a run id is a model name
    error = error_of(await client.post("/v1/chat/completions", json=chat), 503)
    assert "no weights loaded yet" in error["message"]
    base, tok = models.load_model(tiny_model_dir)
    await publish_weights(bus, "r1", 0, base)
    await until(lambda: app.state.worker.info["runs"]["r1"]["policy_version"] == 0, what="version 0 loaded")

    response = await client.post("/v1/chat/completions", json=chat)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == "r1" and body["system_fingerprint"] == "policy-v0"
    assert len(body["choices"]) == 2
    num_tokens = 0
    for i, choice in enumerate(body["choices"]):
        content = choice["logprobs"]["content"]
        assert choice["index"] == i and choice["message"]["role"] == "assistant"
        assert 1 <= len(content) <= 5 and all(t["logprob"] <= 0 and t["top_logprobs"] == [] for t in content)
        assert choice["finish_reason"] == ("length" if len(content) == 5 else "stop")
        num_tokens += len(content)
    prompt = models.render_prompt(tok, load_environment("reverse_text").prompt_messages({"text": "abc"}))
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": num_tokens,
                             "total_tokens": len(prompt) + num_tokens}
    again = (await client.post("/v1/chat/completions", json=chat)).json()
    assert [c["logprobs"] for c in again["choices"]] == [c["logprobs"] for c in body["choices"]]  # seeded

    # Temperature 0, as OpenAI clients send it: greedy, whatever the seed (sampled at the contract's
    # lowest temperature, where the chosen token's logprob is about 0).
    greedy = [(await client.post("/v1/chat/completions", json=chat | {"temperature": 0, "seed": seed})).json()
              for seed in (1, 2)]
    answers = {tuple(t["token"] for t in c["logprobs"]["content"]) for g in greedy for c in g["choices"]}
    assert len(answers) == 1, answers
    assert all(t["logprob"] > -1e-3 for g in greedy for c in g["choices"] for t in c["logprobs"]["content"])

    response = await client.post("/v1/completions", json={"model": "r1", "prompt": "abc", "max_tokens": 4,
                                                           "temperature": 0.5, "stop": ["\x00"]})
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) <= 4
    assert response.json()["usage"]["prompt_tokens"] == len(tok.encode("abc", add_special_tokens=False))

    health = await client.get("/healthz")
    assert health.status_code == 200 and health.json()["runs"]["r1"]["policy_version"] == 0


async def test_requests_that_cannot_be_served_name_the_field(served: tuple[FastAPI, httpx.AsyncClient]) -> None:
    _, client = served
    base = {"model": "r1", "messages": [{"role": "user", "content": "abc"}]}
    for extra, field in (({"stream": True}, "stream"), ({"temperature": -0.5}, "temperature"),
                         ({"top_logprobs": 2}, "top_logprobs"), ({"messages": []}, "messages")):
        error = error_of(await client.post("/v1/chat/completions", json=base | extra), 400)
        assert error["param"] == field, error
        assert field in error["message"] and error["type"] == "invalid_request_error"


async def test_a_past_steps_weights_are_served_as_run_at_step_while_kept(
        served: tuple[FastAPI, httpx.AsyncClient], bus: Bus, tiny_model_dir: Path) -> None:
    from flywheel.contract import weights
    from tests.integration.test_inference_worker import perturbed

    app, client = served
    await create_run(bus, tiny_model_dir)
    base, _ = models.load_model(tiny_model_dir)
    await publish_weights(bus, "r1", 0, base)
    await publish_weights(bus, "r1", 1, perturbed(tiny_model_dir, 1))
    await app.state.worker.hosted("r1")  # as the run's first task or request does
    await until(lambda: app.state.worker.info["runs"]["r1"]["policy_version"] == 1, what="version 1 loaded")
    chat = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 6, "seed": 5}

    async def seeded(model: str) -> dict:
        response = await client.post("/v1/chat/completions", json=chat | {"model": model})
        assert response.status_code == 200, response.text
        return response.json()

    live, step0, step1 = await seeded("r1"), await seeded("r1@0"), await seeded("r1@1")
    assert (live["system_fingerprint"], step0["system_fingerprint"], step1["system_fingerprint"]) == (
        "policy-v1", "policy-v0", "policy-v1")
    assert step0["model"] == "r1@0"
    tokens = [[t["logprob"] for t in body["choices"][0]["logprobs"]["content"]] for body in (live, step0, step1)]
    assert tokens[0] == tokens[2] != tokens[1]  # step 1 is the live weights; step 0 the ones before

    # The live policy moves on; a snapshot does not.
    await publish_weights(bus, "r1", 2, perturbed(tiny_model_dir, 2))
    await until(lambda: app.state.worker.info["runs"]["r1"]["policy_version"] == 2, what="version 2 loaded")
    assert (await seeded("r1@0"))["choices"] == step0["choices"]

    # A step whose weights the run no longer keeps, or that never was: 404 naming the kept ones.
    await weights.delete(bus, "r1", 1)
    error = error_of(await client.post("/v1/chat/completions", json=chat | {"model": "r1@7"}), 404)
    assert "keeps no weights of step 7 (it keeps those of steps 0, 2)" in error["message"], error
    assert error["code"] == "model_not_found"
    error = error_of(await client.post("/v1/chat/completions", json=chat | {"model": "r1@last"}), 400)
    assert "write RUN@STEP with STEP a trainer step number" in error["message"]
    # Snapshots beyond inference.snapshots_kept (2) are unloaded, least recently used first.
    await seeded("r1@2")
    await seeded("r1@0")
    assert list(app.state.worker._snapshots) == [("r1", 2), ("r1", 0)]
