"""long_context: questions over a table far longer than the model's context, for the RLM harness.

Each task is a table of ``num_records`` records, one a line
(``record 0412 | city: Lisbon | amount: 37 | status: open``; about 60 characters each, so the
default 800 records are some 44,000 characters, about 17,000 tokens of SmolLM2), generated from a seed,
and one question about it:

- ``needle``: the amount of one record (found by its number);
- ``count``: how many records have a given city and status;
- ``total``: the sum of the amounts of the records of a city.

The answer is computed from the table. The harness is :class:`flywheel.sdk.rlm.RLMHarness`: the
table is the REPL's ``context``, never the prompt, so a model answers by writing code (and, if it
likes, asking ``llm_query`` about pieces). ``repl=False`` is the baseline without the REPL: one
chat turn with the table in the prompt, whole, or cut to its first ``max_table_chars``
characters so that it fits the model's context (the prompt then says how many records it shows).
``shots=N`` puts N worked examples before the question (``examples``): for the REPL, a
question, the code that answers it (``solution_code``), the REPL's output and ``FINAL``; without
it, a small table, a question and ``FINAL``. Their tables come from seeds no task uses; their
kinds alternate, the question's kind last. A model too small to write REPL code from the
instructions alone copies the pattern (SmolLM2-135M does; docs/environments.md gives its figures).

Reward ``correct``: the answer (``state["answer"]``; without the REPL, the reply's
``FINAL(...)`` or its last number; thousands separators and spaces ignored) is the expected
number. Metrics ``answered`` (the rollout ended with a ``FINAL``), ``cells`` and ``sub_calls``
(what it ran).
Needs the sandbox service.
"""

from __future__ import annotations

import functools
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


_AMOUNT = 'int(line.split("amount: ")[1].split(" |")[0])'


def solution_code(task: dict[str, Any]) -> str:
    """Python that prints the answer of ``task`` from the REPL's ``context``: what an example shows."""
    question = task["question"]
    if task["kind"] == "needle":
        (number,) = re.findall(r"record (\d{4})", question)
        return (f'for line in context.splitlines():\n    if line.startswith("record {number} "):\n'
                f'        print({_AMOUNT})')
    if task["kind"] == "count":
        ((city, status),) = re.findall(r"city (\w+) and status (\w+)", question)
        return (f'print(sum(1 for line in context.splitlines() if "city: {city} |" in line '
                f'and "status: {status}" in line))')
    (city,) = re.findall(r"city (\w+)\?", question)
    return f'print(sum({_AMOUNT} for line in context.splitlines() if "city: {city} |" in line))'


EXAMPLE_SEED = 1_000_000  # examples' tables: seeds past any task's


def examples(shots: int, repl: bool, kind: str) -> list[dict[str, Any]]:
    """``shots`` worked examples as chat messages, kinds alternating, those of ``kind`` (the
    question's) last, nearest the question (see the module's doc)."""
    messages: list[dict[str, Any]] = []
    picked = [KINDS[i % len(KINDS)] for i in range(shots)]
    for i, shown in sorted(enumerate(picked), key=lambda pair: (pair[1] == kind, pair[0])):
        task = make_task(EXAMPLE_SEED + i, 200 if repl else 12, shown)
        if repl:
            messages += [{"role": "user", "content": prompt(task)},
                         {"role": "assistant", "content": f"```repl\n{solution_code(task)}\n```"},
                         {"role": "user", "content": f"REPL output:\n{task['answer']}"}]
        else:
            messages.append({"role": "user", "content": direct_prompt(task)})
        messages.append({"role": "assistant", "content": f"FINAL({task['answer']})"})
    return messages


def _number(text: Any) -> str | None:
    if not isinstance(text, str):
        return None
    cleaned = re.sub(r"[\s,_]", "", text).strip("`'\".")
    return cleaned if re.fullmatch(r"-?\d+", cleaned) else None


DIRECT_PROMPT = "Answer the question about the table. End with FINAL(the number)."


def direct_prompt(task: dict[str, Any], max_table_chars: int | None = None) -> str:
    """The table, then the question. ``max_table_chars``: the table's first whole records up to
    that many characters, and a line that says how many of how many were shown."""
    table_text = task["context"]
    if max_table_chars is not None and len(table_text) > max_table_chars:
        lines = table_text.splitlines(keepends=True)
        kept, size = 0, 0
        while kept < len(lines) and size + len(lines[kept]) <= max_table_chars:
            size += len(lines[kept])
            kept += 1
        table_text = "".join(lines[:kept]) + f"(the first {kept} of {len(lines)} records; the rest did not fit)\n"
    return f"{table_text}\n{task['question']}"


def correct(state: dict[str, Any], completion: str, task: dict[str, Any]) -> float:
    if "cells" in state:  # the RLM harness ran: only its FINAL counts
        answer = state.get("answer")
    else:
        answer = final_answer(completion)
        if answer is None:
            numbers = re.findall(r"-?\d[\d,]*", completion)
            answer = numbers[-1] if numbers else None
    return float(_number(answer) == task["answer"])


def answered(state: dict[str, Any], completion: str) -> float:
    """1 when the rollout ended with an answer: the RLM's FINAL, or the baseline reply's FINAL."""
    if "cells" in state:
        return float(state.get("answer") is not None)
    return float(final_answer(completion) is not None)


def load_environment(num_tasks: int = 300, num_records: int = 800, kinds: tuple[str, ...] | list[str] = KINDS,
                     max_turns: int = 6, sub_max_tokens: int | None = None, repl: bool = True,
                     shots: int = 0, max_table_chars: int | None = None) -> Environment:
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"kinds={list(kinds)!r}: choose among {list(KINDS)}")
    if num_records < 10:
        raise ValueError(f"num_records={num_records}: at least 10")
    if not 0 <= shots <= 30:
        raise ValueError(f"shots={shots}: from 0 to 30 worked examples")
    if max_table_chars is not None and (repl or max_table_chars < 100):
        raise ValueError(f"max_table_chars={max_table_chars}: only without the REPL (repl=false), at least 100")
    rows = [make_task(seed, num_records, kinds[seed % len(kinds)]) for seed in range(num_tasks)]
    question = prompt if repl else functools.partial(direct_prompt, max_table_chars=max_table_chars)
    return Environment(
        name="long_context",
        tasks=TaskSet.from_rows(rows, name="long_context tasks"),
        prompt=(lambda task: [*examples(shots, repl, task["kind"]), {"role": "user", "content": question(task)}])
        if shots else question,
        harness=RLMHarness(context="context", max_turns=max_turns, sub_max_tokens=sub_max_tokens) if repl
        else ChatHarness(system_prompt=DIRECT_PROMPT, max_turns=1),
        rewards=[Reward(correct),
                 Metric(answered),
                 Metric(lambda state: float(state.get("cells", 0)), name="cells"),
                 Metric(lambda state: float(state.get("sub_calls", 0)), name="sub_calls")],
        description="questions over a table far longer than the model's context, answered with code (RLM)",
    )
