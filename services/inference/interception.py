"""The interception endpoint: every rollout gets its own OpenAI-compatible base URL.

``POST /intercept/<key>/v1/chat/completions`` (or ``POST /v1/chat/completions`` with
``Authorization: Bearer <key>``) answers a harness's chat request with the run's policy, in
standard OpenAI form (tool calls and streaming included), and records the call into the
rollout's trace graph. The harness does not know it is doing RL.

- **Sampling** is the run's (temperature, top_p, stop, seed); a request may only lower
  ``max_tokens``. Logprobs are always recorded and returned. ``n`` must be 1: a retry is a
  second request, which becomes a sibling branch.
- **Tokens extend, they are not re-rendered.** The request's messages are matched against
  the graph (:meth:`flywheel.sdk.tracegraph.TraceGraph.match`); the prompt is the matched branch's
  tokens exactly as they were sampled or seen, then the chat template's closing of the last
  sampled answer (e.g. ``\\n`` after ``<|im_end|>``), then the new messages rendered as the
  template renders them after the matched ones, then the generation prompt. So the model
  sees its own sampled tokens again, not a re-tokenization of their text, and concatenating
  a branch's spans gives exactly the tokens the model saw. Only when the template rewrites
  the matched history (rendering it is not a prefix of rendering the whole request, nor is
  the text the model saw there: Qwen3 drops earlier reasoning) is the conversation
  re-rendered, as a new branch from the deepest matched message the template still renders
  as before; each such call is counted in ``num_rerenders``. New messages that the template
  renders only together (Qwen's consecutive tool results share one user turn) or refuses
  alone (Llama 3.1's system message, with tools) extend the branch too: such a message's
  node has no tokens of its own, its text is on the next message's node.
- **Nodes** carry both layers: the new messages' nodes hold the tokens they add (loss mask
  False, logprob 0.0); the assistant node holds the generation prompt (not trained) and the
  sampled tokens (trained, with their logprobs and the policy version). Once a rollout
  has run ``live_after_s`` (the inference setting ``live_trace_after_s``), its nodes are
  published as :class:`flywheel.contract.events.TraceNode` events, those so far at once and
  then each call's as it completes, in call order and off the request's path (the rollout
  is published after all of them). A rollout that ends sooner publishes none: its nodes
  travel in the rollout event only, which spares the bus, the recorder and live viewers a
  message per call where rollouts are short (a training run's usually are).
- **Tool calls** are parsed from the sampled text (``<tool_call>{"name": ..., "arguments":
  ...}</tool_call>``, the Hermes format the template teaches) when the request offers tools.

``stream = true`` sends the answer token by token as it is sampled, in OpenAI's chunks
(:mod:`flywheel_inference.streaming`; a tool call comes whole once the answer is done), and
records it like any other call. Not covered: ``n`` > 1, ``tool_choice`` other than auto,
images and audio.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Generic, TypeVar
from urllib.parse import urlsplit

import httpx
import msgspec
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flywheel.contract import events
from flywheel.runtime.environments import Hooks
from flywheel.sdk.hooks import Blocked
from flywheel.sdk.messages import message_dict, message_from_dict
from flywheel.sdk.tracegraph import TraceGraph
from flywheel_inference.policy import WeightsUnavailable
from flywheel_inference.streaming import (
    ChunkWriter,
    Ending,
    TextStream,
    TokenQueue,
    chat_logprobs,
    chat_message,
    respond,
)

router = APIRouter()

UNKNOWN_ROLLOUT_KEY = "unknown rollout key: the rollout has ended or the URL is wrong"
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


class InterceptionError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    """An error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = {400: "invalid_request_error", 404: "invalid_request_error",
            503: "service_unavailable"}.get(status, "api_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


def install(app: FastAPI) -> None:
    """The interception routes on ``app``, with OpenAI's error shape; they answer from the
    sessions of ``app.state.interception`` (an :class:`Interception`, set by whoever runs the
    app). The inference app (:mod:`flywheel_inference.api`) and the worker's in-process
    client both use it."""

    async def on_interception_error(_: Request, exc: InterceptionError) -> JSONResponse:
        return openai_error(exc.status, exc.message, exc.param, exc.code)

    app.include_router(router)
    app.add_exception_handler(
        InterceptionError, on_interception_error)  # type: ignore[arg-type]  # typed for Exception; gets only that class


@dataclass
class Plan:
    """How one request becomes a prompt: where it hangs in the graph and the tokens it adds."""

    parent_id: str | None
    new: list[tuple[events.Message, list[int]]]  # the new messages' nodes and their tokens
    prefix: list[int]  # tokens before the sampled answer on the assistant node (gen prompt)
    prompt_ids: list[int]  # everything the model is given
    rerendered: bool


def parse_tool_calls(text: str) -> tuple[str, list[events.ToolCall]]:
    """(content without the calls, calls) from sampled text; malformed calls stay in the content."""
    calls: list[events.ToolCall] = []

    def take(match: re.Match[str]) -> str:
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            return match.group(0)
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return match.group(0)
        args = body.get("arguments", {})
        calls.append(events.ToolCall(id=f"call_{secrets.token_hex(6)}", name=body["name"],
                                     arguments=args if isinstance(args, str) else json.dumps(args)))
        return ""

    content = _TOOL_CALL.sub(take, text)
    return (content.strip() if calls else content), calls


K = TypeVar("K")
V = TypeVar("V")
T = TypeVar("T")
RENDER_CACHE_SIZE = 4096  # texts and token lists a Renderer keeps
_MESSAGES = msgspec.json.Encoder()


class LRU(Generic[K, V]):
    """A dict of at most ``size`` entries that forgets the least recently used."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> V:
        self._items[key] = value
        if len(self._items) > self.size:
            self._items.popitem(last=False)
        return value


class Renderer:
    """Chat-template text and tokens for one tokenizer, with the pieces extension needs.

    Renders and encodings are cached (the last ``RENDER_CACHE_SIZE`` of each): the template is
    a pure function of the messages and tools, and the rollouts of a group ask for the same
    ones, so a group of 16 renders its prompt once, not 16 times.
    """

    SENTINEL = "\x00FLYWHEEL-SENTINEL\x00"
    _cache: ClassVar[dict[int, Renderer]] = {}

    @classmethod
    def of(cls, tok: Any) -> Renderer:
        """The renderer of ``tok``, built once (it probes the template)."""
        renderer = cls._cache.get(id(tok))
        if renderer is None or renderer.tok is not tok:
            renderer = cls._cache[id(tok)] = cls(tok)
        return renderer

    def __init__(self, tok: Any) -> None:
        from flywheel.sdk import models

        self.tok = tok
        self._text = models.render_text
        probe = self._text(tok, [events.Message(role="user", content="x"),
                                 events.Message(role="assistant", content=self.SENTINEL)])
        # What the template writes after an assistant message's content (e.g. "<|im_end|>\n").
        self.closing = probe[probe.index(self.SENTINEL) + len(self.SENTINEL):]
        self.eos_text = tok.decode([tok.eos_token_id]) if tok.eos_token_id is not None else ""
        # The renders and encodings of recent message lists: a group's rollouts start from the
        # same messages, and a turn's render is the next turn's prefix.
        self._texts: LRU[tuple[bytes, str, bool], str] = LRU(RENDER_CACHE_SIZE)
        self._ids: LRU[str, list[int]] = LRU(RENDER_CACHE_SIZE)
        self._token_texts: dict[int, str] = {}  # at most one entry a token of the vocabulary

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's text alone (what OpenAI's logprobs name a token), decoded once per token id."""
        texts = self._token_texts
        for t in token_ids:
            if t not in texts:
                texts[t] = self.tok.decode([t])
        return [texts[t] for t in token_ids]

    def text(self, messages: Sequence[events.Message], tools: list[dict[str, Any]] | None,
             generation_prompt: bool = False) -> str:
        key = (_MESSAGES.encode(messages), json.dumps(tools, sort_keys=True) if tools else "", generation_prompt)
        text = self._texts.get(key)
        if text is None:
            text = self._texts.put(key, self._text(self.tok, messages, tools, generation_prompt))
        return text

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        ids = self._ids.get(text)
        if ids is None:
            ids = self._ids.put(text, self.tok.encode(text, add_special_tokens=False))
        return list(ids)

    def bridge(self, node: events.Node) -> str:
        """Text the template puts after a sampled answer's tokens before the next message."""
        if node.message.role != "assistant" or node.tokens is None or not any(node.tokens.loss_mask):
            return ""
        ended = bool(node.tokens.token_ids) and node.tokens.token_ids[-1] == self.tok.eos_token_id
        if ended and self.eos_text and self.closing.startswith(self.eos_text):
            return self.closing[len(self.eos_text):]
        return self.closing

    def plan(self, graph: TraceGraph, messages: list[events.Message], tools: list[dict[str, Any]] | None,
             tools_ok: bool) -> Plan:
        """The request's prompt: the matched branch extended when the template renders its
        history as before; otherwise re-rendered from the deepest message of it the template
        still renders as before (a root, at worst), counted as a re-render."""
        path = graph.match(messages) if tools_ok else []
        for k in range(len(path), -1, -1):
            plan = self._extend(path[:k], messages, tools, as_seen=k == len(path))
            if plan is not None:
                plan.rerendered = k < len(path)
                return plan
        raise AssertionError("a plan from no path always exists")

    def _probe(self, messages: Sequence[events.Message], tools: list[dict[str, Any]] | None) -> str | None:
        """The render of ``messages`` without a generation prompt, or None where the template
        refuses them alone (Llama 3.1 puts the tools in the first user message, so a system
        message alone raises). Only a probe: a render of a whole request still raises."""
        try:
            return self.text(messages, tools)
        except Exception:  # a template raises what it likes: TemplateError, TypeError, KeyError...
            return None

    def _extend(self, path: list[events.Node], messages: list[events.Message],
                tools: list[dict[str, Any]] | None, as_seen: bool = False) -> Plan | None:
        """The plan that extends ``path`` (matching ``messages[:len(path)]``) with the rest, or
        None when the template renders that history otherwise now.

        The history is as before when rendering it alone is a prefix of rendering the whole
        request; or (``as_seen``) when the text the model saw on ``path``, its sampled tokens
        decoded, is: Qwen3 renders a last answer with an empty ``<think>`` block it drops once
        the answer is history, so an answer sampled without one is history exactly as seen.
        Each new message's node gets the tokens of its render's increment; a message whose
        render is not a prefix of the whole (Qwen's consecutive tool results share one user
        turn, closed after the last), or that the template refuses alone, gets none: its
        text is encoded with the next message's."""
        k = len(path)
        full = self.text(messages, tools, generation_prompt=True)
        history = self._history(path, messages[:k], tools, full, as_seen)
        if history is None:
            return None
        base: list[int] = [t for n in path for t in (n.tokens.token_ids if n.tokens else [])]
        start, pending = history  # pending: text before ``start`` that the path's tokens lack
        new: list[tuple[events.Message, list[int]]] = []
        for j in range(k, len(messages)):
            current = self._probe(messages[:j + 1], tools)
            if current is None or len(current) < start or not full.startswith(current):
                new.append((messages[j], []))  # its text goes with the next message's
                continue
            new.append((messages[j], self.encode(pending + full[start:len(current)])))
            pending, start = "", len(current)
        prefix = self.encode(pending + full[start:])
        prompt_ids = base + [t for _, ids in new for t in ids] + prefix
        return Plan(path[-1].id if path else None, new, prefix, prompt_ids, rerendered=False)

    def _history(self, path: list[events.Node], history: list[events.Message], tools: list[dict[str, Any]] | None,
                 full: str, as_seen: bool) -> tuple[int, str] | None:
        """Where the text after ``path``'s history begins in ``full``, and the text the path's
        tokens lack before that (the template's closing of a sampled answer: :meth:`bridge`);
        None when ``full`` does not render that history as before."""
        if not path:
            return 0, ""
        # A trailing node without tokens had its text encoded with the message after it, which
        # is not on the path: extending here would leave that text out.
        for i in range(len(path) - 1, -1, -1):
            node = path[i]
            if node.tokens is None or node.tokens.token_ids:
                break
            if self._probe(history[:i + 1], tools) != (self._probe(history[:i], tools) if i else ""):
                return None
        previous = self._probe(history, tools)
        if previous is not None and full.startswith(previous):
            return len(previous), self.bridge(path[-1])
        if as_seen:
            ids = [t for n in path for t in (n.tokens.token_ids if n.tokens else [])]
            seen = self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if full.startswith(seen):
                return len(seen), ""
        return None


def record(graph: TraceGraph, plan: Plan, completion: Any, version: int, *,
           texts: Callable[[Sequence[int]], list[str]], parse_tools: bool = False) -> list[events.Node]:
    """Add a call's new message nodes and its sampled answer to ``graph``; returns the nodes that
    are new (the answer last). ``completion`` is a :class:`flywheel_inference.backends.Completion`;
    ``texts`` gives each token's text (:meth:`Renderer.token_texts`), recorded beside its id so
    a trace reads without the tokenizer."""
    content, calls = parse_tool_calls(completion.text) if parse_tools else (completion.text, [])
    created: list[events.Node] = []
    parent = plan.parent_id
    for message, ids in plan.new:
        span = events.TokenSpan(token_ids=ids, logprobs=[0.0] * len(ids), loss_mask=[False] * len(ids),
                                texts=texts(ids))
        node, is_new = graph.add(parent, message, span)
        created += [node] if is_new else []
        parent = node.id
    n_pre, n_out = len(plan.prefix), len(completion.token_ids)
    ids = plan.prefix + list(completion.token_ids)
    span = events.TokenSpan(token_ids=ids, logprobs=[0.0] * n_pre + list(completion.logprobs),
                            loss_mask=[False] * n_pre + [True] * n_out, policy_version=version, texts=texts(ids))
    answer, is_new = graph.add(parent, events.Message(role="assistant", content=content, tool_calls=calls), span)
    created += [answer] if is_new else []
    return created


@dataclass
class Session:
    """One rollout's interception state: its key, its graph and counters."""

    key: str
    run: str
    rollout_id: str
    policy: Any  # flywheel_inference.policy.Policy
    sampling: events.Sampling
    publish: Any  # async (list[events.TraceNode]) -> None
    live_after_s: float = 0.0  # trace nodes go on the bus once the rollout has run this long
    graph: TraceGraph = field(default_factory=TraceGraph)
    num_calls: int = 0
    num_rerenders: int = 0
    num_completion_tokens: int = 0
    num_call_prompt_tokens: int = 0  # every call's whole prompt (metering; see usage())
    generation_s: float = 0.0
    truncated: bool = False
    versions: list[int] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)  # what the model was given, call by call
    # The Responses API's stored responses (id -> the conversation they end), for previous_response_id.
    responses: dict[str, list[events.Message]] = field(default_factory=dict)
    hooks: Hooks | None = None  # the environment's hooks on each call (run in its worker)
    _tools_key: str | None = None
    _renderer: Renderer | None = None
    _publishing: asyncio.Future[None] | None = None
    _opened: float = field(default_factory=time.monotonic)
    _unpublished: list[events.TraceNode] = field(default_factory=list)  # held until the rollout goes live
    _live: bool = False
    _go_live_timer: asyncio.TimerHandle | None = None
    _closed: bool = False

    def prompt_length(self, messages: list[events.Message], tools: list[dict[str, Any]] | None) -> int:
        """How many tokens the model would be given for ``messages`` now (nothing is sampled or recorded)."""
        return len(self._plan(messages, tools, remember=False).prompt_ids)

    @property
    def renderer(self) -> Renderer:
        """The renderer of the policy's tokenizer, found on first use."""
        if self._renderer is None:
            self._renderer = Renderer.of(self.policy.backend.tokenizer)
        return self._renderer

    def _plan(self, messages: list[events.Message], tools: list[dict[str, Any]] | None, remember: bool) -> Plan:
        """How ``messages`` extend the graph. A call with other tools than the last one's does not
        extend it (the tools are in the prompt's first turn); ``remember`` makes these the last."""
        tools_key = json.dumps(tools, sort_keys=True) if tools else ""
        tools_ok = self._tools_key is None or self._tools_key == tools_key
        if remember:
            self._tools_key = tools_key
        try:
            return self.renderer.plan(self.graph, messages, tools or None, tools_ok)
        except TemplateError as exc:  # the request, not the server: e.g. Llama 3.1 takes one tool call per turn
            raise InterceptionError(400, f"the model's chat template refused the messages: {exc}", "messages",
                                    "chat_template_error") from exc

    async def chat(self, messages: list[events.Message], tools: list[dict[str, Any]] | None,
                   max_tokens: int | None,
                   on_token: Callable[[int, int, float], None] | None = None) -> tuple[events.Node, Any, int]:
        """Sample the answer to ``messages``; returns (assistant node, completion, prompt length).
        ``on_token(0, token_id, logprob)`` is called with each token as it is sampled. The
        environment's request hooks see (and may rewrite or block) ``messages`` first; its
        response hooks see the answer."""
        if self.hooks:
            messages = await self._hooked(self.hooks.before(messages))
        plan = self._plan(messages, tools, remember=True)
        sampling = self.sampling
        if max_tokens is not None and max_tokens < sampling.max_tokens:
            sampling = msgspec.structs.replace(sampling, max_tokens=max_tokens)
        sampling = sampling.with_seed_offset(7919 * self.num_calls)
        try:
            self.policy.check([plan.prompt_ids], sampling)
        except ValueError as exc:
            self.truncated = True
            raise InterceptionError(400, str(exc), "messages", "context_length_exceeded") from exc
        try:
            (sampled,) = await self.policy.sample([plan.prompt_ids], sampling, on_token=on_token)
        except WeightsUnavailable as exc:
            raise InterceptionError(503, str(exc)) from exc
        c = sampled.completion
        self.num_calls += 1
        self.num_rerenders += plan.rerendered
        self.num_completion_tokens += len(c.token_ids)
        self.num_call_prompt_tokens += len(plan.prompt_ids)
        self.generation_s += sampled.generation_s
        self.truncated |= c.finish_reason == "length"
        self.versions.append(sampled.version)
        self.prompts.append(plan.prompt_ids)
        created = record(self.graph, plan, c, sampled.version, texts=self.renderer.token_texts,
                         parse_tools=bool(tools))
        answer = created[-1] if created else self.graph.last
        assert answer is not None
        self._publish_in_order([events.TraceNode(run=self.run, rollout_id=self.rollout_id, node=n) for n in created])
        if self.hooks:
            await self._hooked(self.hooks.after(messages, answer.message))
        return answer, c, len(plan.prompt_ids)

    @staticmethod
    async def _hooked(call: Awaitable[T]) -> T:
        """A hook's outcome; a block or a failing hook is the API's error, naming the hook."""
        try:
            return await call
        except Blocked as exc:
            raise InterceptionError(400, str(exc), "messages", "blocked_by_environment") from exc
        except Exception as exc:
            raise InterceptionError(500, f"the environment's hook failed: {type(exc).__name__}: {exc}") from exc

    def _publish_in_order(self, nodes: list[events.TraceNode]) -> None:
        """Publish off the request's path, each call's nodes after the previous call's, once
        the rollout is live (held until then; see ``live_after_s``)."""
        if self._closed:
            return  # the rollout is over: its rollout event carries them
        self._unpublished.extend(nodes)
        wait_s = self._opened + self.live_after_s - time.monotonic()
        if self._live or wait_s <= 0:
            self._go_live()
        elif self._go_live_timer is None:
            self._go_live_timer = asyncio.get_running_loop().call_later(wait_s, self._go_live)

    def _go_live(self) -> None:
        self._live, self._go_live_timer = True, None
        nodes, self._unpublished = self._unpublished, []
        if self._closed or not nodes:
            return
        previous = self._publishing

        async def publish() -> None:
            if previous is not None:
                await previous
            await self.publish(nodes)

        self._publishing = asyncio.ensure_future(publish())

    def close(self) -> None:
        """The rollout is over: nodes not yet live stay unpublished (they travel in its rollout)."""
        self._closed = True
        if self._go_live_timer is not None:
            self._go_live_timer.cancel()
            self._go_live_timer = None

    async def flush(self) -> None:
        """Wait until every trace node this rollout published is on the bus (raises what
        publishing raised); nodes it held (it ended before going live) are not published."""
        self.close()
        if self._publishing is not None:
            await self._publishing

    def usage(self) -> events.RolloutUsage:
        """What this rollout's calls cost, as counted while they were sampled."""
        return events.RolloutUsage(num_calls=self.num_calls, prompt_tokens=self.num_call_prompt_tokens,
                                   sampled_tokens=self.num_completion_tokens)

    def metrics(self) -> dict[str, float]:
        prompt_tokens = sum(len(n.tokens.token_ids) - sum(n.tokens.loss_mask) for n in self.graph.nodes.values()
                            if n.tokens)
        return {"num_calls": float(self.num_calls), "num_rerenders": float(self.num_rerenders),
                "num_completion_tokens": float(self.num_completion_tokens), "num_prompt_tokens": float(prompt_tokens),
                "generation_s": self.generation_s}


class Interception:
    """The sessions of the rollouts in flight, by key."""

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}

    def open(self, run: str, rollout_id: str, policy: Any, sampling: events.Sampling, publish: Any,
             live_after_s: float = 0.0) -> Session:
        key = f"fw-{secrets.token_urlsafe(24)}"
        session = Session(key=key, run=run, rollout_id=rollout_id, policy=policy, sampling=sampling, publish=publish,
                          live_after_s=live_after_s)
        self.sessions[key] = session
        return session

    def close(self, key: str) -> None:
        session = self.sessions.pop(key, None)
        if session is not None:
            session.close()

    def get(self, key: str) -> Session:
        try:
            return self.sessions[key]
        except KeyError:
            # The rollout key is the endpoint's credential: an unknown one is refused as a bad key is.
            raise InterceptionError(401, UNKNOWN_ROLLOUT_KEY, None, "invalid_rollout_key") from None


# --- HTTP ---------------------------------------------------------------------------------


class InterceptedChat(BaseModel):
    """An OpenAI chat request. Sampling fields other than max_tokens are the run's and ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=1, description="one answer per request; a retry is another request")
    stream: bool = False
    stream_options: dict[str, Any] | None = None


def _interception(request: Request) -> Interception:
    return request.app.state.interception


InterceptionDep = Annotated[Interception, Depends(_interception)]


def _tool_call_dicts(calls: Sequence[events.ToolCall]) -> list[dict[str, Any]]:
    return message_dict(events.Message(role="assistant", tool_calls=list(calls))).get("tool_calls", [])


async def answer(session: Session, body: InterceptedChat) -> Response:
    try:
        messages = [message_from_dict(m, f"messages[{i}]") for i, m in enumerate(body.messages)]
    except ValueError as exc:
        raise InterceptionError(400, str(exc), "messages") from exc
    for i, tool in enumerate(body.tools or []):
        if tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InterceptionError(400, f"tools[{i}]: only {{'type': 'function', 'function': {{...}}}} tools",
                                    "tools")
    max_tokens = body.max_completion_tokens or body.max_tokens
    tok = session.policy.backend.tokenizer
    ident, created, model = f"chatcmpl-{events.new_id()}", int(time.time()), body.model or session.run
    if body.stream:
        return await _streamed(session, body, messages, max_tokens, ChunkWriter(True, ident, created, model, tok))
    node, c, num_prompt = await session.chat(messages, body.tools, max_tokens)
    ending, usage, fingerprint = _ended(node, c, num_prompt)
    logprobs = chat_logprobs(Renderer.of(tok).token_texts(c.token_ids), c.logprobs)
    # Encoded here (msgspec), not by FastAPI's generic encoder: the logprobs make it long.
    return Response(msgspec.json.encode({
        "id": ident, "object": "chat.completion", "created": created, "model": model,
        "system_fingerprint": fingerprint, "usage": usage,
        "choices": [{"index": 0, "message": chat_message(ending), "finish_reason": ending.finish_reason,
                     "logprobs": logprobs}]}),
        media_type="application/json")


def _ended(node: events.Node, c: Any, num_prompt: int) -> tuple[Ending, dict[str, int], str]:
    """How a call's answer ended (content, tool calls, finish reason), its usage and fingerprint."""
    calls = node.message.tool_calls
    ending = Ending(node.message.content or "", "tool_calls" if calls else c.finish_reason, _tool_call_dicts(calls))
    usage = {"prompt_tokens": num_prompt, "completion_tokens": len(c.token_ids),
             "total_tokens": num_prompt + len(c.token_ids)}
    return ending, usage, f"policy-v{node.tokens.policy_version if node.tokens else 0}"


async def _streamed(session: Session, body: InterceptedChat, messages: list[events.Message], max_tokens: int | None,
                    writer: ChunkWriter) -> StreamingResponse:
    tokens = TokenQueue()
    job = asyncio.ensure_future(session.chat(messages, body.tools, max_tokens, on_token=tokens.on_token))

    async def endings() -> tuple[list[Ending], dict[str, int], str]:
        ending, usage, fingerprint = _ended(*await job)
        return [ending], usage, fingerprint

    stream = TextStream(session.policy.backend.tokenizer, session.sampling.stop, bool(body.tools))
    return await respond(writer, [stream], tokens, job, endings, bool((body.stream_options or {}).get("include_usage")))


class InProcessTransport(httpx.AsyncBaseTransport):
    """How harnesses in the inference process reach the interception routes: no socket, and a
    non-streaming chat completion goes straight to :func:`answer`, the handler the route
    calls, with the same request model and the same response bytes, skipping the web
    framework's routing and middleware (on a small model they cost more CPU than the answer).
    Everything else (streaming, ``/models``, a body the request model refuses, so its 422
    keeps FastAPI's shape) goes through ``app`` as it would over HTTP.

    :meth:`post` is the same for a caller that has the request's bytes already
    (:meth:`flywheel.sdk.harness.RolloutContext.chat`): it skips the HTTP client too, whose
    work per request (URL parsing, headers, cookies) cost inference more CPU than the
    handler it reaches."""

    def __init__(self, app: FastAPI, interception: Interception) -> None:
        self.app = httpx.ASGITransport(app=app)
        self.interception = interception

    async def _answered(self, method: str, path: str, content: bytes) -> Response | None:
        """The answer to a non-streaming chat completion, straight from :func:`answer`; None
        for anything else (the app answers it)."""
        match = _CHAT_PATH.fullmatch(path)
        if method != "POST" or match is None:
            return None
        try:
            body = InterceptedChat.model_validate_json(content)
        except ValidationError:
            return None
        if body.stream:
            return None
        try:
            return await answer(self.interception.get(match.group(1)), body)
        except InterceptionError as exc:
            return openai_error(exc.status, exc.message, exc.param, exc.code)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._answered(request.method, request.url.path, await request.aread())
        if response is not None:
            return httpx.Response(response.status_code, headers=response.headers.raw, content=bytes(response.body))
        return await self.app.handle_async_request(request)

    async def post(self, url: str, content: bytes) -> tuple[int, bytes]:
        """(status, body) of a POST of ``content`` (JSON) to ``url``, as over HTTP."""
        response = await self._answered("POST", urlsplit(url).path, content)
        if response is not None:
            return response.status_code, bytes(response.body)
        request = httpx.Request("POST", url, content=content, headers={"Content-Type": "application/json"})
        answered = await self.app.handle_async_request(request)
        return answered.status_code, await answered.aread()

    async def aclose(self) -> None:
        await self.app.aclose()


_CHAT_PATH = re.compile(r"/intercept/([^/]+)/v1/chat/completions")


@router.post("/intercept/{key}/v1/chat/completions", response_model=None)
async def intercepted_chat(key: str, body: InterceptedChat, interception: InterceptionDep) -> Response:
    return await answer(interception.get(key), body)


@router.get("/intercept/{key}/v1/models")
async def intercepted_models(key: str, interception: InterceptionDep) -> dict[str, Any]:
    session = interception.get(key)
    return {"object": "list", "data": [{"id": session.run, "object": "model", "owned_by": "flywheel"}]}
