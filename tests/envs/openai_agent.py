"""An agent written with the plain `openai` SDK that knows nothing of RL or Flywheel.

It reads its task as JSON on stdin and the endpoint from the standard OPENAI_* variables, holds a
three-turn conversation (a few-shot tool-call exchange in its history, tools offered, one
streamed request), and prints what it ended with as a JSON line (with, given PROBE_URL, whether
it could fetch that URL too).
"""

import json
import os
import sys
import urllib.error
import urllib.request
from typing import cast

from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolUnionParam

task = json.load(sys.stdin)
client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY
model = os.environ["OPENAI_MODEL"]
tools: list[ChatCompletionToolUnionParam] = [{"type": "function", "function": {"name": "rev", "parameters": {}}}]
messages: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "Reverse."},
    {"role": "user", "content": "ab"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": "rev", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c0", "content": "ba"},
    {"role": "assistant", "content": "ba"},
    {"role": "user", "content": task["text"]},
]
answers = []
reply = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=4)
# The reply as it came, as the next request's history (a response message is a valid request one).
messages.append(cast(ChatCompletionMessageParam, reply.choices[0].message.model_dump(exclude_none=True)))
answers.append(reply.choices[0].message.content or "")

messages.append({"role": "user", "content": "again"})
text = ""
for chunk in client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=4, stream=True):
    if chunk.choices and chunk.choices[0].delta.content:
        text += chunk.choices[0].delta.content
messages.append({"role": "assistant", "content": text})
answers.append(text)

messages.append({"role": "user", "content": "last"})
reply = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=4)
answers.append(reply.choices[0].message.content or "")
assert reply.usage is not None, "the server reports no usage"
state = {"answers": answers, "usage_prompt_tokens": reply.usage.prompt_tokens}
if os.environ.get("PROBE_URL"):  # somewhere else to reach, to show whether it can
    try:
        urllib.request.urlopen(os.environ["PROBE_URL"], timeout=5).close()
        state["probe"] = "reached"
    except urllib.error.HTTPError:  # an answer, whatever its status
        state["probe"] = "reached"
    except OSError as exc:
        state["probe"] = f"refused: {exc}"
print(json.dumps(state))
