"""long_context: questions over a table far longer than the model's context, for the RLM harness.

Each task is a table of ``num_records`` records, one a line
(``record 0412 | city: Lisbon | amount: 37 | status: open``; about 60 characters each, so the
default 800 records are some 48,000 characters, about 12,000 tokens), generated from a seed,
and one question about it:

- ``needle``: the amount of one record (found by its number);
- ``count``: how many records have a given city and status;
- ``total``: the sum of the amounts of the records of a city.

The answer is computed from the table. The harness is :class:`flywheel.sdk.rlm.RLMHarness`: the
table is the REPL's ``context``, never the prompt, so a model answers by writing code (and, if it
likes, asking ``llm_query`` about pieces). ``repl=False`` is the baseline without the REPL: one
chat turn with the whole table in the prompt (as much of it as the model's context takes).
Reward ``correct``: the answer (``state["answer"]``; without the REPL, the reply's
``FINAL(...)`` or its last number; thousands separators and spaces ignored) is the expected
number. Metrics
``answered`` (the rollout ended with an answer), ``cells`` and ``sub_calls`` (what it ran).
Needs the sandbox service.
"""

from __future__ import annotations

import random
import re
from typing import Any

from flywheel.sdk.environment import Environment, Metric, Reward, TaskSet
from flywheel.sdk.harness import ChatHarness
from flywheel.sdk.rlm import RLMHarness, final_answer

CITIES = ("Lisbon", "Oslo", "Quito", "Hanoi", "Lagos", "Perth", "Lima", "Riga", "Dakar", "Osaka", "Tunis", "Cork")
STATUSES = ("open", "closed", "pending")
KINDS = ("needle", "count", "total")


def table(seed: int, num_records: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"id": i, "city": rng.choice(CITIES), "amount": rng.randint(1, 99), "status": rng.choice(STATUSES)}
            for i in range(1, num_records + 1)]


def render(records: list[dict[str, Any]]) -> str:
    return "".join(f"record {r['id']:04d} | city: {r['city']} | amount: {r['amount']} | status: {r['status']}\n"
                   for r in records)


def make_task(seed: int, num_records: int, kind: str) -> dict[str, Any]:
    records = table(seed, num_records)
    rng = random.Random(seed * 7919 + KINDS.index(kind))
    if kind == "needle":
        pick = rng.choice(records)
        question, answer = f"What is the amount of record {pick['id']:04d}?", pick["amount"]
    elif kind == "count":
        city, status = rng.choice(CITIES), rng.choice(STATUSES)
        question = f"How many records have city {city} and status {status}?"
        answer = sum(1 for r in records if r["city"] == city and r["status"] == status)
    else:
        city = rng.choice(CITIES)
        question = f"What is the total amount of the records with city {city}?"
        answer = sum(r["amount"] for r in records if r["city"] == city)
    context = render(records)
    return {"id": f"{kind}-{seed}", "kind": kind, "question": question, "answer": str(answer), "context": context}


def prompt(task: dict[str, Any]) -> str:
    lines = task["context"].count("\n")
    return (f"{task['question']}\n\nThe table is the variable `context`: {len(task['context'])} characters, "
            f"{lines} records, one a line, like\n{task['context'].splitlines()[0]}")


def _number(text: Any) -> str | None:
    if not isinstance(text, str):
        return None
    cleaned = re.sub(r"[\s,_]", "", text).strip("`'\".")
    return cleaned if re.fullmatch(r"-?\d+", cleaned) else None


DIRECT_PROMPT = "Answer the question about the table. End with FINAL(the number)."


def direct_prompt(task: dict[str, Any]) -> str:
    return f"{task['context']}\n{task['question']}"


def correct(state: dict[str, Any], completion: str, task: dict[str, Any]) -> float:
    if "cells" in state:  # the RLM harness ran: only its FINAL counts
        answer = state.get("answer")
    else:
        answer = final_answer(completion)
        if answer is None:
            numbers = re.findall(r"-?\d[\d,]*", completion)
            answer = numbers[-1] if numbers else None
    return float(_number(answer) == task["answer"])


def load_environment(num_tasks: int = 300, num_records: int = 800, kinds: tuple[str, ...] | list[str] = KINDS,
                     max_turns: int = 6, sub_max_tokens: int | None = None, repl: bool = True) -> Environment:
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"kinds={list(kinds)!r}: choose among {list(KINDS)}")
    if num_records < 10:
        raise ValueError(f"num_records={num_records}: at least 10")
    rows = [make_task(seed, num_records, kinds[seed % len(kinds)]) for seed in range(num_tasks)]
    return Environment(
        name="long_context",
        tasks=TaskSet.from_rows(rows, name="long_context tasks"),
        prompt=prompt if repl else direct_prompt,
        harness=RLMHarness(context="context", max_turns=max_turns, sub_max_tokens=sub_max_tokens) if repl
        else ChatHarness(system_prompt=DIRECT_PROMPT, max_turns=1),
        rewards=[Reward(correct),
                 Metric(lambda state: float(state.get("answer") is not None), name="answered"),
                 Metric(lambda state: float(state.get("cells", 0)), name="cells"),
                 Metric(lambda state: float(state.get("sub_calls", 0)), name="sub_calls")],
        description="questions over a table far longer than the model's context, answered with code (RLM)",
    )
