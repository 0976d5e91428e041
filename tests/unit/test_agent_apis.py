"""Agents written with the `openai` SDK's Responses API and the `anthropic` SDK's Messages API,
run against the interception routes (the real app, the real tiny tokenizer, a scripted policy so
tool calls happen): multi-turn conversations with tool calls, whole and streamed, become trace
graphs whose every branch is exactly what the model was given and sampled, with no re-render;
malformed requests get each API's own error shape, never a 500."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
from fastapi import FastAPI
from transformers import AutoTokenizer

from flywheel.contract import events
from flywheel_inference import agent_apis, interception
from flywheel_inference.interception import Interception, Session
from tests.unit.test_inference_interception import ScriptedPolicy, assert_exact, assert_metered

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>'
ADD = {"name": "add", "description": "Add two numbers.",
       "schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class Served:
    """The interception routes (chat, Responses, Messages) in an app, and one open rollout."""

    def __init__(self, tok: Any, texts: list[str]) -> None:
        self.policy = ScriptedPolicy(tok, texts)
        self.registry = Interception()
        self.app = FastAPI()
        interception.install(self.app)
        agent_apis.install(self.app)
        self.app.state.interception = self.registry

        async def publish(nodes: list[events.TraceNode]) -> None:
            pass

        self.session: Session = self.registry.open("r1", "ro1", self.policy, events.Sampling(max_tokens=32), publish)
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://inference")
        # The SDKs are built on httpx2, a fork of httpx with its own client classes.
        self.http2 = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=self.app))

    def openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"http://inference/intercept/{self.session.key}/v1", api_key="unused",
                                  http_client=self.http2, max_retries=0)

    def anthropic(self, key: str | None = None) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(base_url=f"http://inference/intercept/{key or self.session.key}",
                                        api_key="unused", http_client=self.http2, max_retries=0)

    def assert_exact(self) -> None:
        assert_exact(self.session.graph, self.policy)
        assert_metered(self.session, self.policy)
        assert self.session.num_rerenders == 0
        assert len([n for n in self.session.graph.nodes.values() if n.parent_id is None]) == 1  # one root: no re-render


@pytest.fixture
async def served(tok: Any, request: pytest.FixtureRequest) -> AsyncIterator[Served]:
    s = Served(tok, request.param)
    yield s
    await s.http.aclose()
    await s.http2.aclose()


RESPONSES_TOOLS: list[Any] = [{"type": "function", "name": ADD["name"], "description": ADD["description"],
                               "parameters": ADD["schema"]}]


@pytest.mark.parametrize("served", [[CALL, "four", "done"]], indirect=True)
async def test_a_responses_agent_with_tools_yields_exact_tokens_whole_stateful_and_streamed(served: Served) -> None:
    client = served.openai()
    first = await client.responses.create(model="m", instructions="Use tools.", input="what is 2+2",
                                          tools=RESPONSES_TOOLS)
    assert first.status == "completed" and first.output_text == ""
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "add" and json.loads(call.arguments) == {"a": 2, "b": 2}
    assert first.usage is not None and first.usage.output_tokens == len(served.policy.sampled[0])

    # Stateful: the tool's answer continues the stored response.
    second = await client.responses.create(model="m", instructions="Use tools.", previous_response_id=first.id,
                                           input=[{"type": "function_call_output", "call_id": call.call_id,
                                                   "output": "4"}], tools=RESPONSES_TOOLS)
    assert second.output_text == "four" and second.previous_response_id == first.id

    # Stateless and streamed: the whole history replayed as items, as a client that keeps it does.
    history: list[Any] = [{"role": "user", "content": "what is 2+2"},
                          {"type": "function_call", "call_id": call.call_id, "name": call.name,
                           "arguments": call.arguments},
                          {"type": "function_call_output", "call_id": call.call_id, "output": "4"},
                          {"role": "assistant", "content": [{"type": "output_text", "text": "four"}]},
                          {"role": "user", "content": [{"type": "input_text", "text": "thanks"}]}]
    stream = await client.responses.create(model="m", instructions="Use tools.", input=history,
                                           tools=RESPONSES_TOOLS, stream=True)
    kinds, deltas, completed = [], [], None
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type == "response.completed":
            completed = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(deltas) == "done" and completed is not None and completed.output_text == "done"
    assert [event == "response.output_text.delta" for event in kinds].count(True) >= 2  # token by token
    served.assert_exact()
    roles = [n.message.role for n in served.session.graph.branch(served.session.graph.last.id)]  # type: ignore[union-attr]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user", "assistant"]


@pytest.mark.parametrize("served", [[CALL]], indirect=True)
async def test_a_streamed_responses_tool_call_comes_whole_and_its_text_is_held_back(served: Served) -> None:
    client = served.openai()
    async with client.responses.stream(model="m", input="what is 2+2", tools=RESPONSES_TOOLS) as stream:
        events_seen = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert "response.output_text.delta" not in events_seen  # the call's markup is never shown as text
    assert "response.function_call_arguments.done" in events_seen
    (call,) = final.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"a": 2, "b": 2}
    served.assert_exact()


@pytest.mark.parametrize("served", [["x" * 3 + "..."]], indirect=True)
async def test_a_responses_answer_cut_at_the_token_limit_is_incomplete(served: Served) -> None:
    response = await served.openai().responses.create(model="m", input="go", max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"


MESSAGES_TOOLS: list[Any] = [{"name": ADD["name"], "description": ADD["description"], "input_schema": ADD["schema"]}]


@pytest.mark.parametrize("served", [[CALL, "four", "done"]], indirect=True)
async def test_a_messages_agent_with_tools_yields_exact_tokens_whole_and_streamed(served: Served) -> None:
    client = served.anthropic()
    messages: list[Any] = [{"role": "user", "content": "what is 2+2"}]
    first = await client.messages.create(model="m", max_tokens=32, system="Use tools.", messages=messages,
                                         tools=MESSAGES_TOOLS)
    assert first.stop_reason == "tool_use"
    (use,) = first.content
    assert use.type == "tool_use" and use.name == "add" and use.input == {"a": 2, "b": 2}
    assert first.usage.output_tokens == len(served.policy.sampled[0])

    # The reply as it came, then the tool's result, as an Anthropic client sends them.
    messages += [{"role": "assistant", "content": [block.model_dump() for block in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "4"}]}]
    second = await client.messages.create(model="m", max_tokens=32, system="Use tools.", messages=messages,
                                          tools=MESSAGES_TOOLS)
    assert second.stop_reason == "end_turn" and [b.type for b in second.content] == ["text"]

    messages += [{"role": "assistant", "content": [block.model_dump() for block in second.content]},
                 {"role": "user", "content": [{"type": "text", "text": "thanks"}]}]
    async with client.messages.stream(model="m", max_tokens=32, system="Use tools.", messages=messages,
                                      tools=MESSAGES_TOOLS) as stream:
        texts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(texts) == "done" and len(texts) >= 2 and final.content[0].type == "text"
    # count_tokens (as Claude Code asks before a turn): the prompt the last call was given.
    counted = await client.messages.count_tokens(model="m", system="Use tools.", messages=messages,
                                                 tools=MESSAGES_TOOLS)
    assert counted.input_tokens == len(served.policy.prompts[2])
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == len(served.policy.sampled[2])
    served.assert_exact()
    roles = [n.message.role for n in served.session.graph.branch(served.session.graph.last.id)]  # type: ignore[union-attr]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user", "assistant"]


@pytest.mark.parametrize("served", [["let me add" + CALL]], indirect=True)
async def test_a_streamed_messages_tool_call_is_a_tool_use_block_after_the_text(served: Served) -> None:
    async with served.anthropic().messages.stream(model="m", max_tokens=32, tools=MESSAGES_TOOLS,
                                                  messages=[{"role": "user", "content": "2+2"}]) as stream:
        final = await stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.stop_reason == "tool_use"
    assert final.content[0].text == "let me add"  # type: ignore[union-attr]
    assert final.content[1].input == {"a": 2, "b": 2}  # type: ignore[union-attr]


@pytest.mark.parametrize("served", [["unused"]], indirect=True)
async def test_malformed_responses_requests_get_openai_errors_naming_the_field(served: Served) -> None:
    client = served.openai()
    cases: list[tuple[dict[str, Any], str, str | None]] = [
        ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id", "previous_response_not_found"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
         "input[0].content[0].type", "unsupported_content_type"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", None),
        ({"input": "hi", "tools": [{"type": "function", "parameters": {}}]}, "tools[0].name", None),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", "unsupported_input_type"),
        ({"input": []}, "input", None),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", None),
    ]
    for body, param, code in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model="m", **body)
        error = caught.value.body
        assert isinstance(error, dict) and error["param"] == param and error["code"] == code, (body, error)
        assert param in error["message"] or "resp_nope" in error["message"]  # the field, or the value
    raw = await served.http.post(f"/intercept/{served.session.key}/v1/responses", content=b"{not json")
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "body"
    gone = await served.http.post("/intercept/fw-nope/v1/responses", json={"input": "hi"})
    assert gone.status_code == 401 and gone.json()["error"]["code"] == "invalid_rollout_key"
    assert served.policy.prompts == []  # nothing was sampled


@pytest.mark.parametrize("served", [["unused"]], indirect=True)
async def test_malformed_messages_requests_get_anthropic_errors_naming_the_field(served: Served) -> None:
    client = served.anthropic()
    user: list[Any] = [{"role": "user", "content": "hi"}]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"messages": user, "tools": [{"name": "add"}]}, "tools.0.input_schema: Field required"),
        ({"messages": user, "tools": [{"name": "add", "input_schema": {"type": "string"}}]},
         "tools.0.input_schema.type"),
        ({"messages": user, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, "messages.0.content.0.type"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"messages": []}, "messages"),
    ]
    for body, said in cases:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await client.messages.create(model="m", max_tokens=8, **body)
        error = caught.value.body
        assert isinstance(error, dict) and error["type"] == "error", error
        assert error["error"]["type"] == "invalid_request_error" and said in error["error"]["message"], (body, error)
    base = f"/intercept/{served.session.key}/v1/messages"
    no_limit = await served.http.post(base, json={"model": "m", "messages": user})
    assert no_limit.status_code == 400 and no_limit.json()["error"]["message"] == "max_tokens: Field required"
    raw = await served.http.post(base, content=b"[")
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError):
        await served.anthropic("fw-nope").messages.create(model="m", max_tokens=8, messages=user)
    assert served.policy.prompts == []


@pytest.mark.parametrize("served", [["abc", "def"]], indirect=True)
async def test_the_rollout_key_as_the_api_key_reaches_the_rollout_on_the_plain_paths(served: Served) -> None:
    from flywheel_inference.api import RolloutKeyAsBearer

    served.app.add_middleware(RolloutKeyAsBearer)
    responses = await served.http.post("/v1/responses", json={"model": "m", "input": "hi"},
                                       headers={"Authorization": f"Bearer {served.session.key}"})
    assert responses.status_code == 200 and responses.json()["output"][0]["content"][0]["text"] == "abc"
    messages = await served.http.post("/v1/messages", headers={"x-api-key": served.session.key},
                                      json={"model": "m", "max_tokens": 8, "messages": [{"role": "user",
                                                                                           "content": "hi"}]})
    assert messages.status_code == 200 and messages.json()["content"] == [{"type": "text", "text": "def"}]
