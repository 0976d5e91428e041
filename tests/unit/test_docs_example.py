"""The example environment of docs/environments.md runs as written: its tasks, prompt, reward,
metric, reference and sampling."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from flywheel.sdk.environment import Environment

DOC = Path(__file__).parents[2] / "docs" / "environments.md"


def example() -> dict[str, Any]:
    (code,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    namespace: dict[str, Any] = {}
    exec(compile(code, str(DOC), "exec"), namespace)  # the documentation's own example
    return namespace


def test_the_documented_environment_loads_and_scores() -> None:
    env = example()["load_environment"]()
    assert isinstance(env, Environment)
    rows = env.load_tasks(3, seed=7)
    assert rows == env.load_tasks(3, seed=7) and len(rows) == 3  # the same rows for the same seed
    assert env.weights == {"correct": 1.0, "answer_length": 0.0}  # the metric is recorded, not trained on
    row = rows[0]
    assert [m.role for m in env.first_messages(row)] == ["system", "user"]
    assert env.reference_answer(row) == row["answer"] and env.sampling == {"max_tokens": 8}
    correct, length = (r.fn for r in env.rewards)  # type: ignore[union-attr]  # each wrapped in a Reward
    assert correct(completion=f" {row['answer']}\n", task=row) == 1.0 and length(completion="12") == 2.0
