"""The OpenAI Responses API and the Anthropic Messages API, as chat.

Agents written for those APIs (CLI coding agents among them) speak to the interception
endpoint as they would to the vendor; each request becomes the chat call every harness makes
(trace-graph messages, OpenAI chat-shaped tools, a token limit), so it is sampled and recorded on
the one interception path, and the answer goes back in the API's own shape. Translation is
lossless where the next request replays the answer: a Responses ``function_call`` item and an
Anthropic ``tool_use`` block carry the recorded tool call's id, and its arguments come back as
the recorded text, so the next turn extends the tokens the model sampled instead of re-rendering
them.

Requests are checked here, field by field; a problem is a :class:`WireError` naming the field
in the API's own way (``input[2].content[0].type`` for Responses, ``messages.0.content.1.type``
for Messages), which each route sends in its API's error shape.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from flywheel.contract import events


class WireError(ValueError):
    """A request the API refuses: HTTP ``status``, the field (``param``) and a machine ``code``."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


@dataclass
class ChatCall:
    """One request as the interception session's chat call."""

    messages: list[events.Message]
    tools: list[dict[str, Any]] | None  # in chat-completions shape, as the chat template gets them
    max_tokens: int | None
    stream: bool


def parse_body(raw: bytes) -> Any:
    """A request body as JSON; a WireError naming the body when it is not."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WireError(f"the request body is not JSON: {exc}", "body") from exc


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise WireError(f"{where}: expected an object, got {type(value).__name__}", where)
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise WireError(f"{where}: expected a string, got {type(value).__name__}", where)
    return value


def _items(value: Any, where: str, at: Callable[[int], str]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Each object of the list ``value`` (None: none) with its path ``at(i)``; errors name the field."""
    if value is None:
        return
    if not isinstance(value, list):
        raise WireError(f"{where}: expected a list, got {type(value).__name__}", where)
    for i, raw in enumerate(value):
        yield at(i), _object(raw, at(i))


def _joined_text(content: Any, where: str, at: Callable[[int], str], kinds: tuple[str, ...], hint: str,
                 code: str | None = None) -> str:
    """Text content: a string, or the text of a list of parts whose type is one of ``kinds``."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise WireError(f"{where}: expected a string or a list of content parts, got {type(content).__name__}", where)
    texts = []
    for path, part in _items(content, where, at):
        if part.get("type") not in kinds:
            raise WireError(f"{path}.type: {part.get('type')!r} is not supported here; {hint}", f"{path}.type", code)
        texts.append(_text(part.get("text"), f"{path}.text"))
    return "".join(texts)


def _limit(body: Mapping[str, Any], name: str, required: bool = False) -> int | None:
    value = body.get(name)
    if value is None:
        if required:
            raise WireError(f"{name}: Field required", name)
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise WireError(f"{name}: expected a whole number of at least 1, got {value!r}", name)
    return value


def _stream(body: Mapping[str, Any]) -> bool:
    value = body.get("stream", False)
    if not isinstance(value, bool):
        raise WireError(f"stream: expected true or false, got {value!r}", "stream")
    return value


def _function_tool(name: Any, description: Any, parameters: Any, where: str) -> dict[str, Any]:
    function: dict[str, Any] = {"name": _text(name, f"{where}.name")}
    if description is not None:
        function["description"] = _text(description, f"{where}.description")
    if parameters is not None:
        function["parameters"] = dict(_object(parameters, f"{where}.parameters"))
    return {"type": "function", "function": function}


def _recorded_arguments(recorded: Mapping[str, str], call_id: str, given: Any) -> str:
    """The arguments text of tool call ``call_id`` as the model sampled it, when ``given`` (an
    object or text from the request) is that same call; else ``given`` as JSON text."""
    original = recorded.get(call_id)
    if original is not None:
        if given == original:
            return original
        try:
            if json.loads(original) == given:
                return original
        except json.JSONDecodeError:
            pass
    return given if isinstance(given, str) else json.dumps(given)


def recorded_tool_calls(nodes: Any) -> dict[str, str]:
    """Tool call id -> its arguments text, over the assistant messages of a trace graph's nodes."""
    return {c.id: c.arguments for n in nodes for c in n.message.tool_calls}


def tool_input(arguments: str) -> Any:
    """A tool call's arguments text as the object an API sends (the text itself if it is not JSON)."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


# --- OpenAI Responses API -------------------------------------------------------------------

_RESPONSES_TEXT_PARTS = ("input_text", "output_text", "text")


def _responses_content(content: Any, where: str) -> str:
    return _joined_text(content, where, lambda i: f"{where}[{i}]", _RESPONSES_TEXT_PARTS,
                        "send text parts (input_text)", "unsupported_content_type")


def responses_tools(tools: Any) -> list[dict[str, Any]] | None:
    out = []
    for at, tool in _items(tools, "tools", lambda i: f"tools[{i}]"):
        if tool.get("type") != "function":
            raise WireError(f"{at}.type: {tool.get('type')!r} is not supported here; only function tools", f"{at}.type")
        out.append(_function_tool(tool.get("name"), tool.get("description"), tool.get("parameters"), at))
    return out or None


def responses_call(body: Mapping[str, Any], previous: Callable[[str], list[events.Message] | None],
                   recorded: Callable[[], Mapping[str, str]]) -> tuple[ChatCall, list[events.Message]]:
    """A Responses request as a chat call, and the conversation it continues or starts without
    its ``instructions`` (what a later ``previous_response_id`` continues, with the answer
    added). ``previous(id)`` gives a stored response's conversation (None: unknown);
    ``recorded()`` the rollout's tool calls so far (see :func:`recorded_tool_calls`)."""
    body = _object(body, "body")
    for name in ("conversation", "background", "prompt"):
        if body.get(name):
            raise WireError(f"{name}: not supported here; continue a conversation with previous_response_id",
                            name)
    conversation: list[events.Message] = []
    previous_id = body.get("previous_response_id")
    if previous_id is not None:
        found = previous(_text(previous_id, "previous_response_id"))
        if found is None:
            raise WireError(f"Previous response with id '{previous_id}' not found.", "previous_response_id",
                            "previous_response_not_found")
        conversation = list(found)
    start = len(conversation)  # a function_call item joins the assistant message before it in this input
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise WireError("input: expected a string or a non-empty list of input items", "input")
    known: Mapping[str, str] | None = None
    for i, raw in enumerate(items):
        where = f"input[{i}]"
        item = _object(raw, where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise WireError(f"{where}.role: {role!r}; use user, system, developer or assistant", f"{where}.role")
            content = _responses_content(item.get("content"), f"{where}.content")
            conversation.append(events.Message(role="system" if role == "developer" else role, content=content))
        elif kind == "function_call":
            call_id = _text(item.get("call_id"), f"{where}.call_id")
            known = recorded() if known is None else known
            arguments = _recorded_arguments(known, call_id, _text(item.get("arguments", "{}"), f"{where}.arguments"))
            call = events.ToolCall(id=call_id, name=_text(item.get("name"), f"{where}.name"), arguments=arguments)
            last = conversation[-1] if len(conversation) > start else None
            if last is not None and last.role == "assistant":
                conversation[-1] = events.Message(role="assistant", content=last.content,
                                                  tool_calls=[*last.tool_calls, call])
            else:
                conversation.append(events.Message(role="assistant", tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _responses_content(output, f"{where}.output")
            conversation.append(events.Message(role="tool", content=text,
                                               tool_call_id=_text(item.get("call_id"), f"{where}.call_id")))
        else:
            raise WireError(f"{where}.type: {kind!r} is not supported here; send message, function_call or "
                            "function_call_output items", f"{where}.type", "unsupported_input_type")
    instructions = body.get("instructions")
    system = ([events.Message(role="system", content=_text(instructions, "instructions"))]
              if instructions is not None else [])
    chat = ChatCall(system + conversation, responses_tools(body.get("tools")), _limit(body, "max_output_tokens"),
                    _stream(body))
    return chat, conversation


def response_id() -> str:
    return f"resp_{secrets.token_hex(16)}"


def response_message_item(text: str, status: str = "completed", logprobs: list[dict[str, Any]] | None = None,
                          item_id: str | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"type": "message", "id": item_id or f"msg_{secrets.token_hex(12)}", "status": status,
            "role": "assistant", "content": [part] if status == "completed" else []}


def response_call_item(call: events.ToolCall, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call.id}", "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else "", "status": status}


def response_output(answer: events.Message, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The output items of an answer: its text as a message item (if any), then its tool calls."""
    items = [response_message_item(answer.content, logprobs=logprobs)] if answer.content else []
    return items + [response_call_item(c) for c in answer.tool_calls]


def response_body(body: Mapping[str, Any], *, ident: str, created: int, model: str, output: list[dict[str, Any]],
                  finish_reason: str | None, usage: tuple[int, int] | None, sampling: events.Sampling | None
                  ) -> dict[str, Any]:
    """A ``response`` object; ``finish_reason`` None: still in progress, "length": incomplete."""
    if finish_reason is None:
        status, incomplete = "in_progress", None
    elif finish_reason == "length" and not any(item["type"] == "function_call" for item in output):
        status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    else:
        status, incomplete = "completed", None
    return {
        "id": ident, "object": "response", "created_at": created, "status": status, "error": None,
        "incomplete_details": incomplete, "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"), "model": model, "output": output,
        "parallel_tool_calls": True, "previous_response_id": body.get("previous_response_id"),
        "store": body.get("store") is not False, "temperature": sampling.temperature if sampling else None,
        "top_p": sampling.top_p if sampling else None,
        "text": {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [], "truncation": "disabled", "metadata": body.get("metadata") or {},
        "usage": None if usage is None else {
            "input_tokens": usage[0], "input_tokens_details": {"cached_tokens": 0}, "output_tokens": usage[1],
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": usage[0] + usage[1]},
    }


# --- Anthropic Messages API -----------------------------------------------------------------


def _anthropic_text_blocks(content: Any, where: str) -> str:
    return _joined_text(content, where, lambda i: f"{where}.{i}", ("text",), "send text blocks")


def messages_tools(tools: Any) -> list[dict[str, Any]] | None:
    out = []
    for at, tool in _items(tools, "tools", lambda i: f"tools.{i}"):
        if tool.get("type") not in (None, "custom"):
            raise WireError(f"{at}.type: {tool.get('type')!r} is not supported here; only client tools "
                            "(name, description, input_schema)", f"{at}.type")
        if "input_schema" not in tool:
            raise WireError(f"{at}.input_schema: Field required", f"{at}.input_schema")
        schema = _object(tool["input_schema"], f"{at}.input_schema")
        if schema.get("type") != "object":
            raise WireError(f"{at}.input_schema.type: {schema.get('type')!r}; an input schema is a JSON schema "
                            "of type 'object'", f"{at}.input_schema.type")
        out.append(_function_tool(tool.get("name"), tool.get("description"), schema, at))
    return out or None


def messages_call(body: Mapping[str, Any], recorded: Callable[[], Mapping[str, str]]) -> ChatCall:
    """A Messages request as a chat call. ``recorded()`` gives the rollout's tool calls so far."""
    body = _object(body, "body")
    if "model" not in body:
        raise WireError("model: Field required", "model")
    _text(body["model"], "model")
    max_tokens = _limit(body, "max_tokens", required=True)
    items = body.get("messages")
    if not isinstance(items, list) or not items:
        raise WireError("messages: expected a non-empty list of messages", "messages")
    out: list[events.Message] = []
    system = body.get("system")
    if system is not None:
        out.append(events.Message(role="system", content=_anthropic_text_blocks(system, "system")))
    known: Mapping[str, str] | None = None
    for i, raw in enumerate(items):
        where = f"messages.{i}"
        message = _object(raw, where)
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise WireError(f"{where}.role: {role!r}; use user or assistant", f"{where}.role")
        content = message.get("content")
        if isinstance(content, str):
            out.append(events.Message(role=role, content=content))
            continue
        if not isinstance(content, list):
            raise WireError(f"{where}.content: expected a string or a list of content blocks", f"{where}.content")
        texts: list[str] = []
        calls: list[events.ToolCall] = []
        for j, raw_block in enumerate(content):
            at = f"{where}.content.{j}"
            block = _object(raw_block, at)
            kind = block.get("type")
            if kind == "text":
                texts.append(_text(block.get("text"), f"{at}.text"))
            elif kind == "tool_use" and role == "assistant":
                call_id = _text(block.get("id"), f"{at}.id")
                known = recorded() if known is None else known
                given = _object(block.get("input", {}), f"{at}.input")
                calls.append(events.ToolCall(id=call_id, name=_text(block.get("name"), f"{at}.name"),
                                             arguments=_recorded_arguments(known, call_id, dict(given))))
            elif kind == "tool_result" and role == "user":
                result = block.get("content", "")
                out.append(events.Message(role="tool", content=_anthropic_text_blocks(result, f"{at}.content"),
                                          tool_call_id=_text(block.get("tool_use_id"), f"{at}.tool_use_id")))
            else:
                raise WireError(f"{at}.type: {kind!r} is not supported in a {role} message here; send text"
                                f"{', tool_use' if role == 'assistant' else ', tool_result'} blocks", f"{at}.type")
        if role == "assistant":
            out.append(events.Message(role="assistant", content="".join(texts), tool_calls=calls))
        elif texts:
            out.append(events.Message(role="user", content="".join(texts)))
    return ChatCall(out, messages_tools(body.get("tools")), max_tokens, _stream(body))


def message_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


def stop_reason(answer: events.Message, finish_reason: str) -> str:
    if answer.tool_calls:
        return "tool_use"
    return "max_tokens" if finish_reason == "length" else "end_turn"


def tool_use_block(call: events.ToolCall, whole: bool = True) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call.arguments) if whole else {}}


def message_content(answer: events.Message) -> list[dict[str, Any]]:
    blocks = [{"type": "text", "text": answer.content}] if answer.content else []
    return blocks + [tool_use_block(c) for c in answer.tool_calls]


def message_body(*, ident: str, model: str, content: list[dict[str, Any]], stop: str | None,
                 usage: tuple[int, int]) -> dict[str, Any]:
    return {"id": ident, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop, "stop_sequence": None,
            "usage": {"input_tokens": usage[0], "output_tokens": usage[1], "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0}}


def anthropic_error_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
            503: "overloaded_error", 529: "overloaded_error"}.get(status, "api_error")


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """The body of an error in the Messages API's shape."""
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


# --- answers, whole or as each API's server-sent events --------------------------------------

LOGPROBS = "message.output_text.logprobs"  # what a Responses request puts in ``include`` for logprobs


def sse(kind: str, data: Mapping[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


@dataclass
class ResponseTurn:
    """One Responses request being answered: its body, the conversation it continues (without
    instructions) and where its answer is kept for a later ``previous_response_id``."""

    body: Mapping[str, Any]
    conversation: list[events.Message]
    kept: dict[str, list[events.Message]]  # the rollout's stored responses
    model: str
    sampling: events.Sampling | None = None  # what it was sampled with, where known
    ident: str = field(default_factory=response_id)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def wants_logprobs(self) -> bool:
        include = self.body.get("include") or []
        return isinstance(include, list) and LOGPROBS in include

    def response(self, output: list[dict[str, Any]], finish_reason: str | None = None,
                 usage: tuple[int, int] | None = None) -> dict[str, Any]:
        return response_body(self.body, ident=self.ident, created=self.created, model=self.model, output=output,
                             finish_reason=finish_reason, usage=usage, sampling=self.sampling)

    def answered(self, answer: events.Message, finish_reason: str, usage: tuple[int, int],
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The whole response to ``answer``, which is kept unless the request said ``store: false``."""
        if self.body.get("store") is not False:
            self.kept[self.ident] = [*self.conversation, answer]
        return self.response(response_output(answer, logprobs), finish_reason, usage)


@dataclass
class ResponseEvents:
    """``response.*`` server-sent events of one streamed response: text deltas as they come,
    then each function call whole, then ``response.completed`` (or ``response.incomplete``)."""

    turn: ResponseTurn
    seq: int = 0
    item: dict[str, Any] | None = None  # the message item whose text is being streamed

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(kind, data)

    def start(self) -> str:
        response = self.turn.response([])
        return self._event("response.created", response=response) + self._event("response.in_progress",
                                                                                 response=response)

    def text(self, delta: str) -> str:
        head = ""
        if self.item is None:
            self.item = response_message_item("", status="in_progress")
            head = (self._event("response.output_item.added", output_index=0, item=self.item)
                    + self._event("response.content_part.added", item_id=self.item["id"], output_index=0,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return head + self._event("response.output_text.delta", item_id=self.item["id"], output_index=0,
                                  content_index=0, delta=delta, logprobs=[])

    def end(self, answer: events.Message, finish_reason: str, usage: tuple[int, int],
            logprobs: list[dict[str, Any]] | None = None) -> str:
        response = self.turn.answered(answer, finish_reason, usage, logprobs)
        out = ""
        for index, item in enumerate(response["output"]):
            if item["type"] == "message":
                if self.item is None:  # no text was streamed before the end
                    out += self.text("")
                assert self.item is not None
                item["id"] = self.item["id"]
                part = item["content"][0]
                out += (self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                    content_index=0, text=part["text"], logprobs=part.get("logprobs", []))
                        + self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))
            else:
                out += (self._event("response.output_item.added", output_index=index, item={
                            **item, "arguments": "", "status": "in_progress"})
                        + self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=item["arguments"])
                        + self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
            out += self._event("response.output_item.done", output_index=index, item=item)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return out + self._event(kind, response=response)

    def error(self, message: str) -> str:
        return self._event("error", code="server_error", message=message, param=None)


@dataclass
class MessageEvents:
    """Anthropic's server-sent events of one streamed message: ``message_start``, a text block
    as the text comes, each tool call a ``tool_use`` block, ``message_delta``, ``message_stop``."""

    model: str
    ident: str = field(default_factory=message_id)
    blocks: int = 0  # content blocks started
    text_open: bool = False

    def start(self) -> str:
        message = message_body(ident=self.ident, model=self.model, content=[], stop=None, usage=(0, 0))
        return sse("message_start", {"type": "message_start", "message": message})

    def text(self, delta: str) -> str:
        head = ""
        if not self.text_open:
            head = sse("content_block_start", {"type": "content_block_start", "index": self.blocks,
                                               "content_block": {"type": "text", "text": ""}})
            self.text_open, self.blocks = True, self.blocks + 1
        return head + sse("content_block_delta", {"type": "content_block_delta", "index": self.blocks - 1,
                                                  "delta": {"type": "text_delta", "text": delta}})

    def end(self, answer: events.Message, finish_reason: str, usage: tuple[int, int],
            logprobs: list[dict[str, Any]] | None = None) -> str:
        out = ""
        if self.text_open:
            self.text_open = False
            out += sse("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})
        for call in answer.tool_calls:
            index, self.blocks = self.blocks, self.blocks + 1
            block = tool_use_block(call)
            out += (sse("content_block_start", {"type": "content_block_start", "index": index,
                                                "content_block": tool_use_block(call, whole=False)})
                    + sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
                    + sse("content_block_stop", {"type": "content_block_stop", "index": index}))
        counts = {"input_tokens": usage[0], "output_tokens": usage[1]}
        delta = {"stop_reason": stop_reason(answer, finish_reason), "stop_sequence": None}
        return (out + sse("message_delta", {"type": "message_delta", "usage": counts, "delta": delta})
                + sse("message_stop", {"type": "message_stop"}))

    def error(self, message: str) -> str:
        return sse("error", anthropic_error(500, message))
