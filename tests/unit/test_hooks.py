"""An environment's hooks on the interception endpoint: a request hook rewrites what the model
sees (and the trace records what it saw, tokens exact), blocks a call (the harness gets the
error, nothing is sampled) or flags it; a response hook flags an answer; the rollout's metrics
count the flags and the watch turns them into a `watch` score."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from flywheel.contract import events
from flywheel.sdk.environment import Environment
from flywheel.sdk.hooks import Block, CallHooks, Flag, hook_flags
from flywheel_inference.interception import InterceptionError
from flywheel_scorer.watch import Watch
from tests.inprocess import AsyncHooks, InProcessPool
from tests.unit.test_inference_interception import ScriptedPolicy, assert_exact, msg, session_for


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def redact(messages: list[events.Message], task: dict[str, Any]) -> list[events.Message] | Block | Flag | None:
    if any(task["secret"] in m.content for m in messages):
        return [events.Message(role=m.role, content=m.content.replace(task["secret"], "[redacted]"),
                               tool_calls=m.tool_calls, tool_call_id=m.tool_call_id) for m in messages]
    return None


def no_shell(messages: list[events.Message], task: dict[str, Any]) -> Block | None:
    return Block("rm -rf is not allowed here") if "rm -rf" in messages[-1].content else None


def says_magic(messages: list[events.Message], answer: events.Message, task: dict[str, Any]) -> Flag | None:
    return Flag("the answer says MAGIC") if "MAGIC" in answer.content else None


def answered(completion: str) -> float:
    return float(bool(completion))


def env() -> Environment:
    return Environment(name="hooked", tasks=[{"prompt": "x", "secret": "hunter2"}], rewards=[answered],
                       request_hooks=[redact, no_shell], response_hooks=[says_magic])


async def test_a_request_hook_rewrites_what_the_model_sees_and_the_trace_is_what_it_saw(tok: Any) -> None:
    policy = ScriptedPolicy(tok, ["MAGIC", "fine"])
    session, _ = session_for(policy)
    session.hooks = AsyncHooks(env().call_hooks({"prompt": "x", "secret": "hunter2"}))
    answer, _, _ = await session.chat([msg("user", "my password is hunter2")], None, None)
    assert "hunter2" not in tok.decode(policy.prompts[0]) and "[redacted]" in tok.decode(policy.prompts[0])
    (user,) = [n for n in session.graph.nodes.values() if n.message.role == "user"]
    assert user.message.content == "my password is [redacted]"
    assert session.hooks.metrics() == {"flags.says_magic": 1.0}
    # The harness sends its own history again (with the secret): the hook redacts it the same way,
    # so the next turn extends the first's tokens.
    await session.chat([msg("user", "my password is hunter2"), answer.message, msg("user", "ok")], None, None)
    assert session.num_rerenders == 0 and session.hooks.metrics() == {"flags.says_magic": 1.0}
    assert_exact(session.graph, policy)


async def test_a_blocked_call_is_refused_naming_the_hook_and_nothing_is_sampled(tok: Any) -> None:
    policy = ScriptedPolicy(tok, ["unused"])
    session, _ = session_for(policy)
    session.hooks = AsyncHooks(env().call_hooks({"prompt": "x", "secret": "s3"}))
    with pytest.raises(InterceptionError) as refused:
        await session.chat([msg("user", "please rm -rf /")], None, None)
    assert refused.value.status == 400 and refused.value.code == "blocked_by_environment"
    assert "'no_shell'" in refused.value.message and "rm -rf is not allowed" in refused.value.message
    assert policy.prompts == [] and session.num_calls == 0


async def test_a_hook_that_returns_nonsense_is_an_error_naming_it(tok: Any) -> None:
    session, _ = session_for(ScriptedPolicy(tok, ["unused"]))
    session.hooks = AsyncHooks(CallHooks([lambda messages, task: 42], (), {}))  # type: ignore[list-item, return-value]
    with pytest.raises(InterceptionError, match="hook failed: TypeError: request hook '<lambda>' returned a int"):
        await session.chat([msg("user", "hi")], None, None)


def test_the_watch_turns_a_rollouts_hook_flags_into_its_watch_score() -> None:
    rollout = events.Rollout(run="r1", env="hooked", task_id="t", task_data={}, group_id="g", nodes=[],
                             metrics={"flags.says_magic": 2.0, "num_calls": 3.0})
    assert hook_flags(rollout.metrics) == ["says_magic"]
    assert Watch().see(rollout, "", []) == {}  # the detectors alone see nothing here


async def test_the_scorer_publishes_a_hook_flag_as_a_watch_score() -> None:
    from tests.unit.test_scorer_rewards import Rewards, rollout, scorer

    pool = InProcessPool()
    try:
        scoring = scorer(pool, Rewards(exact=lambda completion: 1.0))
        scoring.watch = Watch()
        plain = rollout("ro1")
        flagged = events.Rollout(**{f: getattr(plain, f) for f in plain.__struct_fields__ if f != "metrics"},
                                 metrics={"flags.says_magic": 1.0})
        (flag,) = scoring._watched(flagged, await scoring.score(flagged))
    finally:
        await pool.close()
    assert flag.scorer == events.WATCH_SCORER and flag.components == {"hook:says_magic": 1.0}


async def test_the_eval_proxy_runs_the_same_hooks(tmp_path: Path) -> None:
    import httpx

    from flywheel.runtime.evalproxy import RecordingProxy
    from flywheel.runtime.serving import serve
    from tests.unit.test_eval import Upstream, serving

    async for scripted, served in serving(Upstream()):
        proxy = RecordingProxy(served.url + "/v1", "secret", backoff_s=0.01)
        listening = await serve(proxy.app())
        proxy.url = listening.url
        try:
            recording = proxy.open("ro1", hooks=AsyncHooks(env().call_hooks({"prompt": "x", "secret": "hunter2"})))
            async with httpx.AsyncClient(base_url=proxy.url) as http:
                ok = await http.post("/r/ro1/v1/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": "hunter2 abc"}]})
                assert ok.status_code == 200
                assert scripted.requests[-1]["messages"][0]["content"] == "[redacted] abc"  # upstream never saw it
                blocked = await http.post("/r/ro1/v1/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": "rm -rf /"}]})
                assert blocked.status_code == 400 and blocked.json()["error"]["code"] == "blocked_by_environment"
                messages = await http.post("/r/ro1/v1/messages", json={
                    "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "rm -rf /"}]})
                assert messages.status_code == 400 and messages.json()["error"]["type"] == "invalid_request_error"
                assert "'no_shell'" in messages.json()["error"]["message"]
            assert len(scripted.requests) == 1 and recording.num_calls == 1
        finally:
            await listening.stop()
            await proxy.close()
