"""Chat messages between the two shapes Flywheel meets: the OpenAI API's dicts (harnesses,
chat templates, the interception endpoint, eval's proxy) and the trace graph's
:class:`flywheel.contract.events.Message`. One conversion each way, used everywhere.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from flywheel.contract import events


def message_dict(m: events.Message) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        d["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        d["name"] = m.name
    return d


def message_from_dict(d: Mapping[str, Any], where: str = "message") -> events.Message:
    """An OpenAI chat message dict as a :class:`flywheel.contract.events.Message`; errors name the field."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{where}: a {type(d).__name__}, not an object with 'role' and 'content'")
    role = d.get("role")
    if role not in ("system", "user", "assistant", "tool", "developer"):
        raise ValueError(f"{where}.role={role!r}: use system, user, assistant or tool")
    content = d.get("content") or ""
    if isinstance(content, list):  # content parts: text only
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ValueError(f"{where}.content[{i}]: only text parts are supported")
            texts.append(str(part.get("text", "")))
        content = "".join(texts)
    if not isinstance(content, str):
        raise ValueError(f"{where}.content: a {type(content).__name__}, not text")
    calls = []
    for i, c in enumerate(d.get("tool_calls") or []):
        fn = c.get("function") or {}
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args)
        if not fn.get("name"):
            raise ValueError(f"{where}.tool_calls[{i}].function.name is missing")
        calls.append(events.ToolCall(id=str(c.get("id") or f"call_{i}"), name=fn["name"], arguments=args))
    return events.Message(role="system" if role == "developer" else role, content=content, tool_calls=calls,
                          tool_call_id=d.get("tool_call_id"), name=d.get("name"))
