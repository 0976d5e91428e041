"""Harnesses: how the model acts in an environment, through nothing but the OpenAI chat API.

A harness gets a :class:`RolloutContext` with a per-rollout OpenAI-compatible ``base_url`` and
``api_key``, and talks to the model only through them. In training the URL is the inference
service's interception endpoint, which applies the run's sampling settings, forces logprobs and
records every call into the rollout's trace graph; in ``flywheel eval`` it is a recording proxy
in front of whatever endpoint is evaluated. The harness cannot tell the two apart, which is the
point: the same harness runs in evaluation, in training and in deployment.

- :class:`ChatHarness` (the default): an optional system prompt, the environment's first
  messages, then a loop of model turns: tool calls are executed and answered (tools are Python
  functions or MCP servers), an ``env_response`` (e.g. a game's feedback) or a user simulator
  may answer a plain reply, until a stop condition, ``max_turns`` or a truncated answer.
- :class:`ProgramHarness`: any program that speaks the OpenAI chat, Responses or Anthropic
  Messages API (written with the ``openai`` or ``anthropic`` SDK, a CLI agent) runs unchanged,
  pointed at its base URL by the standard ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` variables,
  the task as JSON on stdin: as a subprocess, or inside the rollout's sandbox, where that URL is
  the only thing it reaches (its ``runtime``).
- :class:`UserSimulator`: a model behind an MCP server that plays the user.

What the harness records in ``ctx.state`` (a JSON object) travels with the rollout and reaches
rewards as ``state``: a game's final board, a database's final contents. Inference and
``flywheel eval`` both run a harness through :func:`flywheel.sdk.rollout.run_harness`, so the
rollout timeout, what an error is and the state's check are the same in both.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import signal
import sys
import tempfile
import typing
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from flywheel.contract import events
from flywheel.sdk import egress
from flywheel.sdk.messages import message_dict, message_from_dict
from flywheel.sdk.sandbox import MODEL_BASE_URL, SandboxSpec, sandbox_session

if TYPE_CHECKING:
    import openai
    from openai.types.chat import ChatCompletionMessageParam

    from flywheel.sdk.environment import Environment
    from flywheel.sdk.sandbox import SandboxClient

log = logging.getLogger(__name__)


@dataclass
class RolloutContext:
    """One rollout as a harness sees it. Whoever runs the harness closes it when the rollout ends;
    tools keep what they start for the rollout in ``resources`` and free it through :meth:`on_close`
    (a sandbox session of :mod:`flywheel.sdk.sandbox_tools`, over ``sandbox_client``)."""

    task: dict[str, Any]
    base_url: str  # OpenAI-compatible, this rollout's own
    api_key: str
    model: str
    index: int = 0  # place in the group
    state: dict[str, Any] = field(default_factory=dict)  # JSON; reaches rewards as `state`
    timeout_s: float = 600.0
    http_client: Any = None  # an httpx.AsyncClient to reach base_url through (e.g. in-process ASGI)
    # Where the endpoint lives in this process (inference's own harnesses): ``post(url, body)``
    # answers a POST of JSON bytes with (status, response bytes), the same bytes as over HTTP,
    # without an HTTP client's work per request. :meth:`chat` uses it; ``client()`` still goes
    # through ``http_client``.
    post: Callable[[str, bytes], Awaitable[tuple[int, bytes]]] | None = None
    rollout_id: str = ""
    run: str = ""  # the run it is a rollout of (inference, eval); its sandbox is metered to it
    # A flywheel.sdk.sandbox.SandboxClient where a sandbox service is reachable (flywheel.sdk.sandbox_tools uses it).
    sandbox_client: SandboxClient | None = None
    resources: dict[str, Any] = field(default_factory=dict)  # per-rollout objects of tools; not recorded
    _client: Any = None
    _owns_http_client: bool = False
    _on_close: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    def on_close(self, release: Callable[[], Awaitable[None]]) -> None:
        """Have :meth:`close` await ``release()`` when the rollout ends, however it ends (last
        registered first): how a tool frees what it started for the rollout (a sandbox session)."""
        self._on_close.append(release)

    def client(self) -> openai.AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` client for this rollout (one per context)."""
        if self._client is None:
            import openai

            self._client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, timeout=self.timeout_s,
                                              max_retries=0, http_client=self.http_client)
        return self._client

    async def chat(self, **body: Any) -> dict[str, Any]:
        """POST one chat-completion request (OpenAI body, e.g. ``messages=``, ``tools=``) to this
        rollout's endpoint; returns the response as a dict. The wire form only, no SDK: the chat
        harness calls this once a turn, and in training every rollout does, so it is kept light.
        A non-2xx answer raises :class:`ModelCallError` with the endpoint's message."""
        url = f"{self.base_url.rstrip('/')}/chat/completions"
        if self.post is not None:
            # The JSON httpx would send (its encoder's settings), so both paths refuse the same bodies.
            content = json.dumps({"model": self.model, **body}, ensure_ascii=False, separators=(",", ":"),
                                 allow_nan=False).encode()
            status, answer = await self.post(url, content)
        else:
            import httpx

            if self.http_client is None:
                self.http_client = httpx.AsyncClient(timeout=self.timeout_s)
                self._owns_http_client = True
            response = await self.http_client.post(url, json={"model": self.model, **body},
                                                   headers={"Authorization": f"Bearer {self.api_key}"},
                                                   timeout=self.timeout_s)
            status, answer = response.status_code, response.content
        if status >= 400:
            try:
                message = json.loads(answer)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = answer.decode(errors="replace")[:2000]
            raise ModelCallError(f"the model endpoint answered {status}: {message}")
        return json.loads(answer)

    async def close(self) -> None:
        """Release the rollout's resources (see :meth:`on_close`), then its model client. A release
        that fails is logged and the rest still run: the rollout itself is over by now."""
        while self._on_close:
            release = self._on_close.pop()
            try:
                await release()
            except Exception as exc:
                log.warning("rollout %s: releasing %s failed: %s: %s", self.rollout_id or "?",
                            getattr(release, "__qualname__", release), type(exc).__name__, exc)
        if self._client is not None and self.http_client is None:
            await self._client.close()
        if self._owns_http_client:
            await self.http_client.aclose()
            self.http_client, self._owns_http_client = None, False


class ModelCallError(RuntimeError):
    """The model endpoint refused a request (the message is the endpoint's)."""


class Harness(Protocol):
    def initial_messages(self, env: Environment, task: dict[str, Any]) -> list[events.Message]:
        """The messages of the rollout's first request (for single-turn views and SFT)."""
        ...

    async def run(self, env: Environment, ctx: RolloutContext) -> None:
        """Act in the environment through ``ctx``; raising records the error on the rollout."""
        ...


# --- tools --------------------------------------------------------------------------------


class ToolError(Exception):
    """A tool failed; its message goes back to the model as the tool's answer."""


@dataclass
class Tool:
    """A Python function (sync or async) offered to the model as a tool. Its parameters become
    the tool's JSON schema (from type hints; the docstring's first paragraph is the description),
    except ``ctx``, which receives the :class:`RolloutContext` (for ``ctx.state`` and ``ctx.task``)."""

    fn: Callable[..., Any]
    name: str = ""
    description: str = ""

    def __post_init__(self) -> None:
        import pydantic

        self.name = self.name or self.fn.__name__
        self.description = self.description or (inspect.getdoc(self.fn) or "").split("\n\n")[0]
        sig = inspect.signature(self.fn)
        self._wants_ctx = "ctx" in sig.parameters
        fields: dict[str, Any] = {}
        hints = _hints(self.fn)
        for p in sig.parameters.values():
            if p.name == "ctx":
                continue
            annotation = hints.get(p.name, Any)
            fields[p.name] = (annotation, ... if p.default is inspect.Parameter.empty else p.default)
        self._model = pydantic.create_model(f"{self.name}_arguments", **fields)
        schema = self._model.model_json_schema()
        schema.pop("title", None)
        for prop in schema.get("properties", {}).values():
            prop.pop("title", None)
        self.parameters = schema

    def spec(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    async def call(self, arguments: Mapping[str, Any], ctx: RolloutContext) -> str:
        import pydantic

        try:
            args = self._model.model_validate(dict(arguments))
        except pydantic.ValidationError as exc:
            raise ToolError(f"invalid arguments for {self.name}: {exc.errors(include_url=False)}") from None
        kwargs = dict(args)
        if self._wants_ctx:
            kwargs["ctx"] = ctx
        value = self.fn(**kwargs)
        if inspect.isawaitable(value):
            value = await value
        return value if isinstance(value, str) else json.dumps(value)


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:
        return {}


class MCPTools:
    """The tools of an MCP server: an in-process ``MCPServer`` (``mcp.server.mcpserver``), a
    command line started over stdio, or a URL. One connection per rollout, opened by the harness."""

    def __init__(self, server: Any) -> None:
        self.server = server

    async def open(self) -> _MCPSession:
        from mcp.client import Client

        client = Client(self.server)
        await client.__aenter__()
        listed = await client.list_tools()
        return _MCPSession(client, {t.name: t for t in listed.tools})


@dataclass
class _MCPSession:
    client: Any
    tools: dict[str, Any]

    def specs(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                  "parameters": t.input_schema}} for t in self.tools.values()]

    async def call(self, name: str, arguments: Mapping[str, Any]) -> str:
        result = await self.client.call_tool(name, dict(arguments))
        text = "".join(getattr(part, "text", "") for part in result.content)
        if result.is_error:
            raise ToolError(text or f"tool {name} failed")
        return text

    async def close(self) -> None:
        await self.client.__aexit__(None, None, None)


class _Toolbox:
    """The tools of one rollout: functions and the MCP sessions opened for it."""

    def __init__(self, tools: Sequence[Tool], sessions: Sequence[_MCPSession]) -> None:
        self.functions = {t.name: t for t in tools}
        self.sessions = list(sessions)
        self.owner: dict[str, _MCPSession] = {}
        for session in self.sessions:
            for name in session.tools:
                self.owner[name] = session

    @classmethod
    async def open(cls, tools: Sequence[Tool | MCPTools]) -> _Toolbox:
        functions = [t for t in tools if isinstance(t, Tool)]
        sessions = [await t.open() for t in tools if isinstance(t, MCPTools)]
        return cls(functions, sessions)

    def specs(self) -> list[dict[str, Any]]:
        return [t.spec() for t in self.functions.values()] + [s for m in self.sessions for s in m.specs()]

    async def call(self, call: Mapping[str, Any], ctx: RolloutContext) -> str:
        """The tool's answer, or the error text the model sees (it can try again)."""
        fn = call.get("function") or {}
        name = fn.get("name", "")
        try:
            arguments = json.loads(fn.get("arguments") or "{}")
            if not isinstance(arguments, dict):
                raise ToolError(f"arguments of {name} must be a JSON object, got {fn.get('arguments')!r}")
            if name in self.functions:
                return await self.functions[name].call(arguments, ctx)
            if name in self.owner:
                return await self.owner[name].call(name, arguments)
            raise ToolError(f"no tool named {name!r}; tools: {', '.join(sorted([*self.functions, *self.owner]))}")
        except json.JSONDecodeError as exc:
            return f"error: arguments of {name} are not JSON ({exc})"
        except ToolError as exc:
            return f"error: {exc}"

    async def close(self) -> None:
        for session in self.sessions:
            await session.close()


def as_tools(tools: Sequence[Callable[..., Any] | Tool | MCPTools | Any]) -> list[Tool | MCPTools]:
    out: list[Tool | MCPTools] = []
    for t in tools:
        if isinstance(t, Tool | MCPTools):
            out.append(t)
        elif type(t).__name__ == "MCPServer" or isinstance(t, str):
            out.append(MCPTools(t))
        elif callable(t):
            out.append(Tool(t))
        else:
            raise TypeError(f"tool {t!r}: give a function, a Tool, an MCPServer or MCPTools")
    return out


# --- the user simulator -------------------------------------------------------------------


class UserSimulator:
    """A model that plays the user, behind an MCP server (tool ``reply``).

    ``server`` is an MCP server (in-process ``MCPServer``, command, or URL) with a tool
    ``reply(messages: list[dict], task: dict) -> str`` that returns the user's next message; a
    reply that contains ``###STOP###`` (or is empty) means the user is done.
    :func:`user_simulator_server` builds one from any OpenAI-compatible model."""

    STOP = "###STOP###"

    def __init__(self, server: Any) -> None:
        self.tools = MCPTools(server)

    async def open(self) -> _MCPSession:
        session = await self.tools.open()
        if "reply" not in session.tools:
            await session.close()
            raise ValueError(f"user simulator server offers {sorted(session.tools)}, not a 'reply' tool")
        return session


def user_simulator_server(base_url: str, model: str, instructions: Callable[[dict[str, Any]], str],
                          api_key: str = "none", temperature: float = 0.0) -> Any:
    """An MCP server whose ``reply`` tool asks an OpenAI-compatible model to play the user.

    ``instructions(task)`` is the simulated user's brief (who they are, what they want, what they
    know). The conversation is shown to the model with the roles swapped (the agent's words as
    the user's), as user simulators usually do."""
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("user-simulator")

    @server.tool()
    async def reply(messages: list[dict[str, Any]], task: dict[str, Any]) -> str:
        """The simulated user's next message (###STOP### when the user is done)."""
        import openai

        brief = instructions(task) + f"\nWhen your request is fully handled, answer exactly {UserSimulator.STOP}."
        swapped: list[ChatCompletionMessageParam] = [{"role": "system", "content": brief}]
        for m in messages:
            if m.get("role") == "assistant" and m.get("content"):
                swapped.append({"role": "user", "content": m["content"]})
            elif m.get("role") == "user":
                swapped.append({"role": "assistant", "content": m.get("content") or ""})
        # In an environment worker (no network), through its host, to this URL of the run's config.
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=egress.http_client(600.0))
        try:
            out = await client.chat.completions.create(model=model, messages=swapped, temperature=temperature)
        finally:
            await client.close()
        return out.choices[0].message.content or UserSimulator.STOP

    return server


# --- the chat harness ---------------------------------------------------------------------

EnvResponse = Callable[..., Any]


@dataclass
class ChatHarness:
    """System prompt plus tool loop.

    Each turn asks the model for a reply. A reply with tool calls gets each call answered (a tool
    error goes back as its answer, so the model can recover) and the loop goes on. A plain reply
    ends the rollout unless ``env_response(messages=, state=, task=, ctx=)`` (any of them, by
    name; sync or async) returns messages to add (a string is one user message; None ends), or a
    ``user`` simulator answers (``###STOP###`` ends). ``stop(messages=, state=, task=)`` (by name)
    ends the rollout when true, checked after every turn. At most ``max_turns`` model calls; a
    truncated reply (``finish_reason == "length"``) ends the rollout and sets
    ``state["truncated"]``. ``state["turns"]`` counts the model calls, ``state["stop_reason"]``
    says why it ended."""

    system_prompt: str | None = None
    tools: Sequence[Any] = ()
    max_turns: int = 10
    env_response: EnvResponse | None = None
    user: UserSimulator | None = None
    stop: Callable[..., Any] | None = None
    setup: Callable[..., Any] | None = None  # setup(task=, state=, ctx=) before the first turn

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns={self.max_turns}: at least 1")
        self._tools = as_tools(self.tools)

    def initial_messages(self, env: Environment, task: dict[str, Any]) -> list[events.Message]:
        first = env.first_messages(task)
        if self.system_prompt and not (first and first[0].role == "system"):
            return [events.Message(role="system", content=self.system_prompt), *first]
        return first

    async def run(self, env: Environment, ctx: RolloutContext) -> None:
        messages = [message_dict(m) for m in self.initial_messages(env, ctx.task)]
        available = {"task": ctx.task, "state": ctx.state, "ctx": ctx}
        if self.setup is not None:
            await call_by_name(self.setup, available | {"messages": messages})
        toolbox = await _Toolbox.open(self._tools)
        user = await self.user.open() if self.user is not None else None
        try:
            specs = toolbox.specs()
            ctx.state["stop_reason"] = "max_turns"
            for turn in range(1, self.max_turns + 1):
                ctx.state["turns"] = turn
                response = await ctx.chat(messages=messages, **({"tools": specs} if specs else {}))
                choice = response["choices"][0]
                reply: dict[str, Any] = {"role": "assistant", "content": choice["message"].get("content") or ""}
                if choice["message"].get("tool_calls"):
                    reply["tool_calls"] = choice["message"]["tool_calls"]
                messages.append(reply)
                if choice.get("finish_reason") == "length":
                    ctx.state["truncated"] = True
                    ctx.state["stop_reason"] = "truncated"
                    break
                if reply.get("tool_calls"):
                    for call in reply["tool_calls"]:
                        answer = await toolbox.call(call, ctx)
                        messages.append({"role": "tool", "tool_call_id": call.get("id"), "content": answer})
                    if await self._stopped(messages, available):
                        break
                    continue
                if await self._stopped(messages, available):
                    break
                more = await self._answer(messages, available, user, ctx)
                if not more:
                    ctx.state["stop_reason"] = "done"
                    break
                messages.extend(more)
        finally:
            await toolbox.close()
            if user is not None:
                await user.close()

    async def _stopped(self, messages: list[dict[str, Any]], available: dict[str, Any]) -> bool:
        if self.stop is not None and await call_by_name(self.stop, available | {"messages": messages}):
            available["state"]["stop_reason"] = "stop"
            return True
        return False

    async def _answer(self, messages: list[dict[str, Any]], available: dict[str, Any], user: _MCPSession | None,
                      ctx: RolloutContext) -> list[dict[str, Any]]:
        if self.env_response is not None:
            given = await call_by_name(self.env_response, available | {"messages": messages})
            if given is None:
                return []
            given = [{"role": "user", "content": given}] if isinstance(given, str) else list(given)
            return [message_dict(message_from_dict(m, f"env_response[{i}]")) for i, m in enumerate(given)]
        if user is not None:
            text = await user.call("reply", {"messages": messages, "task": ctx.task})
            # Simulated users often end with a closing line before the marker: any mention ends it.
            if UserSimulator.STOP in text or not text.strip():
                return []
            return [{"role": "user", "content": text}]
        return []


async def call_by_name(fn: Callable[..., Any], available: Mapping[str, Any]) -> Any:
    """Call ``fn`` with the entries of ``available`` its parameters name; await it if async."""
    params = inspect.signature(fn).parameters
    unknown = [p for p in params if p not in available]
    if unknown:
        raise TypeError(f"{getattr(fn, '__qualname__', fn)} takes {unknown}; it may take any of {sorted(available)}")
    value = fn(**{p: available[p] for p in params})
    if inspect.isawaitable(value):
        value = await value
    return value


# --- the program harness ------------------------------------------------------------------


RUNTIMES = ("subprocess", "sandbox")
# A RolloutContext.resources entry: what runs a program harness's program instead of this
# process (an environment worker's host, in a sandbox of the program's own), as
# ``await runner(argv, env, files, stdin, timeout_s) -> (exit code, stdout, stderr, timed out)``.
PROGRAM_RUNNER = "flywheel.sdk.harness.program_runner"
# What a program started here (no runner) gets of this process's environment: these names, nothing else.
INHERITED = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "TZ", "TERM", "PYTHONPATH", "VIRTUAL_ENV")


@dataclass
class ProgramHarness:
    """Runs ``argv`` once per rollout with ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and
    ``OPENAI_MODEL`` set to the rollout's own (and ``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY``
    for programs written with the ``anthropic`` SDK), the task as JSON on stdin (and in
    ``FLYWHEEL_TASK``). A non-zero exit or a run past ``timeout_s`` (the process is killed) is the
    rollout's error. If the program's last stdout line is a JSON object it becomes the state;
    the stdout tail is kept in ``state["stdout"]`` either way. ``initial_messages`` (for SFT views)
    are the environment's first messages.

    Where it runs is the ``runtime``: ``subprocess`` (a child of the process running the rollout:
    inference, or ``flywheel eval``) or ``sandbox`` (inside the rollout's sandbox, with its tools:
    no network, its base URL reaching its own model endpoint and nothing else, through the
    sandbox service's model relay; ``sandbox`` is its spec). ``files`` (name: text, bytes or a
    path to read) are the program's own, written where it runs (a fresh folder, or the sandbox's
    workdir), so one ``argv`` (``["{python}", "agent.py"]``; ``{python}`` is this Python, or the
    sandbox's ``python3``) serves both runtimes."""

    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = 600.0
    cwd: str | None = None
    runtime: str = "subprocess"
    sandbox: SandboxSpec | None = None
    files: Mapping[str, str | bytes | os.PathLike[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.runtime not in RUNTIMES:
            raise ValueError(f"runtime={self.runtime!r}: a program harness runs in one of {', '.join(RUNTIMES)}")

    def initial_messages(self, env: Environment, task: dict[str, Any]) -> list[events.Message]:
        return env.first_messages(task)

    def program_files(self) -> dict[str, bytes]:
        return {name: data.encode() if isinstance(data, str) else data if isinstance(data, bytes)
                else Path(data).read_bytes() for name, data in self.files.items()}

    def child_env(self, ctx: RolloutContext, base_url: str) -> dict[str, str]:
        """What the program is told: its endpoint (as the OpenAI and Anthropic SDKs read it), key, model, task."""
        return {**self.env, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": ctx.api_key, "OPENAI_MODEL": ctx.model,
                "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": ctx.api_key,
                "FLYWHEEL_TASK": json.dumps(ctx.task)}

    async def run(self, env: Environment, ctx: RolloutContext) -> None:
        runner = ctx.resources.get(PROGRAM_RUNNER)
        if self.runtime == "sandbox":
            code, out, err = await self._in_sandbox(ctx)
        elif runner is not None:
            code, out, err = await self._by_runner(ctx, runner)
        else:
            code, out, err = await self._in_subprocess(ctx)
        ctx.state["stdout"] = out[-4000:]
        lines = out.strip().splitlines()
        if lines:
            try:
                last = json.loads(lines[-1])
            except json.JSONDecodeError:
                last = None
            if isinstance(last, dict):
                ctx.state.update(last)
        if code != 0:
            where = " in its sandbox" if self.runtime == "sandbox" else ""
            raise RuntimeError(f"program {self.argv[0]} exited with {code}{where}: {err[-2000:].strip()}")

    async def _in_subprocess(self, ctx: RolloutContext) -> tuple[int, str, str]:
        argv = [sys.executable if a == "{python}" else a for a in self.argv]
        with contextlib.ExitStack() as stack:
            cwd = self.cwd
            if self.files:
                cwd = stack.enter_context(tempfile.TemporaryDirectory(prefix="flywheel-program-"))
                for name, data in self.program_files().items():
                    (Path(cwd) / name).parent.mkdir(parents=True, exist_ok=True)
                    (Path(cwd) / name).write_bytes(data)
            proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                        stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE,
                                                        env={**{k: v for k, v in os.environ.items() if k in INHERITED},
                                                             **self.child_env(ctx, ctx.base_url)},
                                                        cwd=cwd, start_new_session=True)
            try:
                async with asyncio.timeout(self.timeout_s):  # not wait_for: see flywheel.contract.bus.wait_at_most
                    out, err = await proc.communicate(json.dumps(ctx.task).encode())
            except TimeoutError:
                _kill_group(proc.pid)
                await proc.wait()
                raise TimeoutError(f"program {argv[0]} ran past timeout_s={self.timeout_s} and was killed") from None
            finally:
                if proc.returncode is None:
                    _kill_group(proc.pid)
        assert proc.returncode is not None  # communicate() returned: the program has exited
        return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")

    async def _by_runner(self, ctx: RolloutContext, runner: Callable[..., Awaitable[tuple[int, str, str, bool]]]
                         ) -> tuple[int, str, str]:
        code, out, err, timed_out = await runner(list(self.argv), self.child_env(ctx, MODEL_BASE_URL),
                                                 self.program_files(), json.dumps(ctx.task).encode(), self.timeout_s)
        if timed_out:
            raise TimeoutError(f"program {self.argv[0]} ran past timeout_s={self.timeout_s} and was killed")
        return code, out, err

    async def _in_sandbox(self, ctx: RolloutContext) -> tuple[int, str, str]:
        spec = self.sandbox or SandboxSpec()
        spec = msgspec.structs.replace(spec, model_url=ctx.base_url, files={**spec.files, **self.program_files()})
        client, box = await sandbox_session(ctx, spec)
        argv = ["python3" if a == "{python}" else a for a in self.argv]
        result = await client.exec(box, argv, env=self.child_env(ctx, MODEL_BASE_URL), stdin=json.dumps(ctx.task),
                                   timeout_s=self.timeout_s)
        if result.timed_out:
            raise TimeoutError(f"program {argv[0]} ran past timeout_s={self.timeout_s} in its sandbox and was killed")
        return result.exit_code, result.stdout, result.stderr


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass

