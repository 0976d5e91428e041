"""The scripted OpenAI-compatible server that environment tests use as a fake model."""

from __future__ import annotations

import openai
import pytest

from tests.scripted_openai import ScriptedOpenAI, ScriptEntry, tool_call


def test_scripts_per_model_streaming_and_the_end_of_a_script() -> None:
    script: dict[str, list[ScriptEntry]] = {"agent": ["hello", tool_call("search", query="bees", call_id="c1")],
              "user": [lambda body: f"you said {body['messages'][-1]['content']}"]}
    with ScriptedOpenAI(script) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="test", max_retries=0)
        first = client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "hi"}])
        assert first.choices[0].message.content == "hello" and first.choices[0].finish_reason == "stop"
        chunks = list(client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "go"}],
                                                     stream=True))
        calls = chunks[0].choices[0].delta.tool_calls
        assert calls is not None
        call = calls[0]
        assert call.function is not None
        assert (call.id, call.function.name, call.function.arguments) == ("c1", "search", '{"query": "bees"}')
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        user = client.chat.completions.create(model="user", messages=[{"role": "user", "content": "ping"}])
        assert user.choices[0].message.content == "you said ping"
        with pytest.raises(openai.BadRequestError, match="no reply left in the script of model 'agent'"):
            client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "more"}])
        assert server.remaining("agent") == 0 and len(server.requests_for("agent")) == 2
        assert server.conversation("agent")[-1]["tool_calls"][0]["id"] == "c1"
