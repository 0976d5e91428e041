"""The RLM harness (a recursive language model): a long input the model reads with code.

The task's long input (documents far longer than the model's context) never enters the
prompt. It is the variable ``context`` of a Python REPL in the rollout's sandbox; the model
sees the question and the input's size, and answers in turns of code:

- a reply's ```` ```repl ```` (or ```` ```python ````) blocks run in the REPL, in order, and
  what they print (cut to ``max_output_chars``) comes back as the next user message;
- ``llm_query(prompt)`` inside the REPL asks the model again: the call goes out of the
  sandbox through its one way out (the sandbox's ``model_url``, the rollout's own endpoint),
  so in training it is sampled by the policy and recorded into the rollout's trace graph as a
  sub-agent (a root of its own) whose tokens are trained with the rest; in ``flywheel eval``
  the recording proxy keeps it the same way;
- ``FINAL(answer)`` ends the rollout with that answer, ``FINAL_VAR(name)`` with the REPL
  variable's value (as ``str``); either lands in ``state["answer"]``;
- ``preamble`` (code) runs before the first turn, its output added to the first prompt (a
  look at the input's start, say).

The REPL keeps its variables between turns: each turn replays the earlier cells (their
output dropped) and runs the new one, with every ``llm_query`` answer of the earlier cells
replayed from a cache, so a cell's state is what the model saw, and no sub-call is asked
twice. A cell's error comes back as its traceback; a cell past ``exec_timeout_s`` is stopped
and said to be. ``state["cells"]`` and ``state["sub_calls"]`` count what ran. The harness is a
:class:`~flywheel.sdk.harness.ChatHarness` underneath (the same turn loop, ``max_turns`` and
truncation); it needs the sandbox service, as sandbox tools do.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from flywheel.contract import events
from flywheel.sdk.harness import ChatHarness, RolloutContext
from flywheel.sdk.sandbox import MODEL_BASE_URL, SandboxSpec, sandbox_session

if TYPE_CHECKING:
    from flywheel.sdk.environment import Environment

SYSTEM_PROMPT = """You answer a question about a long input you cannot read at once. It is the string variable \
`context` in a Python REPL. Write Python in a ```repl block to look at it (slice it, search it, count); what the \
code prints comes back to you. `llm_query(prompt)` asks a language model about a piece of text you pass it and \
returns its answer as a string. Variables persist between blocks. When you know the answer, reply \
FINAL(your answer), or FINAL_VAR(name) to answer with the value of a REPL variable."""

REPL_FILE = "rlm_repl.py"
CONTEXT_FILE = "rlm_context.txt"
CELLS_DIR = "rlm_cells"
# The REPL, run in the sandbox by its python3 (standard library only): replays the cells in
# CELLS_DIR (their output dropped, llm_query answered from its cache), runs the last one and
# prints what it printed; with --var NAME, prints that variable's value instead.
REPL_SOURCE = r'''
import contextlib, io, json, os, sys, traceback, urllib.error, urllib.request

CACHE = "rlm_llm_cache.json"
cache = json.load(open(CACHE)) if os.path.exists(CACHE) else []
calls = 0


def llm_query(prompt):
    """Ask the model about `prompt` (a string); returns its answer."""
    global calls
    calls += 1
    if calls <= len(cache):
        return cache[calls - 1]
    body = {"model": os.environ["OPENAI_MODEL"], "messages": [{"role": "user", "content": str(prompt)}]}
    if os.environ.get("RLM_SUB_MAX_TOKENS"):
        body["max_tokens"] = int(os.environ["RLM_SUB_MAX_TOKENS"])
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    try:
        with urllib.request.urlopen(request, timeout=float(os.environ.get("RLM_SUB_TIMEOUT_S", "300"))) as r:
            answer = json.load(r)["choices"][0]["message"].get("content") or ""
    except urllib.error.HTTPError as exc:
        raise RuntimeError("llm_query: the model endpoint answered %d: %s" % (exc.code, exc.read()[:500])) from None
    cache.append(answer)
    with open(CACHE, "w") as f:
        json.dump(cache, f)
    return answer


namespace = {"__name__": "__main__", "context": open("rlm_context.txt", encoding="utf-8").read(),
             "llm_query": llm_query}
cells = sorted(os.listdir("rlm_cells"))
for i, name in enumerate(cells):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            exec(compile(open(os.path.join("rlm_cells", name)).read(), "cell " + name[:-3], "exec"), namespace)
        except BaseException:
            traceback.print_exc(limit=-3, file=out)
    if i == len(cells) - 1 and len(sys.argv) == 1:
        sys.stdout.write(out.getvalue())
if len(sys.argv) == 3 and sys.argv[1] == "--var":
    if sys.argv[2] not in namespace:
        print("no variable %r in the REPL" % sys.argv[2], file=sys.stderr)
        sys.exit(3)
    sys.stdout.write(str(namespace[sys.argv[2]]))
sys.stderr.write("\nRLM_SUB_CALLS=%d\n" % calls)
'''

_CODE = re.compile(r"```(?:repl|python|py)[ \t]*\n(.*?)```", re.DOTALL)
_FINAL_VAR = re.compile(r"FINAL_VAR\(\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)")
_FINAL = re.compile(r"\bFINAL\(")
_SUB_CALLS = re.compile(r"RLM_SUB_CALLS=(\d+)")
NUDGE = ("No ```repl block and no FINAL(...) in your reply. Write Python in a ```repl block to look at `context`, "
         "or answer with FINAL(your answer).")


def final_answer(text: str) -> str | None:
    """What ``FINAL(...)`` in ``text`` holds, up to its matching parenthesis (so ``FINAL(f(3))``
    is ``f(3)``; an unclosed one runs to the end of the text); None without one."""
    found = _FINAL.search(text)
    if found is None:
        return None
    depth, start = 1, found.end()
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip()
    return text[start:].strip()


@dataclass
class RLMHarness:
    """``context``: the task field holding the long input, or a function of the task giving it.
    ``spec``: the sandbox's (its ``model_url`` is set per rollout). ``sub_max_tokens``: the
    ``max_tokens`` of each ``llm_query`` (None: the run's)."""

    context: str | Callable[[dict[str, Any]], str] = "context"
    max_turns: int = 8
    system_prompt: str = SYSTEM_PROMPT
    spec: SandboxSpec | None = None
    max_output_chars: int = 2000
    exec_timeout_s: float = 60.0
    sub_max_tokens: int | None = None
    preamble: str | None = None
    _chat: ChatHarness = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._chat = ChatHarness(system_prompt=self.system_prompt, max_turns=self.max_turns, setup=self._setup,
                                 env_response=self._respond)

    def initial_messages(self, env: Environment, task: dict[str, Any]) -> list[events.Message]:
        return self._chat.initial_messages(env, task)

    async def run(self, env: Environment, ctx: RolloutContext) -> None:
        await self._chat.run(env, ctx)

    def long_input(self, task: dict[str, Any]) -> str:
        text = self.context(task) if callable(self.context) else task[self.context]
        if not isinstance(text, str):
            raise TypeError(f"the RLM harness's context is {type(text).__name__}; it takes a string")
        return text

    async def _setup(self, task: dict[str, Any], state: dict[str, Any], ctx: RolloutContext,
                     messages: list[dict[str, Any]]) -> None:
        spec = self.spec or SandboxSpec()
        files = {**spec.files, REPL_FILE: REPL_SOURCE.encode(), CONTEXT_FILE: self.long_input(task).encode()}
        await sandbox_session(ctx, msgspec.structs.replace(spec, model_url=ctx.base_url, files=files))
        state["cells"] = state["sub_calls"] = 0
        if self.preamble:
            messages.append({"role": "user", "content": await self._run_cell(ctx, state, self.preamble)})

    async def _run_cell(self, ctx: RolloutContext, state: dict[str, Any], code: str) -> str:
        state["cells"] += 1
        client, box = await sandbox_session(ctx)
        await client.write_file(box, f"{CELLS_DIR}/{state['cells']:04d}.py", code + "\n")
        output = await self._repl(ctx, state, [])
        assert output is not None  # only an answer's read (answer=True) gives None
        return output

    async def _respond(self, messages: list[dict[str, Any]], state: dict[str, Any], ctx: RolloutContext) -> str | None:
        text = messages[-1].get("content") or ""
        code = "\n".join(block.strip("\n") for block in _CODE.findall(text))
        output = await self._run_cell(ctx, state, code) if code else None
        # An answer after the code (the model may compute it first): FINAL_VAR reads the REPL.
        prose = _CODE.sub("", text)  # what the code says is not an answer
        final_var = _FINAL_VAR.search(prose)
        if final_var is not None:
            if state["cells"] == 0:
                state["answer"] = None
                return f"FINAL_VAR({final_var.group(1)}): the REPL has no variables yet; run code first."
            state["answer"] = await self._repl(ctx, state, ["--var", final_var.group(1)], answer=True)
            return None if state["answer"] is not None else f"FINAL_VAR({final_var.group(1)}): no such variable"
        final = final_answer(prose)
        if final is not None:
            state["answer"] = final
            return None
        return output if output is not None else NUDGE

    async def _repl(self, ctx: RolloutContext, state: dict[str, Any], args: list[str],
                    answer: bool = False) -> str | None:
        client, box = await sandbox_session(ctx)
        env = {"OPENAI_BASE_URL": MODEL_BASE_URL, "OPENAI_API_KEY": ctx.api_key, "OPENAI_MODEL": ctx.model}
        if self.sub_max_tokens is not None:
            env["RLM_SUB_MAX_TOKENS"] = str(self.sub_max_tokens)
        result = await client.exec(box, ["python3", REPL_FILE, *args], env=env, timeout_s=self.exec_timeout_s)
        counted = _SUB_CALLS.findall(result.stderr)
        if counted:
            state["sub_calls"] = max(state["sub_calls"], int(counted[-1]))
        if answer:
            return result.stdout if result.exit_code == 0 else None
        if result.timed_out:
            return f"The cell ran past {self.exec_timeout_s:g} s and was stopped."
        said = (result.stdout + _SUB_CALLS.sub("", result.stderr).strip()).rstrip("\n")
        if len(said) > self.max_output_chars:
            said = said[:self.max_output_chars] + f"\n... ({len(said) - self.max_output_chars} more characters)"
        return f"REPL output:\n{said}" if said.strip() else "REPL output: (nothing printed)"
