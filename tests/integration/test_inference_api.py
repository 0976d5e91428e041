"""The inference process's OpenAI-compatible API in process (httpx + ASGI), its lifespan
running the worker against a real nats-server, with the tiny model.

Not covered here: the uvicorn process itself (``python -m flywheel_inference``)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from flywheel.contract import events
from flywheel.contract.bus import Bus
from flywheel.contract.settings import Settings
from flywheel.runtime.natsserver import NatsServer
from flywheel.sdk import models
from flywheel.sdk.environment import load_environment
from flywheel_inference.app import create_app
from flywheel_inference.backends import DecodeSession
from tests.helpers import until
from tests.integration.services import Served
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
    cfg = await create_run(bus, tiny_model_dir)
    (model,) = (await client.get("/v1/models")).json()["data"]
    assert (model["id"], model["object"], model["status"]) == ("r1", "model", "created")  # a run id is a model name
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
        # Stopped before max_tokens (5) at EOS or a stop string, or at it: by length, unless the last token is EOS.
        ended_at_eos = content[-1]["token"] == tok.eos_token
        assert choice["finish_reason"] == ("length" if len(content) == 5 and not ended_at_eos else "stop"), content
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

    # A finished run is still a model: listed with its status, answering from its last weights.
    finished = events.RunState(id="r1", status="finished", config=cfg.model_dump())
    await (await bus.runs_kv()).put("r1", events.encode(finished))
    await until(lambda: app.state.worker.info["runs"]["r1"].get("ended") is not None,
                what="the worker to see the run end")
    (model,) = (await client.get("/v1/models")).json()["data"]
    assert (model["id"], model["status"]) == ("r1", "finished")
    after = await client.post("/v1/chat/completions", json=chat | {"temperature": 0})
    assert after.status_code == 200 and after.json()["system_fingerprint"] == "policy-v0", after.text
    await create_run(bus, tiny_model_dir, run="r2")
    listed = (await client.get("/v1/models")).json()["data"]
    assert [(m["id"], m["status"]) for m in listed] == [("r2", "created"), ("r1", "finished")]  # live runs first


async def test_requests_that_cannot_be_served_name_the_field(served: tuple[FastAPI, httpx.AsyncClient]) -> None:
    _, client = served
    base = {"model": "r1", "messages": [{"role": "user", "content": "abc"}]}
    for extra, field in (({"temperature": -0.5}, "temperature"),
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
    assert list(app.state.worker.hosting.snapshots) == [("r1", 2), ("r1", 0)]


def chunks_of(response: httpx.Response) -> list[dict]:
    """The events of a streamed answer, which must end with ``data: [DONE]``."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in response.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def assembled(chunks: list[dict], n: int) -> list[dict]:
    """Each choice as the chunks build it: text, logprobs, finish reason, and how many chunks had text."""
    choices: list[dict[str, Any]] = [{"text": "", "logprobs": [], "finish_reason": None, "num_text_chunks": 0}
                                     for _ in range(n)]
    for chunk in chunks:
        for c in chunk["choices"]:
            choice = choices[c["index"]]
            assert choice["finish_reason"] is None, "a chunk after the choice's finish"
            text = c["delta"].get("content") if "delta" in c else c["text"]
            choice["text"] += text or ""
            choice["num_text_chunks"] += bool(text)
            logprobs = c["logprobs"] or {}
            choice["logprobs"] += logprobs.get("content") or logprobs.get("token_logprobs") or []
            choice["finish_reason"] = c["finish_reason"]
    return choices


async def test_a_streamed_answer_is_the_same_answer_token_by_token(served: tuple[FastAPI, httpx.AsyncClient],
                                                                  bus: Bus, tiny_model_dir: Path) -> None:
    app, client = served
    chat = {"model": "r1", "messages": [{"role": "user", "content": "abcdef"}], "max_tokens": 16, "n": 2,
            "seed": 11}
    await create_run(bus, tiny_model_dir)
    # Before the run has weights: the error, as JSON, not a stream that breaks off.
    error = error_of(await client.post("/v1/chat/completions", json=chat | {"stream": True}), 503)
    assert "no weights loaded yet" in error["message"]
    base, _ = models.load_model(tiny_model_dir)
    await publish_weights(bus, "r1", 0, base)
    await until(lambda: app.state.worker.info["runs"]["r1"]["policy_version"] == 0, what="version 0 loaded")

    metered: list[events.Usage] = []

    async def meter(msg: Any) -> None:
        metered.append(events.Decoder(events.Usage).decode(msg.data))

    sub = await bus.nc.subscribe("usage.r1.api", cb=meter)
    whole = (await client.post("/v1/chat/completions", json=chat)).json()
    chunks = chunks_of(await client.post("/v1/chat/completions", json=chat | {
        "stream": True, "stream_options": {"include_usage": True}}))
    # Each request is metered once, streamed or not: the prompt once, every choice's tokens.
    await until(lambda: len(metered) == 2, what="two usage events")
    await sub.unsubscribe()
    assert [(u.run, u.source, u.prompt_tokens, u.sampled_tokens) for u in metered] == [
        ("r1", "api", whole["usage"]["prompt_tokens"], whole["usage"]["completion_tokens"])] * 2
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert chunks[-2]["system_fingerprint"] == "policy-v0"
    streamed = assembled(chunks[:-1], 2)
    for got, want in zip(streamed, whole["choices"], strict=True):
        assert got["text"] == want["message"]["content"] and got["finish_reason"] == want["finish_reason"]
        assert got["logprobs"] == want["logprobs"]["content"]  # every token once, in order
    assert max(c["num_text_chunks"] for c in streamed) > 1  # token by token, not one piece

    # A stop string: the text is cut before it in both; the stream never shows any of it.
    answer = whole["choices"][0]["message"]["content"]
    stop = answer[len(answer) // 2:len(answer) // 2 + 2]
    whole_stopped = (await client.post("/v1/chat/completions", json=chat | {"n": 1, "stop": [stop]})).json()
    (stopped,) = assembled(chunks_of(await client.post("/v1/chat/completions", json=chat | {
        "n": 1, "stop": [stop], "stream": True})), 1)
    assert stopped["text"] == whole_stopped["choices"][0]["message"]["content"] == answer[:answer.find(stop)]

    # /v1/completions streams text_completion chunks the same way.
    completion = {"model": "r1", "prompt": "abc", "max_tokens": 12, "seed": 4}
    whole = (await client.post("/v1/completions", json=completion)).json()
    (streamed_completion,) = assembled(chunks_of(await client.post("/v1/completions", json=completion | {
        "stream": True})), 1)
    assert streamed_completion["text"] == whole["choices"][0]["text"]
    assert streamed_completion["logprobs"] == whole["choices"][0]["logprobs"]["token_logprobs"]


async def test_tokens_reach_the_client_while_the_answer_is_still_sampled(
        server: Served, bus: Bus, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over HTTP (uvicorn): the first text arrives before the backend has finished the answer."""
    step = DecodeSession.step
    finished_at: list[float] = []

    def slow(self: DecodeSession) -> Any:
        time.sleep(0.01)  # noqa: sleep - a bigger model's time per token, in the backend's thread
        done = step(self)
        if done and not self.num_rows:  # the batch's last row finished
            finished_at.append(time.monotonic())
        return done

    monkeypatch.setattr(DecodeSession, "step", slow)
    await create_run(bus, tiny_model_dir)
    base, _ = models.load_model(tiny_model_dir)
    await publish_weights(bus, "r1", 0, base)
    chat = {"model": "r1", "messages": [{"role": "user", "content": "abc"}], "max_tokens": 40, "seed": 2,
            "stream": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:

        async def answered() -> bool:  # 404 until the run is seen, 503 until its weights are loaded
            return (await client.post("/v1/chat/completions", json=chat | {"stream": False})).status_code == 200

        await until(answered, timeout_s=30, what="run r1 answering")
        arrivals = []
        async with client.stream("POST", "/v1/chat/completions", json=chat) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    arrivals.append(time.monotonic())
    assert len(arrivals) > 5 and arrivals[0] < finished_at[-1] - 0.05, (arrivals, finished_at)
