"""An agent written with the plain `openai` SDK's Responses API or the `anthropic` SDK's Messages
API (the task's "api"), knowing nothing of RL or Flywheel.

It reads its task as JSON on stdin and its endpoint from the SDK's standard variables
(OPENAI_BASE_URL / OPENAI_API_KEY, ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY), holds a three-turn
conversation with a few-shot tool call in its history and tools offered (the second turn
streamed), and prints what it ended with as a JSON line.
"""

import json
import os
import sys
from typing import Any

task = json.load(sys.stdin)
model = os.environ["OPENAI_MODEL"]
answers: list[str] = []

if task["api"] == "responses":
    from openai import OpenAI

    client = OpenAI()
    tools: list[Any] = [{"type": "function", "name": "rev", "parameters": {"type": "object", "properties": {}}}]
    history: list[Any] = [
        {"role": "user", "content": "ab"},
        {"type": "function_call", "call_id": "c0", "name": "rev", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c0", "output": "ba"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "ba"}]},
        {"role": "user", "content": task["text"]},
    ]
    reply = client.responses.create(model=model, instructions="Reverse.", input=history, tools=tools,
                                    max_output_tokens=4)
    answers.append(reply.output_text)
    # Stateful: the next turns continue the stored response.
    text, last_id = "", reply.id
    for event in client.responses.create(model=model, instructions="Reverse.", previous_response_id=last_id,
                                         input="again", tools=tools, max_output_tokens=4, stream=True):
        if event.type == "response.created":
            last_id = event.response.id
        elif event.type == "response.output_text.delta":
            text += event.delta
    answers.append(text)
    reply = client.responses.create(model=model, instructions="Reverse.", previous_response_id=last_id,
                                    input="last", tools=tools, max_output_tokens=4)
    answers.append(reply.output_text)
    prompt_tokens = reply.usage.input_tokens if reply.usage else 0
else:
    from anthropic import Anthropic

    claude = Anthropic()
    schema: list[Any] = [{"name": "rev", "input_schema": {"type": "object", "properties": {}}}]
    messages: list[Any] = [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c0", "name": "rev", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c0", "content": "ba"}]},
        {"role": "assistant", "content": "ba"},
        {"role": "user", "content": task["text"]},
    ]
    message = claude.messages.create(model=model, max_tokens=4, system="Reverse.", messages=messages, tools=schema)
    # The reply as it came, as the next request's history.
    messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
    answers.append("".join(b.text for b in message.content if b.type == "text"))
    messages.append({"role": "user", "content": "again"})
    with claude.messages.stream(model=model, max_tokens=4, system="Reverse.", messages=messages,
                                tools=schema) as stream:
        text = "".join(stream.text_stream)
        message = stream.get_final_message()
    messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
    answers.append(text)
    messages.append({"role": "user", "content": "last"})
    message = claude.messages.create(model=model, max_tokens=4, system="Reverse.", messages=messages, tools=schema)
    answers.append("".join(b.text for b in message.content if b.type == "text"))
    prompt_tokens = message.usage.input_tokens

print(json.dumps({"answers": answers, "usage_prompt_tokens": prompt_tokens}))
