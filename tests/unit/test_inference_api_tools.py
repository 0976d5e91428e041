"""Tool calls on inference's plain OpenAI API (``model = RUN``), with the real tiny tokenizer and
a scripted policy in place of the model (the tiny model does not call tools by itself): the
tools reach the prompt, a sampled ``<tool_call>`` comes back as ``tool_calls``, a conversation
with a call and its result renders, and what is not supported is refused naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flywheel.contract import events
from flywheel.sdk import models
from flywheel_inference.api import OPEN, ApiError, ChatCompletionRequest, chat_completions
from flywheel_inference.completion import Completion
from flywheel_inference.policy import OnToken, Sampled
from tests.helpers import until

TOOL = {"type": "function", "function": {"name": "add", "description": "add two numbers",
                                         "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}


class ScriptedHosted:
    """What ``Worker.served`` returns, answering with ``texts`` and keeping the prompts it got."""

    def __init__(self, tok: Any, texts: list[str]) -> None:
        self.policy = self
        self.backend = type("B", (), {"tokenizer": tok})()
        self.sampling = events.Sampling()
        self.config = type("C", (), {"run": "r1"})()
        self.texts = texts
        self.prompts: list[list[int]] = []
        self.metered: list[events.Usage] = []  # what the API published of each request (metering)

    def check(self, prompts: Any, sampling: events.Sampling) -> None:
        sampling.check()

    def check_ready(self) -> None:
        pass

    async def sample(self, prompts: list[list[int]], sampling: events.Sampling,
                     on_token: OnToken | None = None) -> list[Sampled]:
        self.prompts += prompts
        tok = self.backend.tokenizer
        out = []
        for i, text in enumerate(self.texts[:len(prompts)]):
            ids = tok.encode(text, add_special_tokens=False)
            if on_token is not None:
                for token_id in ids:
                    on_token(i, token_id, -0.5)
            out.append(Sampled(Completion(ids, [-0.5] * len(ids), "stop", text), 3, 0.01))
        return out


async def chat(body: ChatCompletionRequest, hosted: ScriptedHosted) -> dict[str, Any]:
    answer = await chat_completions(body, ScriptedWorker(hosted), OPEN)  # type: ignore[arg-type]  # scripted, as a Worker
    assert isinstance(answer, dict)  # not streamed
    return answer


class ScriptedWorker:
    def __init__(self, hosted: ScriptedHosted) -> None:
        self.hosted = hosted
        self.bus = self  # publishes the usage events into hosted.metered

    def publish_soon(self, event: events.Usage, what: str) -> None:
        assert event.run in what  # the failure it would log names the run
        self.hosted.metered.append(event)

    async def served(self, model: str) -> ScriptedHosted:
        return self.hosted


@pytest.fixture
def tok(tiny_model_dir: Path) -> Any:
    return models.load_model(tiny_model_dir)[1]


async def test_a_sampled_tool_call_comes_back_as_tool_calls(tok: Any) -> None:
    hosted = ScriptedHosted(tok, ['<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'])
    body = ChatCompletionRequest(model="r1", messages=[{"role": "user", "content": "2 + 2?"}], tools=[TOOL])
    answer = await chat(body, hosted)
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 2} and call["id"].startswith("call_")
    assert '"name": "add"' in tok.decode(hosted.prompts[0])  # the tools were rendered into the prompt
    await until(lambda: len(hosted.metered) == 1, what="the request's usage")
    (usage,) = hosted.metered
    assert (usage.run, usage.source, usage.prompt_tokens, usage.sampled_tokens) == (
        "r1", "api", answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"])

    # The call and its result go back in, as an OpenAI client sends them; the answer is text.
    hosted.texts = ["4"]
    follow_up = [{"role": "user", "content": "2 + 2?"},
                 {"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": call["id"], "content": "4"}]
    answer = await chat(ChatCompletionRequest(model="r1", messages=follow_up, tools=[TOOL]), hosted)
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "4"}
    assert answer["choices"][0]["finish_reason"] == "stop"
    rendered = tok.decode(hosted.prompts[1])
    assert '"arguments": {"a": 2}' in rendered and "tool\n4" in rendered  # the call and its result

    # Without tools offered (or tool_choice none), a <tool_call> is text like any other.
    hosted.texts = ['<tool_call>{"name": "add", "arguments": {}}</tool_call>']
    plain = await chat(ChatCompletionRequest(model="r1", messages=[{"role": "user", "content": "hi"}],
                                             tools=[TOOL], tool_choice="none"), hosted)
    assert plain["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in plain["choices"][0]["message"]


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice", "is not supported"),
    ({"tools": [{"type": "retrieval"}]}, "tools", r"tools\[0\]: only"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", r"messages\[0\]"),
])
async def test_what_the_api_does_not_take_is_refused_naming_the_field(tok: Any, fields: dict, param: str,
                                                                       message: str) -> None:
    body = ChatCompletionRequest.model_validate({"model": "r1", "messages": [{"role": "user", "content": "x"}],
                                                 **fields})
    with pytest.raises(ApiError, match=message) as caught:
        await chat_completions(body, ScriptedWorker(ScriptedHosted(tok, ["x"])), OPEN)  # type: ignore[arg-type]  # scripted
    assert caught.value.param == param and caught.value.status == 400
