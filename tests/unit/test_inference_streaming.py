"""Streaming answers token by token, with the real tiny tokenizer (byte-level, so a character
can take several tokens): what may be shown is held back until it cannot change (a character
still incomplete, the start of a stop string, a tool call), and a streamed tool-calling answer
assembles to the same message as the whole one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flywheel.sdk import models
from flywheel_inference.api import OPEN, ChatCompletionRequest, chat_completions
from flywheel_inference.streaming import TextStream
from tests.unit.test_inference_api_tools import TOOL, ScriptedHosted, ScriptedWorker, chat


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    return models.load_model(tiny_model_dir)[1]


def shown(tok: Any, stream: TextStream, text: str, final: str | None = None) -> list[str]:
    """The pieces a client is sent for ``text`` sampled token by token, the last one at the end
    (``final``: the answer's text as the backend cuts it; default ``text``)."""
    pieces = [stream.push(t, -1.0) for t in tok.encode(text, add_special_tokens=False)]
    return [*pieces, stream.finish(text if final is None else final)]


def test_a_character_of_several_tokens_is_sent_once_whole(tok: Any) -> None:
    pieces = shown(tok, TextStream(tok), "a日b")
    assert "".join(pieces) == "a日b" and "日" in pieces and not any("\ufffd" in p for p in pieces)


def test_nothing_of_a_stop_string_is_sent(tok: Any) -> None:
    pieces = shown(tok, TextStream(tok, stop=["STOP"]), "say STOP now", final="say ")
    assert "".join(pieces) == "say "
    # Its first letters wait until they turn out not to start it, then go out.
    stream = TextStream(tok, stop=["STOP"])
    assert [p for p in shown(tok, stream, "a STaY")[:-1] if p] == ["a", " ", "STa", "Y"]
    assert len(stream.take_logprobs()) == len(tok.encode("a STaY", add_special_tokens=False))


def test_with_tools_offered_a_call_is_not_sent_as_text(tok: Any) -> None:
    text = 'Adding.\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    pieces = shown(tok, TextStream(tok, tools=True), text, final="Adding.")
    assert "".join(pieces) == "Adding." and not any("<" in p for p in pieces)
    # Without tools, the same text is text.
    assert "".join(shown(tok, TextStream(tok), text)) == text


async def test_a_streamed_tool_call_assembles_to_the_whole_answer(tok: Any) -> None:
    texts = ['Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>']
    body = {"model": "r1", "messages": [{"role": "user", "content": "2 + 2?"}], "tools": [TOOL]}
    whole = (await chat(ChatCompletionRequest.model_validate(body), ScriptedHosted(tok, texts)))["choices"][0]
    response = await chat_completions(ChatCompletionRequest.model_validate(body | {"stream": True}),
                                      ScriptedWorker(ScriptedHosted(tok, texts)), OPEN)  # type: ignore[arg-type]  # scripted
    events = [line async for line in response.body_iterator]  # type: ignore[union-attr]  # streamed: a StreamingResponse
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(str(e).removeprefix("data: ")) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert content == whole["message"]["content"] == "Let me add."
    assert [{k: v for k, v in call.items() if k not in ("index", "id")} for call in calls] == [
        {k: v for k, v in call.items() if k != "id"} for call in whole["message"]["tool_calls"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"] == "tool_calls"
    streamed_logprobs = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert streamed_logprobs == whole["logprobs"]["content"]
