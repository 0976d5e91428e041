"""``flywheel eval`` against a scripted OpenAI-compatible upstream (a small FastAPI app in this
test, served by uvicorn in this event loop): the recording proxy (plain and streamed answers,
tool calls, retries of transient failures, errors passed through), and a whole eval (JSONL,
summary, pass@k, group rewards, errors recorded on their rollout, ``resume``).

The eval against the real inference service is in tests/integration/test_eval_inference.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypeVar

import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from openai.types.chat import (
    ChatCompletionAssistantMessageParam,
    ChatCompletionMessageFunctionToolCallParam,
    ChatCompletionMessageParam,
    ChatCompletionToolUnionParam,
)

from flywheel.contract import events
from flywheel.ops.eval import format_summary
from flywheel.runtime.envworker import environment_info
from flywheel.runtime.evalproxy import RecordingProxy, eval_sampling, impose_sampling
from flywheel.runtime.evalresults import pass_at_k, read_results
from flywheel.runtime.evaluation import EvalConfig
from flywheel.runtime.serving import Served, serve
from flywheel.sdk.environment import Environment, EnvironmentOverrides, TaskSet, shortest_correct_reward
from flywheel.sdk.harness import ChatHarness, RolloutContext
from tests.inprocess import evaluated

TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
LOGPROBS = {"content": [{"token": "5", "logprob": -0.25, "bytes": None, "top_logprobs": []}]}


class Upstream:
    """A scripted model: calls the ``add`` tool when it may, then answers with the tool's result;
    without tools it answers the user's text reversed, except for texts starting with 'x'. The
    first ``num_failures`` calls answer 503."""

    def __init__(self, num_failures: int = 0) -> None:
        self.num_failures = num_failures
        self.requests: list[dict[str, Any]] = []
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self.chat)

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        last = body["messages"][-1]
        if body.get("tools") and last["role"] == "user":
            return {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}
        if last["role"] == "tool":
            return {"role": "assistant", "content": f"the sum is {last['content']}"}
        text = last["content"]
        return {"role": "assistant", "content": "nope" if text.startswith("x") else text[::-1]}

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        if self.num_failures > 0:
            self.num_failures -= 1
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        if body["messages"][-1].get("content") == "bad request":
            return JSONResponse({"error": {"message": "no such thing", "type": "invalid_request_error"}},
                                status_code=400)
        message = self.answer(body)
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
        if not body.get("stream"):
            return JSONResponse({"id": "c1", "object": "chat.completion", "created": 0, "model": body["model"],
                                 "choices": [{"index": 0, "message": message, "finish_reason": finish,
                                              "logprobs": LOGPROBS}], "usage": usage})
        return StreamingResponse(self.chunks(body["model"], message, finish, usage), media_type="text/event-stream")

    async def chunks(self, model: str, message: dict[str, Any], finish: str, usage: dict[str, int]
                     ) -> AsyncIterator[bytes]:
        def chunk(delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> bytes:
            body = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}], **extra}
            return f"data: {json.dumps(body)}\n\n".encode()

        yield chunk({"role": "assistant", "content": ""})
        for call in message.get("tool_calls") or []:
            args = call["function"]["arguments"]
            yield chunk({"tool_calls": [{"index": 0, "id": call["id"], "type": "function",
                                         "function": {"name": call["function"]["name"], "arguments": args[:5]}}]})
            yield chunk({"tool_calls": [{"index": 0, "function": {"arguments": args[5:]}}]})
        content = message.get("content") or ""
        for i in range(0, len(content), 4):
            yield chunk({"content": content[i:i + 4]})
        yield chunk({}, finish)
        last = {"id": "c1", "object": "chat.completion.chunk", "choices": [], "usage": usage}
        yield f"data: {json.dumps(last)}\n\n".encode()
        yield b"data: [DONE]\n\n"


U = TypeVar("U", bound=Upstream)


async def serving(scripted: U) -> AsyncIterator[tuple[U, Served]]:
    """A scripted upstream served on a free port for a fixture's life."""
    served = await serve(scripted.app)
    try:
        yield scripted, served
    finally:
        await served.stop()


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[Upstream, Served]]:
    async for pair in serving(Upstream()):
        yield pair


@pytest.fixture
async def proxy(upstream: tuple[Upstream, Served]) -> AsyncIterator[RecordingProxy]:
    p = RecordingProxy(upstream[1].url + "/v1", "secret", backoff_s=0.01)
    served = await serve(p.app())
    p.url = served.url
    try:
        yield p
    finally:
        await served.stop()
        await p.close()


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def tool_env() -> Environment:
    return Environment(name="adder", tasks=[{"prompt": "what is 2 + 3?"}],
                       rewards=[shortest_correct_reward(lambda c, t: "5" in c)],
                       harness=ChatHarness(system_prompt="Use the tool.", tools=[add], max_turns=4))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
async def test_the_proxy_records_a_tool_loop_as_one_branch(proxy: RecordingProxy, upstream: tuple[Upstream, Served],
                                                           stream: bool) -> None:
    env = tool_env()
    ctx = RolloutContext(task={"prompt": "what is 2 + 3?"}, base_url=proxy.base_url("ro1"), api_key="harness-key",
                         model="m")
    if stream:
        await StreamingHarness(system_prompt="Use the tool.", tools=[add], max_turns=4).run(env, ctx)
    else:
        assert env.harness is not None
        await env.harness.run(env, ctx)
    await ctx.close()
    recording = proxy.take("ro1")
    assert recording.graph.last is not None
    branch = recording.graph.branch(recording.graph.last.id)
    assert [(n.message.role, n.message.content) for n in branch] == [
        ("system", "Use the tool."), ("user", "what is 2 + 3?"), ("assistant", ""), ("tool", "5"),
        ("assistant", "the sum is 5")]
    assert branch[2].message.tool_calls == [events.ToolCall(id="call_1", name="add", arguments='{"a": 2, "b": 3}')]
    assert len(recording.graph.nodes) == 5  # the second request's history matched the first: one chain
    assert recording.tokens() == {"prompt_tokens": 14, "completion_tokens": 6}
    assert [c["finish_reasons"] for c in recording.calls] == [["tool_calls"], ["stop"]]
    assert recording.calls[0]["logprobs"] == ([] if stream else [LOGPROBS])
    assert ctx.state["stop_reason"] == "done" and ctx.state["turns"] == 2
    assert all(r["model"] == "m" for r in upstream[0].requests)


class StreamingHarness(ChatHarness):
    """The chat loop with ``stream=True``, assembled from the chunks by the openai SDK."""

    async def run(self, env: Environment, ctx: RolloutContext) -> None:
        assert self.system_prompt is not None
        messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": self.system_prompt},
                                                      {"role": "user", "content": ctx.task["prompt"]}]
        tools: list[ChatCompletionToolUnionParam] = [
            {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
        for turn in range(1, self.max_turns + 1):
            ctx.state["turns"] = turn
            stream = await ctx.client().chat.completions.create(model=ctx.model, messages=messages, tools=tools,
                                                                 stream=True)
            content = ""
            calls: dict[int, ChatCompletionMessageFunctionToolCallParam] = {}
            async for chunk in stream:
                for choice in chunk.choices:
                    content += choice.delta.content or ""
                    for call in choice.delta.tool_calls or []:
                        entry = calls.setdefault(call.index, {"id": "", "type": "function",
                                                              "function": {"name": "", "arguments": ""}})
                        entry["id"] = call.id or entry["id"]
                        assert call.function is not None
                        entry["function"]["name"] += call.function.name or ""
                        entry["function"]["arguments"] += call.function.arguments or ""
            reply: ChatCompletionAssistantMessageParam = {"role": "assistant", "content": content}
            if calls:
                reply["tool_calls"] = list(calls.values())
            messages.append(reply)
            if not calls:
                ctx.state["stop_reason"] = "done"
                return
            for call_param in calls.values():
                args = json.loads(call_param["function"]["arguments"])
                messages.append({"role": "tool", "tool_call_id": call_param["id"], "content": str(add(**args))})


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
async def test_the_proxy_records_responses_and_messages_agents_as_chat_calls(
        proxy: RecordingProxy, upstream: tuple[Upstream, Served], stream: bool) -> None:
    """Agents on the Responses API (stateful) and the Messages API through the proxy: each call
    goes upstream as a chat completion and is recorded as one; the tool loop is one branch."""
    import anthropic
    import httpx2

    ai = openai.AsyncOpenAI(base_url=proxy.base_url("resp"), api_key="harness-key", max_retries=0)
    tools: list[Any] = [{"type": "function", "name": "add", "parameters": {"type": "object"}}]
    first = await ai.responses.create(model="m", instructions="Use the tool.", input="what is 2 + 3?", tools=tools)
    (call,) = first.output
    assert call.type == "function_call" and call.call_id == "call_1"
    follow: dict[str, Any] = {
        "model": "m", "instructions": "Use the tool.", "previous_response_id": first.id, "tools": tools,
        "input": [{"type": "function_call_output", "call_id": "call_1", "output": "5"}]}
    if stream:
        text = "".join([e.delta async for e in await ai.responses.create(**follow, stream=True)
                        if e.type == "response.output_text.delta"])
    else:
        text = (await ai.responses.create(**follow)).output_text
    assert text == "the sum is 5"

    async with httpx2.AsyncClient() as http:
        claude = anthropic.AsyncAnthropic(base_url=proxy.base_url("msg").removesuffix("/v1"), api_key="harness-key",
                                          http_client=http, max_retries=0)
        schema: list[Any] = [{"name": "add", "input_schema": {"type": "object"}}]
        messages: list[Any] = [{"role": "user", "content": "what is 2 + 3?"}]
        reply = await claude.messages.create(model="m", max_tokens=16, system="Use the tool.", messages=messages,
                                             tools=schema)
        (use,) = reply.content
        assert use.type == "tool_use" and use.input == {"a": 2, "b": 3} and reply.stop_reason == "tool_use"
        messages += [{"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]
        final: Any
        if stream:
            async with claude.messages.stream(model="m", max_tokens=16, system="Use the tool.", messages=messages,
                                              tools=schema) as events_stream:
                pieces = [t async for t in events_stream.text_stream]
                final = await events_stream.get_final_message()
            assert len(pieces) > 1  # relayed as the upstream streamed it
        else:
            final = await claude.messages.create(model="m", max_tokens=16, system="Use the tool.", messages=messages,
                                                 tools=schema)
        assert final.content[0].type == "text" and final.content[0].text == "the sum is 5"
        assert final.usage.input_tokens == 7 and final.usage.output_tokens == 3

    for key in ("resp", "msg"):
        recording = proxy.take(key)
        assert recording.graph.last is not None
        branch = recording.graph.branch(recording.graph.last.id)
        assert [(n.message.role, n.message.content) for n in branch] == [
            ("system", "Use the tool."), ("user", "what is 2 + 3?"), ("assistant", ""), ("tool", "5"),
            ("assistant", "the sum is 5")], key
        assert len(recording.graph.nodes) == 5 and recording.tokens() == {"prompt_tokens": 14, "completion_tokens": 6}
    assert all(r["model"] == "m" and r["max_tokens"] <= 16 for r in upstream[0].requests[2:])


async def test_malformed_responses_and_messages_requests_get_their_apis_errors_at_the_proxy(
        proxy: RecordingProxy) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=proxy.url) as http:
        bad = await http.post("/r/k/v1/responses", json={"model": "m", "input": "hi", "previous_response_id": "x"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "previous_response_not_found"
        bad = await http.post("/r/k/v1/messages", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert bad.status_code == 400 and bad.json() == {"type": "error", "error": {
            "type": "invalid_request_error", "message": "max_tokens: Field required"}}
        upstream_refused = await http.post("/r/k/v1/messages", json={
            "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "bad request"}]})
        assert upstream_refused.status_code == 400
        assert upstream_refused.json()["error"] == {"type": "invalid_request_error",
                                                    "message": "upstream: no such thing"}


async def test_transient_failures_are_retried_and_errors_pass_through(proxy: RecordingProxy,
                                                                      upstream: tuple[Upstream, Served]) -> None:
    upstream[0].num_failures = 2
    client = openai.AsyncOpenAI(base_url=proxy.base_url("ro2"), api_key="k", max_retries=0)
    try:
        reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "abc"}])
        assert reply.choices[0].message.content == "cba" and proxy.num_retries == 2
        with pytest.raises(openai.BadRequestError, match="no such thing"):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "bad request"}])
        assert proxy.num_retries == 2  # a 400 is the caller's mistake: not retried
        upstream[0].num_failures = 10
        with pytest.raises(openai.InternalServerError):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "abc"}])
        assert proxy.num_retries == 2 + proxy.max_retries
    finally:
        await client.close()


def test_pass_at_k() -> None:
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 1, 2) == 0.5 and pass_at_k(4, 3, 2) == 1.0


def reversed_right(completion: str, task: dict) -> float:
    return float(completion == task["text"][::-1])


def fails_on_q(task: dict) -> float:
    if task["text"] == "q":
        raise RuntimeError("cannot score q")
    return 1.0


def text_env() -> Environment:
    rows = [{"text": t} for t in ("abc", "xyz", "q", "hello")]
    return Environment(name="texts", tasks=TaskSet.from_rows(rows, schema={"text": str}),
                       prompt=lambda task: task["text"],
                       rewards=[reversed_right, shortest_correct_reward(lambda c, t: c == t["text"][::-1], weight=0.5),
                                fails_on_q])


async def test_an_eval_writes_results_summarizes_and_resumes(upstream: tuple[Upstream, Served],
                                                             tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    cfg = EvalConfig(env="texts", model="m", base_url=upstream[1].url + "/v1", out=out, num_tasks=4,
                     num_rollouts=2, concurrency=3, pass_threshold=2.0)
    progress = tmp_path / "progress.txt"
    with progress.open("w") as p:
        summary = await evaluated(cfg, text_env(), p)
    records = read_results(out)
    assert len(records) == 8 and {(r["task_id"], r["index"]) for r in records} == {
        (r["task_id"], i) for r in records for i in (0, 1)}
    by_text = {r["task"]["text"]: r for r in records}
    assert by_text["abc"]["rewards"] == {"reversed_right": 1.0, "shortest_correct": 1.0, "fails_on_q": 1.0}
    assert by_text["abc"]["reward"] == 2.5 and by_text["xyz"]["reward"] == 1.0
    assert by_text["abc"]["messages"] == [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "cba"}]
    assert by_text["q"]["reward_errors"] == {"fails_on_q": "reward 'fails_on_q' failed: RuntimeError: cannot score q"}
    assert by_text["q"]["reward"] is None and by_text["abc"]["usage"] == {"prompt_tokens": 7, "completion_tokens": 3}
    assert (summary["num_tasks"], summary["num_rollouts"], summary["num_reward_errors"]) == (4, 8, 2)
    assert summary["pass@1"] == summary["pass@2"] == pytest.approx(2 / 4)  # abc and hello pass; q's reward failed
    assert summary["reward_mean"] == pytest.approx((2.5 * 4 + 1.0 * 2) / 6)
    assert summary["prompt_tokens"] == 56 and "8/8 rollouts" in progress.read_text()
    num_requests = len(upstream[0].requests)

    # A torn group (an eval killed mid-write) is run again; complete ones are not.
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:5]) + "\n" + lines[5][:20])
    resumed = await evaluated(EvalConfig(**{**cfg.__dict__, "resume": True}), text_env(), progress.open("w"))
    assert len(upstream[0].requests) == num_requests + 4  # two groups of two again
    assert len(read_results(out)) == 8 and resumed["pass@1"] == summary["pass@1"]
    again = await evaluated(EvalConfig(**{**cfg.__dict__, "resume": True}), text_env(), progress.open("w"))
    assert len(upstream[0].requests) == num_requests + 4 and again["num_rollouts"] == 8


async def test_eval_ids_are_made_as_training_makes_them_and_resume_continues_the_files_run(
        upstream: tuple[Upstream, Served], tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    cfg = EvalConfig(env="texts", model="m", base_url=upstream[1].url + "/v1", out=out, num_tasks=2, num_rollouts=2)
    progress = tmp_path / "progress.txt"
    await evaluated(cfg, text_env(), progress.open("w"))
    records = read_results(out)
    rows = text_env().load_tasks(2, seed=0)
    (run,) = {r["run"] for r in records}
    assert run.startswith("eval-texts-") and len(records) == 4
    for r in records:  # a task's position is its place in the task set, from 1, as a file's line is
        assert r["task_id"] == events.task_id(run, "texts", rows.index(r["task"]) + 1, r["task"])
        assert r["rollout_id"] == events.rollout_id(run, r["task_id"], r["index"])
    # --resume without --run-id goes on with the run the results file holds: nothing is asked again.
    num_requests = len(upstream[0].requests)
    await evaluated(EvalConfig(**{**cfg.__dict__, "resume": True}), text_env(), progress.open("w"))
    assert len(upstream[0].requests) == num_requests and read_results(out) == records
    with pytest.raises(ValueError, match=rf"run_id='other', but {out} holds the results of eval run {run!r}"):
        await evaluated(EvalConfig(**{**cfg.__dict__, "resume": True, "run_id": "other"}), text_env(),
                         progress.open("w"))
    assert read_results(out) == records  # refused before anything was rewritten


async def test_an_eval_sends_the_environments_sampling_with_the_flags_over_it_and_records_it(
        upstream: tuple[Upstream, Served], tmp_path: Path) -> None:
    # Without it, an endpoint samples with its own defaults (vLLM's server: up to the whole context),
    # and the same weights score differently there and on Flywheel's inference.
    env = text_env()
    env.sampling = {"temperature": 0.7, "max_tokens": 12, "stop": ["\n"]}
    out = tmp_path / "results.jsonl"
    cfg = EvalConfig(env="texts", model="m", base_url=upstream[1].url + "/v1", out=out, num_tasks=1, num_rollouts=2,
                     sampling={"temperature": 0.0, "seed": 5})
    summary = await evaluated(cfg, env, (tmp_path / "progress.txt").open("w"))
    sent = [{k: r.get(k) for k in ("temperature", "top_p", "max_tokens", "stop", "seed")} for r in upstream[0].requests]
    assert sorted(sent, key=lambda r: int(r["seed"] or 0)) == [
        {"temperature": 0.0, "top_p": 1.0, "max_tokens": 12, "stop": ["\n"], "seed": 5 + i} for i in range(2)]
    assert sorted(r["sampling"]["seed"] for r in read_results(out)) == [5, 6]
    assert all(r["sampling"]["temperature"] == 0.0 and r["sampling"]["max_tokens"] == 12 for r in read_results(out))
    assert summary["sampling"] == {"temperature": 0.0, "top_p": 1.0, "max_tokens": 12, "stop": ["\n"], "seed": 5}
    assert "sampled with: temperature 0.0, top_p 1.0, max_tokens 12" in format_summary(summary)


async def test_with_endpoint_sampling_calls_go_as_the_harness_sent_them(upstream: tuple[Upstream, Served],
                                                                         tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    cfg = EvalConfig(env="texts", model="m", base_url=upstream[1].url + "/v1", out=out, num_tasks=1,
                     send_sampling=False)
    summary = await evaluated(cfg, text_env(), (tmp_path / "progress.txt").open("w"))
    assert not {"temperature", "top_p", "max_tokens", "seed"} & set(upstream[0].requests[-1])
    assert summary["sampling"] is None and read_results(out)[0]["sampling"] is None


def test_eval_sampling_names_what_is_out_of_bounds() -> None:
    env = text_env()
    with pytest.raises(ValueError, match=r"sampling\.top_p must be <= 1"):
        eval_sampling(environment_info(env), {"top_p": 2.0})
    with pytest.raises(ValueError, match=r"sampling\.temperature must be >= 0"):
        eval_sampling(environment_info(env), {"temperature": -1.0})
    env.sampling = {"temprature": 0.5}
    with pytest.raises(ValueError, match=r"environment 'texts': sampling has \['temprature'\]"):
        eval_sampling(environment_info(env), {})


def test_a_harness_may_lower_max_tokens_and_nothing_else() -> None:
    sampling = events.Sampling(temperature=0.5, max_tokens=64)
    assert impose_sampling({"messages": [], "temperature": 1.3, "max_tokens": 8}, sampling) == {
        "messages": [], "temperature": 0.5, "top_p": 1.0, "max_tokens": 8}
    assert impose_sampling({"max_completion_tokens": 500}, sampling)["max_completion_tokens"] == 64


async def test_a_harness_that_fails_is_recorded_on_its_rollout(tmp_path: Path) -> None:
    cfg = EvalConfig(env="texts", model="m", base_url="http://127.0.0.1:9/v1", out=tmp_path / "r.jsonl",
                     num_tasks=1, num_rollouts=2, max_retries=0)
    summary = await evaluated(cfg, text_env(), (tmp_path / "p.txt").open("w"))
    records = read_results(cfg.out)
    assert summary["num_errors"] == 2 and all(r["status"] == "error" for r in records)
    assert records[0]["error"] == ("harness failed: ModelCallError: the model endpoint answered 502: upstream "
                                   "http://127.0.0.1:9/v1 unreachable after 1 tries: ConnectError: All connection "
                                   "attempts failed")
    # Nothing was scored: no pass rate (errored rollouts are left out of every figure of the rewards).
    assert summary["pass@1"] is None and summary["num_scored"] == 0
    assert [(e["kind"], e["count"]) for e in summary["errors"] if e["where"] == "rollout"] == [
        ("harness failed: ModelCallError", 2)]


@pytest.mark.parametrize(("args", "message"), [
    (["--env-args", "[1]"], "--env-args '[1]': give a JSON object of keyword arguments"),
    (["--env-args", "{x"], "--env-args '{x': not JSON"),
    (["-n", "0"], "num_tasks=0: at least 1"),
    (["--model", "http://127.0.0.1:9/v1"], "--model http://127.0.0.1:9/v1: cannot reach it"),
])
def test_eval_mistakes_name_the_option(args: list[str], message: str, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from flywheel.ops.cli import main

    assert main(["eval", "reverse_text", "--model", "m", "--data-dir", str(tmp_path), *args]) == 1
    assert message in capsys.readouterr().err


def test_an_environment_that_is_not_installed_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from flywheel.ops.cli import main

    assert main(["eval", "nobody/nothing", "--model", "m", "--data-dir", str(tmp_path)]) == 1
    assert "environment 'nobody/nothing' is not installed" in capsys.readouterr().err


async def test_a_multi_turn_environment_runs_unchanged_in_an_eval(tmp_path: Path) -> None:
    """wordle, as training runs it: the game answers each guess, the board lives in the state."""
    from flywheel.sdk.environment import load_environment
    from tests.scripted_openai import ScriptedOpenAI

    env = load_environment("wordle", EnvironmentOverrides(args={"max_guesses": 2}))
    with ScriptedOpenAI({"m": ["<guess>crane</guess>"] * 8}) as server:
        cfg = EvalConfig(env="flywheel/wordle", model="m", base_url=server.base_url, out=tmp_path / "r.jsonl",
                         num_tasks=2, num_rollouts=2)
        summary = await evaluated(cfg, env, (tmp_path / "p.txt").open("w"))
        assert server.remaining("m") == 0  # two guesses in each of four rollouts
    records = read_results(cfg.out)
    assert summary["num_rollouts"] == 4 and summary["num_errors"] == 0
    for r in records:
        assert r["state"]["guesses"] == ["crane", "crane"] and r["state"]["stop_reason"] in ("done", "max_turns")
        roles = [m["role"] for m in r["messages"]]
        assert roles[:5] == ["system", "user", "assistant", "user", "assistant"]
        assert r["rewards"]["num_guesses"] == 2.0 and r["rewards"]["valid_guesses"] == 1.0 and len(r["calls"]) == 2


class Modes(ChatHarness):
    """One chat turn (none for "silent"), then what the row's text says: hang, or leave a
    board in the state that is not JSON."""

    async def run(self, env: Environment, ctx: RolloutContext) -> None:
        if ctx.task["text"] != "silent":
            await super().run(env, ctx)
        if ctx.task["text"] == "hang":
            await asyncio.Event().wait()
        if ctx.task["text"] == "board":
            ctx.state["board"] = object()


async def waits_on_slow(task: dict) -> float:
    if task["text"] == "slow":
        await asyncio.Event().wait()
    return 1.0


async def test_an_eval_ends_rollouts_and_rewards_by_the_rules_of_training(upstream: tuple[Upstream, Served],
                                                                          tmp_path: Path) -> None:
    """The rollout timeout, no model call, state that is not JSON (refused, not stringified) and
    the reward timeout, as inference and the scorer apply them (flywheel.sdk.rollout, .scoring)."""
    env = Environment(name="modes", tasks=[{"text": t} for t in ("ok", "hang", "board", "silent", "slow")],
                      prompt=lambda task: task["text"], harness=Modes(max_turns=1), rewards=[waits_on_slow])
    cfg = EvalConfig(env="modes", model="m", base_url=upstream[1].url + "/v1", out=tmp_path / "r.jsonl", num_tasks=5,
                     rollout_timeout_s=0.5, reward_timeout_s=0.5)
    summary = await evaluated(cfg, env, (tmp_path / "p.txt").open("w"))
    by_text = {r["task"]["text"]: r for r in read_results(cfg.out)}
    assert {t: (r["status"], r["error"]) for t, r in by_text.items()} == {
        "ok": ("completed", None), "slow": ("completed", None),
        "hang": ("error", "the harness ran past rollout_timeout_s=0.5"),
        "board": ("error", "the harness's state is not JSON: Encoding objects of type object is unsupported"),
        "silent": ("error", "the harness made no model call"),
    }
    assert by_text["board"]["state"] == {} and by_text["ok"]["reward"] == 1.0
    assert by_text["slow"]["reward_errors"] == {"waits_on_slow": "reward 'waits_on_slow' timed out after 0.5s"}
    assert [by_text[t]["reward"] for t in ("slow", "hang", "board", "silent")] == [None] * 4
    assert (summary["num_errors"], summary["num_reward_errors"]) == (3, 1)
