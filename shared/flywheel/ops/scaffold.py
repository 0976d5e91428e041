"""``flywheel env init NAME``: a new environment package that passes its own tests.

The package it writes (``NAME/``)::

    pyproject.toml          the distribution OWNER-NAME; registers OWNER/NAME under the flywheel.environments
                            entry points (what `flywheel env push` sends to the hub)
    README.md               what the environment is, how to test, evaluate and train on it
    PKG/__init__.py         load_environment(): tasks from tasks.jsonl, a chat harness, rewards
    PKG/tasks.jsonl         the task rows (question, answer)
    tests/test_PKG.py       rewards, the group reward, the schema, the harness against a scripted model

``PKG`` is NAME with '-' as '_'. The example is a question-answer task: a reward for the right
answer, a metric (the answer's length, weight 0) and a group reward for the shortest right
answer of the group. Every file is meant to be edited; nothing here is generated again.
"""

from __future__ import annotations

from pathlib import Path

from flywheel.contract.hub import ENV_PART
from flywheel.contract.hubpackage import pyproject

PYTEST = '''
[tool.pytest.ini_options]
asyncio_mode = "auto"
asyncio_default_fixture_loop_scope = "function"
'''


MODULE = '''\
"""{name}: answer a question with a word.

The task rows are in tasks.jsonl (``question``, ``answer``). One chat turn through the default
harness; the reward is 1.0 for the right answer, and a metric records the answer's length.
Group rewards, tools and other harnesses: see the environments reference (docs/environments.md
in the Flywheel repository).
"""

from __future__ import annotations

from pathlib import Path

from flywheel.sdk.environment import Environment, Metric, Reward, TaskSet
from flywheel.sdk.harness import ChatHarness

TASKS = Path(__file__).with_name("tasks.jsonl")
SYSTEM_PROMPT = "Answer with one word."


def normalize(text: str) -> str:
    return text.strip().strip(".").lower()


def correct(completion: str, task: dict) -> float:
    return float(normalize(completion) == normalize(task["answer"]))


def length(completion: str) -> float:
    return float(len(completion))


def prompt(task: dict) -> str:
    return task["question"]


def load_environment(max_turns: int = 1) -> Environment:
    return Environment(
        name="{pkg}",
        tasks=TaskSet.from_jsonl(TASKS, schema={{"question": str, "answer": str}}),
        harness=ChatHarness(system_prompt=SYSTEM_PROMPT, max_turns=max_turns),
        prompt=prompt,
        reference=lambda task: task["answer"],
        rewards=[Reward(correct), Metric(length)],
        sampling={{"max_tokens": 16}},
        version="0.1.0",
        description=__doc__.split("\\n\\n")[0],
    )
'''

TASKS = '''\
{"question": "What colour is the sky on a clear day?", "answer": "blue"}
{"question": "How many legs does a spider have? Answer in words.", "answer": "eight"}
{"question": "What is the opposite of hot?", "answer": "cold"}
{"question": "Which animal says moo?", "answer": "cow"}
{"question": "What is frozen water called?", "answer": "ice"}
{"question": "What is the first letter of the English alphabet?", "answer": "a"}
'''

TESTS = '''\
"""{name}: rewards, the task schema, and the harness against a scripted model."""

from __future__ import annotations

import importlib.metadata
import json

import httpx
import pytest

from flywheel.contract import events
from flywheel.sdk.environment import TaskSet, load_environment, resolve
from flywheel.sdk.harness import RolloutContext
from flywheel.sdk.tracegraph import rollout_from_messages

from {pkg} import load_environment as load


def rollout(answer: str, index: int = 0) -> events.Rollout:
    task = {{"question": "What is frozen water called?", "answer": "ice"}}
    messages = [events.Message(role="user", content=task["question"]),
                events.Message(role="assistant", content=answer)]
    return rollout_from_messages(run="test", env="{pkg}", task_id="t", task_data=task, messages=messages,
                                 index=index)


def test_it_loads_by_module_name_with_its_tasks() -> None:
    env = load_environment("{pkg}")
    rows = env.load_tasks(4, seed=0)
    assert len(rows) == 4 and all(set(row) == {{"question", "answer"}} for row in rows)
    assert [m.role for m in env.prompt_messages(rows[0])] == ["system", "user"]
    assert env.weights == {{"correct": 1.0, "length": 0.0}}


def test_it_is_found_by_id_once_installed() -> None:
    try:
        importlib.metadata.distribution("{owner}-{name}")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("not installed: pip install -e . registers {owner}/{name}")
    assert resolve("{owner}/{name}") is load


async def test_rewards() -> None:
    rewards = {{r.name: r for r in load().rewards}}
    assert (await rewards["correct"](rollout("Ice."))).value == 1.0
    assert (await rewards["correct"](rollout("water"))).value == 0.0
    assert (await rewards["length"](rollout("ice"))).value == 3.0


def test_a_row_that_does_not_fit_the_schema_is_refused() -> None:
    with pytest.raises(ValueError, match="missing field 'answer'"):
        TaskSet.from_rows([{{"question": "?"}}], schema={{"question": str, "answer": str}})


class ScriptedModel:
    """A stand-in model behind the OpenAI chat wire format: answers every request with the next
    scripted reply. The harness reaches it through ``RolloutContext.http_client``, as it would
    reach any endpoint."""

    def __init__(self, *replies: str) -> None:
        self.replies = list(replies)
        self.requests: list[dict] = []

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.answer))

    def answer(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append(body)
        return httpx.Response(200, json={{
            "id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{{"index": 0, "finish_reason": "stop",
                         "message": {{"role": "assistant", "content": self.replies.pop(0)}}}}]}})


async def test_the_harness_asks_the_model_once() -> None:
    env = load()
    task = env.load_tasks(1)[0]
    model = ScriptedModel(task["answer"])
    ctx = RolloutContext(task=task, base_url="http://model/v1", api_key="none", model="m", http_client=model.client())
    await env.harness.run(env, ctx)
    (request,) = model.requests
    assert request["messages"][0] == {{"role": "system", "content": "Answer with one word."}}
    assert ctx.state["turns"] == 1 and ctx.state["stop_reason"] == "done"
'''

README = '''\
# {name}

A Flywheel environment: answer a question with one word.

- task set: `{pkg}/tasks.jsonl` (`question`, `answer`); edit it or point `TaskSet` elsewhere
- harness: one chat turn with a system prompt (`ChatHarness`)
- rewards: `correct` (1.0 for the right answer), `length` (a metric, weight 0: recorded and
  shown in each training step's line, not trained on)

```sh
pip install -e .                 # registers {owner}/{name}
pytest                           # its own tests
flywheel env list                # {owner}/{name} is listed
flywheel eval {owner}/{name} --model RUN_OR_MODEL -n 6 -r 4
```

On the hub (the gateway's; `{owner}` is your tenant): `flywheel env push` builds, checks and
uploads this folder as the version in `pyproject.toml`; elsewhere, `flywheel env install
{owner}/{name}` installs it, and a run config naming it gets it installed on every service.

In a run config:

```toml
env = "{owner}/{name}"
[env_args]
max_turns = 1
[rewards.correct]
weight = 1.0
```
'''


def scaffold(name: str, where: Path, owner: str = "local") -> Path:
    """Write the package ``where/name``; refuses a bad name or an existing folder."""
    if not ENV_PART.fullmatch(name):
        raise ValueError(f"NAME {name!r}: use a lowercase letter, then up to 63 lowercase letters, digits, '_' "
                         "or '-' (it names the package and the environment)")
    if not ENV_PART.fullmatch(owner):
        raise ValueError(f"--owner {owner!r}: use a lowercase letter, then up to 63 lowercase letters, digits, '_' "
                         "or '-' (your tenant on the hub)")
    folder = where / name
    if folder.exists():
        raise ValueError(f"{folder} exists already: choose another NAME or --dir")
    pkg = name.replace("-", "_")
    values = {"name": name, "pkg": pkg, "owner": owner}
    files = {
        "pyproject.toml": pyproject(owner, name, pkg, f"A Flywheel environment: {name}.", ["tasks.jsonl"]) + PYTEST,
        "README.md": README.format(**values),
        f"{pkg}/__init__.py": MODULE.format(**values),
        f"{pkg}/tasks.jsonl": TASKS,
        f"tests/test_{pkg}.py": TESTS.format(**values),
    }
    for rel, text in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return folder
