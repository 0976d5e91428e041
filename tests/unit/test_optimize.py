"""`flywheel optimize`: GEPA evolves a system prompt through the real eval machinery (proxy,
harness, rewards) against a scripted model that answers well only when its system prompt says
what the task is; the reflection model (the same server) proposes such a prompt from the failed
rollouts it is shown. The held-out reward of the best prompt beats the original's."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request

from flywheel.ops.optimize import OptimizeConfig, optimize
from flywheel.runtime.evaluation import EvalConfig
from flywheel.runtime.natsserver import free_port
from tests.inprocess import InProcessPool
from tests.integration.conftest import ENVS


class PromptSensitive:
    """Reverses the user's text when the system prompt says 'reverse', else says it cannot; as the
    reflection model, proposes such a prompt once it has seen a failure in what it is shown."""

    def __init__(self) -> None:
        self.reflections: list[str] = []
        self.temperatures: dict[str, set[float | None]] = {"reflection": set(), "rollout": set()}
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self.chat)

    async def chat(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        messages = body["messages"]
        last = messages[-1]["content"]
        reflecting = "You are improving the system prompt" in last
        self.temperatures["reflection" if reflecting else "rollout"].add(body.get("temperature"))
        if reflecting:
            self.reflections.append(last)
            answer = "```\nReverse the user's text, letter by letter.\n```" if "reward 0" in last else "```\nHi.\n```"
        else:
            system = messages[0]["content"] if messages[0]["role"] == "system" else ""
            answer = last[::-1] if "reverse" in system.lower() else "no idea"
        return {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}


@pytest.fixture
def upstream() -> Iterator[tuple[PromptSensitive, str]]:
    """The scripted model on a free port, served from a thread (optimize runs its own event loops)."""
    scripted, port = PromptSensitive(), free_port()
    server = uvicorn.Server(uvicorn.Config(scripted.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the scripted model did not start"
        time.sleep(0.02)  # noqa: sleep - waiting for the server thread
    yield scripted, f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(10)


def test_gepa_finds_a_prompt_that_beats_the_original_on_held_out_tasks(
        upstream: tuple[PromptSensitive, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ENVS))
    scripted, url = upstream
    cfg = OptimizeConfig(eval=EvalConfig(env="magic_env", model="m", base_url=url, out=tmp_path / "unused",
                                         sampling={"temperature": 0.0}),
                         num_train=4, num_val=2, num_test=4, max_metric_calls=24, minibatch=2,
                         reflection_temperature=0.3)
    report = optimize(cfg, tmp_path / "evals", InProcessPool())
    assert report["original_prompt"] == ""
    assert "reverse" in report["best_prompt"].lower()
    assert report["held_out_original"]["reward_mean"] == 0.0 and report["held_out_best"]["reward_mean"] == 1.0
    assert report["held_out_gain"] == 1.0 and report["num_candidates"] >= 2
    assert scripted.reflections and "no idea" in scripted.reflections[0]  # it was shown the failed answers
    assert Path(report["report"]).exists() and report["num_metric_calls"] <= 24 + 2
    assert scripted.temperatures == {"reflection": {0.3}, "rollout": {0.0}}  # --reflection-temperature, --temperature


def test_an_endpoint_that_fails_every_rollout_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ENVS))
    cfg = OptimizeConfig(eval=EvalConfig(env="magic_env", model="m", base_url=f"http://127.0.0.1:{free_port()}/v1",
                                         out=tmp_path / "unused", max_retries=0),
                         num_train=1, num_val=1, num_test=1, max_metric_calls=2, minibatch=1)
    refused = r"every held-out rollout of m at http://127\.0\.0\.1:\d+/v1 failed.*ConnectError"
    with pytest.raises(ValueError, match=refused):
        optimize(cfg, tmp_path / "evals", InProcessPool())
