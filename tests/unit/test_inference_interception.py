"""The interception session's token layer, with the real tiny tokenizer and a scripted policy
(the sampled texts are chosen by the test, so tool calls happen): multi-turn prompts extend
the sampled tokens, every branch's spans are exactly what the model was given and sampled,
retries branch, a template that rewrites history is re-rendered and counted."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

import pytest
from transformers import AutoTokenizer

from flywheel.contract import events
from flywheel.sdk import models
from flywheel.sdk.harness import ModelCallError, RolloutContext
from flywheel.sdk.tracegraph import TraceGraph
from flywheel_inference.completion import Completion
from flywheel_inference.interception import Interception, InterceptionError, Renderer, parse_tool_calls
from flywheel_inference.policy import OnToken, Sampled

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]


class ScriptedPolicy:
    """Answers with the next scripted text (tokenized by the real tokenizer), recording prompts."""

    def __init__(self, tok: Any, texts: list[str], max_len: int = 4096) -> None:
        self.backend = type("B", (), {"tokenizer": tok})()
        self.texts = list(texts)
        self.prompts: list[list[int]] = []
        self.sampled: list[list[int]] = []
        self.max_len = max_len
        self.version = 3

    def check(self, prompts: list[list[int]], sampling: events.Sampling) -> None:
        if len(prompts[0]) + sampling.max_tokens > self.max_len:
            raise ValueError(f"prompt of {len(prompts[0])} tokens + max_tokens {sampling.max_tokens} is too long")

    async def sample(self, prompts: list[list[int]], sampling: events.Sampling,
                     on_token: OnToken | None = None) -> list[Sampled]:
        tok = self.backend.tokenizer
        text = self.texts.pop(0)
        truncated = text.endswith("...")
        ids = tok.encode(text, add_special_tokens=False) + ([] if truncated else [tok.eos_token_id])
        self.prompts.append(list(prompts[0]))
        self.sampled.append(ids)
        if on_token is not None:
            for token_id in ids:
                on_token(0, token_id, -0.25)
                await asyncio.sleep(0)  # noqa: sleep - one turn of the loop between tokens, as a batch gives
        completion = Completion(token_ids=ids, logprobs=[-0.25] * len(ids), finish_reason="length" if truncated
                                else "stop", text=text)
        return [Sampled(completion, self.version, 0.01)]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def msg(role: Literal["system", "user", "assistant", "tool"], content: str = "", **kw: Any) -> events.Message:
    return events.Message(role=role, content=content, **kw)


def session_for(policy: ScriptedPolicy) -> tuple[Any, list[events.TraceNode]]:
    published: list[events.TraceNode] = []

    async def publish(nodes: list[events.TraceNode]) -> None:
        published.extend(nodes)

    return Interception().open("r1", "ro1", policy, events.Sampling(max_tokens=16), publish), published


def assert_exact(graph: TraceGraph, policy: ScriptedPolicy) -> None:
    """Every call: the branch's spans up to its answer's sampled tokens == the prompt the model got,
    and the sampled tokens follow; every branch concatenated is prompt + sampled of its last call;
    each token carries its text, as the tokenizer decodes it alone."""
    answers = [n for n in graph.nodes.values() if n.tokens and any(n.tokens.loss_mask)]
    assert len(answers) == len(policy.prompts)
    for node in answers:
        spans = []
        for n in graph.branch(node.id):
            assert n.tokens is not None, n.id
            spans.append(n.tokens)
        ids = [t for span in spans for t in span.token_ids]
        assert node.tokens is not None
        sampled = [t for t, m in zip(node.tokens.token_ids, node.tokens.loss_mask, strict=True) if m]
        call = policy.sampled.index(sampled)
        assert ids == policy.prompts[call] + policy.sampled[call]
        for span in spans:
            assert len(span.logprobs) == len(span.token_ids) == len(span.loss_mask)
            assert span.texts == [policy.backend.tokenizer.decode([t]) for t in span.token_ids]


def assert_metered(session: Any, policy: ScriptedPolicy) -> None:
    """The rollout's metered usage is what the model was given and sampled, call by call."""
    assert session.usage() == events.RolloutUsage(num_calls=len(policy.prompts),
                                                  prompt_tokens=sum(map(len, policy.prompts)),
                                                  sampled_tokens=sum(map(len, policy.sampled)))


async def test_a_tool_call_conversation_extends_the_sampled_tokens(tok: Any) -> None:
    call_text = '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    policy = ScriptedPolicy(tok, [call_text, "four"])
    session, published = session_for(policy)
    first = [msg("system", "Use tools."), msg("user", "what is 2+2")]
    answer, _, _ = await session.chat(first, TOOLS, None)
    assert answer.message.content == "" and [c.name for c in answer.message.tool_calls] == ["add"]
    assert json.loads(answer.message.tool_calls[0].arguments) == {"a": 2}
    # The harness sends back what it got, plus the tool's answer (as an OpenAI client would).
    second = [*first, answer.message, msg("tool", "4", tool_call_id=answer.message.tool_calls[0].id)]
    final, _, _ = await session.chat(second, TOOLS, None)
    assert final.message.content == "four" and session.num_rerenders == 0 and session.num_calls == 2
    # The second prompt starts with the first prompt and the sampled tokens, unchanged.
    assert policy.prompts[1][:len(policy.prompts[0]) + len(policy.sampled[0])] == policy.prompts[0] + policy.sampled[0]
    # ... and then is what the template renders for the tool turn and the generation prompt.
    rendered = models.render_prompt(tok, second, TOOLS)
    assert tok.decode(policy.prompts[1]) == tok.decode(rendered)
    assert_exact(session.graph, policy)
    assert_metered(session, policy)
    assert [n.message.role for n in session.graph.branch(final.id)] == ["system", "user", "assistant", "tool",
                                                                          "assistant"]
    await session.flush()
    assert [p.node.id for p in published] == [n.id for n in session.graph.ordered()]


async def test_a_truncated_answer_is_closed_by_the_template_before_the_next_turn(tok: Any) -> None:
    policy = ScriptedPolicy(tok, ["abc...", "done"])
    session, _ = session_for(policy)
    first = [msg("user", "go")]
    answer, completion, _ = await session.chat(first, None, None)
    assert completion.finish_reason == "length" and session.truncated
    await session.chat([*first, answer.message, msg("user", "go on")], None, None)
    bridge = policy.prompts[1][len(policy.prompts[0]) + len(policy.sampled[0]):]
    assert tok.decode(bridge).startswith("<|im_end|>\n<|im_start|>user\ngo on")
    assert_exact(session.graph, policy)
    assert_metered(session, policy)


async def test_a_retry_is_a_sibling_branch_and_both_are_exact(tok: Any) -> None:
    policy = ScriptedPolicy(tok, ["one", "two"])
    session, _ = session_for(policy)
    first = [msg("system", "s"), msg("user", "q")]
    a, _, _ = await session.chat(first, None, None)
    b, _, _ = await session.chat(first, None, None)
    assert a.parent_id == b.parent_id and a.id != b.id and len(session.graph.leaves()) == 2
    assert policy.prompts[0] == policy.prompts[1]
    assert_exact(session.graph, policy)
    assert_metered(session, policy)


async def test_history_the_template_rewrites_is_re_rendered_as_a_new_branch_and_counted(tok: Any) -> None:
    policy = ScriptedPolicy(tok, ["first", "second"])
    session, _ = session_for(policy)
    first = [msg("user", "q")]
    a, _, _ = await session.chat(first, None, None)
    # A template that drops earlier assistant turns (as some reasoning templates do) is not
    # prefix-stable: extending would show the model something the template never renders.
    original = session._renderer._text

    def dropping(tok_: Any, messages: Any, tools: Any = None, generation_prompt: bool = False) -> str:
        kept = [m for i, m in enumerate(messages) if not (m.role == "assistant" and i < len(messages) - 1)]
        return original(tok_, kept, tools, generation_prompt)

    session._renderer._text = dropping
    await session.chat([*first, a.message, msg("user", "again")], None, None)
    assert session.num_rerenders == 1
    assert policy.prompts[1] == tok.encode(dropping(tok, [*first, a.message, msg("user", "again")], None, True),
                                           add_special_tokens=False)
    # The new branch starts below the last message the template still renders as before (the question):
    # one root, and the dropped answer's node there holds no tokens.
    roots = [n for n in session.graph.nodes.values() if n.parent_id is None]
    assert len(roots) == 1 and len(session.graph.leaves()) == 2
    dropped = [n for n in session.graph.children(roots[0].id) if n.id != a.id]
    assert [n.message for n in dropped] == [a.message] and dropped[0].tokens and dropped[0].tokens.token_ids == []
    assert_exact(session.graph, policy)
    assert_metered(session, policy)


async def test_a_prompt_past_the_context_is_an_openai_error_and_marks_the_rollout_truncated(tok: Any) -> None:
    policy = ScriptedPolicy(tok, ["x"], max_len=20)
    session, _ = session_for(policy)
    with pytest.raises(InterceptionError) as err:
        await session.chat([msg("user", "a long question " * 10)], None, None)
    assert err.value.status == 400 and err.value.code == "context_length_exceeded" and session.truncated


async def test_trace_nodes_go_on_the_bus_only_once_the_rollout_has_run_live_after_s(tok: Any) -> None:
    published: list[events.TraceNode] = []

    async def publish(nodes: list[events.TraceNode]) -> None:
        published.extend(nodes)

    interception, policy = Interception(), ScriptedPolicy(tok, ["one", "two", "three"])
    # A rollout that ends sooner publishes nothing: its nodes travel in its rollout.
    short = interception.open("r1", "ro-short", policy, events.Sampling(max_tokens=16), publish, live_after_s=0.5)
    await short.chat([msg("user", "hi")], None, None)
    interception.close(short.key)
    await short.flush()
    await asyncio.sleep(0.6)  # noqa: sleep - past its live time: ended, it stays off the bus
    assert published == [] and len(short.graph.ordered()) == 2
    # A longer one goes live when its time comes, without waiting for its next call, then publishes as it goes.
    long = interception.open("r1", "ro-long", policy, events.Sampling(max_tokens=16), publish, live_after_s=1.0)
    first, _, _ = await long.chat([msg("user", "hi")], None, None)
    await asyncio.sleep(0)  # noqa: sleep - one turn of the loop: what is scheduled runs
    assert published == []
    await asyncio.sleep(1.2)  # noqa: sleep - past its live time: the timer under test fires
    assert [t.node.id for t in published] == [n.id for n in long.graph.ordered()]
    num_live = len(published)
    await long.chat([msg("user", "hi"), first.message, msg("user", "again")], None, None)
    interception.close(long.key)
    await long.flush()
    assert [t.node.id for t in published] == [n.id for n in long.graph.ordered()]
    assert len(published) > num_live  # the second call's nodes too
    assert {t.rollout_id for t in published} == {"ro-long"}


def test_tool_calls_are_parsed_and_malformed_ones_stay_text() -> None:
    content, calls = parse_tool_calls('ok <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    assert content == "ok" and calls[0].name == "f" and json.loads(calls[0].arguments) == {"x": 1}
    content, calls = parse_tool_calls("<tool_call>{not json}</tool_call>")
    assert calls == [] and content == "<tool_call>{not json}</tool_call>"


def test_the_renderer_finds_the_templates_closing(tok: Any) -> None:
    r = Renderer(tok)
    assert r.closing == "<|im_end|>\n" and r.eos_text == "<|im_end|>"


def test_the_renderer_renders_each_message_list_once(tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    r = Renderer(tok)
    calls: list[int] = []
    render = r._text

    def counting(*args: Any) -> str:
        calls.append(1)
        return render(*args)

    monkeypatch.setattr(r, "_text", counting)
    messages = [msg("system", "Reverse the text."), msg("user", "abc")]
    first = r.plan(TraceGraph(), messages, None, True)
    num_renders = len(calls)
    for _ in range(15):  # the rest of a group of 16: the same prompt, no new render
        again = r.plan(TraceGraph(), messages, None, True)
        assert again.prompt_ids == first.prompt_ids and again.new == first.new
    assert len(calls) == num_renders == 3  # the system message, both messages, then with the generation prompt
    assert first.prompt_ids == models.render_prompt(tok, messages)
    r.plan(TraceGraph(), [msg("system", "Reverse the text."), msg("user", "abd")], None, True)
    assert len(calls) == num_renders + 2  # the system message's render is shared


async def test_in_process_requests_get_what_http_requests_get(tok: Any) -> None:
    import httpx
    from fastapi import FastAPI

    from flywheel_inference import interception

    policy = ScriptedPolicy(tok, ["cba", "cba", "cba", "xyz", "xyz"])
    registry = Interception()
    app = FastAPI()
    interception.install(app)
    app.state.interception = registry

    async def publish(nodes: list[events.TraceNode]) -> None:
        pass

    keys = [registry.open("r1", f"ro{i}", policy, events.Sampling(max_tokens=16), publish).key for i in range(3)]
    chat = {"model": "m", "messages": [{"role": "user", "content": "abc"}]}
    bodies = []
    transport = interception.InProcessTransport(app, registry)
    async with (httpx.AsyncClient(transport=transport) as direct,
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as over_http):
        for client, key in ((direct, keys[0]), (over_http, keys[1])):
            response = await client.post(f"http://x/intercept/{key}/v1/chat/completions", json=chat)
            assert response.status_code == 200 and response.headers["content-type"] == "application/json"
            body = response.json()
            bodies.append({k: v for k, v in body.items() if k not in ("id", "created")})
        # A harness's chat through the transport's post: no HTTP client, the same answer.
        ctx = RolloutContext(task={}, base_url=f"http://x/intercept/{keys[2]}/v1", api_key=keys[2], model="m",
                             post=transport.post)
        body = await ctx.chat(messages=chat["messages"])
        bodies.append({k: v for k, v in body.items() if k not in ("id", "created")})
        assert bodies[0] == bodies[1] == bodies[2] and bodies[0]["choices"][0]["message"]["content"] == "cba"
        assert policy.prompts[0] == policy.prompts[1] == policy.prompts[2]
        # Its refusals are the endpoint's, as over HTTP: an unknown key (OpenAI's error), a refused body (422).
        with pytest.raises(ModelCallError, match="answered 401: unknown rollout key"):
            await dataclasses.replace(ctx, base_url="http://x/intercept/nope/v1").chat(messages=chat["messages"])
        status, refused = await transport.post(f"http://x/intercept/{keys[2]}/v1/chat/completions", b'{"messages": []}')
        assert status == 422 and json.loads(refused)["detail"][0]["loc"] == ["body", "messages"]
        for client in (direct, over_http):
            # An unknown key: OpenAI's error shape; a body the request model refuses: FastAPI's 422.
            gone = await client.post("http://x/intercept/nope/v1/chat/completions", json=chat)
            assert gone.status_code == 401 and gone.json()["error"]["code"] == "invalid_rollout_key"
            bad = await client.post(f"http://x/intercept/{keys[0]}/v1/chat/completions", json={"messages": []})
            assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "messages"]
            # Streaming goes through the app, as over HTTP.
            streamed = await client.post(f"http://x/intercept/{keys[0]}/v1/chat/completions",
                                         json=chat | {"stream": True})
            assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
            chunks = [json.loads(e.removeprefix("data: ")) for e in streamed.text.split("\n\n")[:-2]]
            deltas = [c["choices"][0]["delta"].get("content") for c in chunks]
            assert "".join(d or "" for d in deltas) == "xyz" and len([d for d in deltas if d]) == 3  # a chunk a token
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
