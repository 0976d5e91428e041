"""A scripted OpenAI-compatible chat server for tests: a fake model that answers from a script.

Tests of harnesses and environments need a model that says exactly what the test wants, tool
calls included, behind a real HTTP endpoint (the harness talks only to a base URL). Each
model name has its own script, so one server can play both the agent and a user simulator::

    with ScriptedOpenAI({"agent": ["<guess>crane</guess>", tool_call("search", query="x")],
                         "user": ["My order is #W1.", STOP]}) as server:
        ctx = RolloutContext(task=row, base_url=server.base_url, api_key="test", model="agent")
        await env.harness.run(env, ctx)
        messages = server.conversation("agent")   # what the agent saw, plus its last reply

A script entry is a string (the reply's content), an assistant message dict (``content``,
``tool_calls``; an optional ``finish_reason`` such as ``"length"``), or a function of the
request body returning either. A request past the end of a script gets HTTP 400 naming the
model, so a harness that asks more than the test expected fails loudly. Every request body is
kept in :attr:`ScriptedOpenAI.requests`. ``stream: true`` is answered with server-sent
events in the standard chunk form.

The server runs uvicorn in a thread on a free port, so it serves sync and async tests alike.
:func:`run_rollout` runs an environment's harness against it and returns the rollout rewards
see; :func:`make_rollout` builds one from hand-written messages.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

if TYPE_CHECKING:
    from flywheel.contract import events
    from flywheel.sdk.environment import Environment

ScriptEntry = str | Mapping[str, Any] | Callable[[dict[str, Any]], str | Mapping[str, Any]]


def tool_call(name: str, call_id: str | None = None, **arguments: Any) -> dict[str, Any]:
    """An assistant message that calls one tool (arguments as keywords)."""
    return tool_calls((name, arguments, call_id))


def tool_calls(*calls: tuple[str, Mapping[str, Any]] | tuple[str, Mapping[str, Any], str | None]) -> dict[str, Any]:
    """An assistant message that calls several tools: ``(name, arguments[, id])`` each."""
    out = []
    for i, call in enumerate(calls):
        name, arguments = call[0], call[1]
        call_id = call[2] if len(call) > 2 and call[2] else f"call_{uuid.uuid4().hex[:8]}_{i}"
        out.append({"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": json.dumps(dict(arguments))}})
    return {"content": "", "tool_calls": out}


class ScriptedOpenAI:
    """``POST /v1/chat/completions`` answered from per-model scripts; a context manager."""

    def __init__(self, scripts: Mapping[str, Sequence[ScriptEntry]]) -> None:
        self.scripts = {model: list(entries) for model, entries in scripts.items()}
        self.requests: list[dict[str, Any]] = []
        self._next: dict[str, int] = {}
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def requests_for(self, model: str) -> list[dict[str, Any]]:
        return [r for r in self.requests if r.get("model") == model]

    def remaining(self, model: str) -> int:
        """Script entries not yet used for ``model``."""
        return len(self.scripts.get(model, [])) - self._next.get(model, 0)

    def conversation(self, model: str) -> list[dict[str, Any]]:
        """The messages of ``model``'s last request followed by the reply it got: the
        conversation as the model saw it (tool answers or feedback after that reply are not in it)."""
        asked = self.requests_for(model)
        if not asked:
            raise AssertionError(f"model {model!r} was never asked")
        return [*asked[-1]["messages"], asked[-1]["_reply"]]

    # --- serving ---------------------------------------------------------------------------

    def _reply(self, body: dict[str, Any]) -> dict[str, Any] | None:
        model = body.get("model", "")
        with self._lock:
            n = self._next.get(model, 0)
            script = self.scripts.get(model, [])
            if n >= len(script):
                return None
            self._next[model] = n + 1
        entry = script[n]
        if callable(entry):
            entry = entry(body)
        message = {"role": "assistant", "content": entry} if isinstance(entry, str) else {"role": "assistant",
                                                                                         **dict(entry)}
        finish = message.pop("finish_reason", None) or ("tool_calls" if message.get("tool_calls") else "stop")
        message.setdefault("content", "")
        body["_reply"] = message
        with self._lock:
            self.requests.append(body)
        return {"message": message, "finish_reason": finish}

    def _app(self) -> Any:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            body = await request.json()
            answer = self._reply(body)
            if answer is None:
                return JSONResponse(status_code=400, content={"error": {
                    "message": f"scripted server: no reply left in the script of model {body.get('model')!r}",
                    "type": "invalid_request_error"}})
            completion_id = f"chatcmpl-{uuid.uuid4().hex[:12]}"
            prompt_words = sum(len(str(m.get("content") or "").split()) for m in body.get("messages", []))
            reply_words = len(str(answer["message"]["content"]).split())
            common = {"id": completion_id, "created": int(time.time()), "model": body.get("model", "")}
            if body.get("stream"):
                return StreamingResponse(_chunks(common, answer), media_type="text/event-stream")
            return {**common, "object": "chat.completion",
                    "choices": [{"index": 0, "message": answer["message"], "finish_reason": answer["finish_reason"]}],
                    "usage": {"prompt_tokens": prompt_words, "completion_tokens": reply_words,
                              "total_tokens": prompt_words + reply_words}}

        return app

    def __enter__(self) -> ScriptedOpenAI:
        import socket

        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(self._app(), host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="scripted-openai", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"scripted OpenAI server did not start on port {self.port}")
            time.sleep(0.01)  # noqa: sleep - bounded wait for the server thread
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        assert self._thread is not None
        self._thread.join(timeout=10)


def _chunks(common: dict[str, Any], answer: dict[str, Any]) -> Any:
    message = answer["message"]
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content", "")}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
    for choice in ({"index": 0, "delta": delta, "finish_reason": None},
                   {"index": 0, "delta": {}, "finish_reason": answer["finish_reason"]}):
        yield f"data: {json.dumps({**common, 'object': 'chat.completion.chunk', 'choices': [choice]})}\n\n"
    yield "data: [DONE]\n\n"


def make_rollout(env: str, task: dict[str, Any], messages: Sequence[Mapping[str, Any]],
                 state: dict[str, Any] | None = None, index: int = 0) -> events.Rollout:
    """A message-only rollout of ``task`` whose one branch is ``messages`` (OpenAI dicts)."""
    from flywheel.sdk.messages import message_from_dict
    from flywheel.sdk.tracegraph import rollout_from_messages

    return rollout_from_messages(run="test", env=env, task_id=str(task.get("id", "task")), task_data=task,
                                 messages=[message_from_dict(m, f"messages[{i}]") for i, m in enumerate(messages)],
                                 state=state, index=index)


async def run_rollout(env: Environment, task: dict[str, Any], server: ScriptedOpenAI, model: str = "agent",
                      index: int = 0) -> events.Rollout:
    """Run ``env``'s harness on ``task`` against ``server`` as ``model``; the rollout of the
    conversation the model saw, with the state the harness recorded."""
    from flywheel.sdk.harness import RolloutContext

    ctx = RolloutContext(task=task, base_url=server.base_url, api_key="test", model=model, index=index)
    try:
        assert env.harness is not None
        await env.harness.run(env, ctx)
    finally:
        await ctx.close()
    return make_rollout(env.name, task, server.conversation(model), ctx.state, index)
