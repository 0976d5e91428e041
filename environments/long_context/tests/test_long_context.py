"""long_context with the RLM harness against a real sandbox service (local backend) over a real
nats-server and a scripted model: code that reads the table answers right and gets reward 1,
``llm_query`` reaches the model from inside the sandbox as a call of its own (asked once, however
often the cells replay), variables persist between turns, errors come back as tracebacks, and
a reply with neither code nor an answer is told what to do. The tasks' answers are checked
against the tables they come with."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

import long_context
from flywheel.sdk.rlm import NUDGE, final_answer
from tests.sandbox_fixtures import sandboxed_rollout
from tests.sandbox_service import ServedSandboxClient

RECORD = re.compile(r"record (\d{4}) \| city: (\w+) \| amount: (\d+) \| status: (\w+)")


def test_every_kind_of_question_is_answered_by_its_table() -> None:
    env = long_context.load_environment(num_tasks=30, num_records=200)
    for task in env.load_tasks(30):
        rows = [RECORD.fullmatch(line).groups() for line in task["context"].splitlines()]  # type: ignore[union-attr]
        assert len(rows) == 200
        if task["kind"] == "needle":
            (number,) = re.findall(r"record (\d{4})", task["question"])
            expected = next(amount for n, _, amount, _ in rows if n == number)
        elif task["kind"] == "count":
            city, status = re.findall(r"city (\w+) and status (\w+)", task["question"])[0]
            expected = str(sum(1 for _, c, _, s in rows if (c, s) == (city, status)))
        else:
            (city,) = re.findall(r"city (\w+)\?", task["question"])
            expected = str(sum(int(a) for _, c, a, _ in rows if c == city))
        assert task["answer"] == expected, task["question"]
        assert task["context"] not in long_context.prompt(task) and "200 records" in long_context.prompt(task)
    assert {t["kind"] for t in env.load_tasks(30)} == set(long_context.KINDS)
    rlm = {"cells": 1}
    assert long_context.correct(rlm | {"answer": " 1,234 "}, "", {"answer": "1234"}) == 1.0
    assert long_context.correct(rlm | {"answer": "about 1234"}, "", {"answer": "1234"}) == 0.0
    assert long_context.correct(rlm, "it is 1", {"answer": "1"}) == 0.0  # with the REPL, only its FINAL counts
    # Without the REPL: the reply's FINAL(...), else its last number.
    assert long_context.correct({}, "It is FINAL(1,234).", {"answer": "1234"}) == 1.0
    assert long_context.correct({}, "7 records, so 12", {"answer": "12"}) == 1.0
    assert long_context.correct({}, "no idea", {"answer": "1"}) == 0.0
    assert long_context.answered(rlm | {"answer": "3"}, "") == 1.0 and long_context.answered(rlm, "FINAL(3)") == 0.0
    assert long_context.answered({}, "so FINAL(3)") == 1.0 and long_context.answered({}, "3") == 0.0
    direct = long_context.load_environment(num_tasks=3, num_records=20, repl=False)
    row = direct.load_tasks(1)[0]
    assert row["context"] in direct.first_messages(row)[-1].content and direct.harness is not None
    assert type(direct.harness).__name__ == "ChatHarness"
    with pytest.raises(ValueError, match="kinds=\\['sum'\\]: choose among"):
        long_context.load_environment(kinds=["sum"])


def test_worked_examples_run_to_their_answers_and_the_cut_table_says_so() -> None:
    """Each example's code, run on its table as the REPL runs it, prints the answer it shows;
    the question's kind comes last; the baseline's table is cut at whole records."""
    env = long_context.load_environment(num_tasks=6, num_records=60, shots=7)
    for task in env.load_tasks(6):
        messages = [m.content for m in env.first_messages(task)]
        assert len(messages) == 7 * 4 + 1 and messages[-1] == long_context.prompt(task)
        shown_kinds = []
        for question, reply, output, final in zip(*[iter(messages[:-1])] * 4, strict=True):
            shown = next(t for i in range(7) for k in long_context.KINDS
                         if (t := long_context.make_task(long_context.EXAMPLE_SEED + i, 200, k))["question"]
                         in question and long_context.prompt(t) == question)
            (code,) = re.findall(r"```repl\n(.*)\n```", reply, re.DOTALL)
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(code, {"context": shown["context"]})  # the environment's own example code, as the REPL runs it
            assert printed.getvalue().strip() == shown["answer"] and output == f"REPL output:\n{shown['answer']}"
            assert final == f"FINAL({shown['answer']})"
            shown_kinds.append(shown["kind"])
        assert shown_kinds[-2:] == [task["kind"]] * 2 and sorted(shown_kinds) == sorted(
            long_context.KINDS[i % 3] for i in range(7))
    direct = long_context.load_environment(num_tasks=2, num_records=100, repl=False, shots=2, max_table_chars=500)
    task = direct.load_tasks(1)[0]
    *shots, asked = [m.content for m in direct.first_messages(task)]
    assert len(shots) == 4 and shots[1].startswith("FINAL(") and "record 0012 |" in shots[0]
    records = asked.split("(the first ")[0].splitlines()
    lines = task["context"].splitlines(keepends=True)
    assert records == [line.rstrip("\n") for line in lines[:len(records)]]  # whole records, from the first
    assert len("".join(lines[:len(records)])) <= 500 < len("".join(lines[:len(records) + 1]))
    assert f"(the first {len(records)} of 100 records; the rest did not fit)" in asked and task["question"] in asked
    with pytest.raises(ValueError, match="max_table_chars=500: only without the REPL"):
        long_context.load_environment(max_table_chars=500)
    with pytest.raises(ValueError, match="shots=31: from 0 to 30"):
        long_context.load_environment(shots=31)


async def test_code_reads_the_table_and_asks_the_model_about_a_piece(sandbox: ServedSandboxClient) -> None:
    env = long_context.load_environment(num_tasks=3, num_records=300, kinds=["needle"])
    task = env.load_tasks(1)[0]
    (number,) = re.findall(r"record (\d{4})", task["question"])
    code = ("```repl\nimport re\n"
            f"line = next(l for l in context.splitlines() if l.startswith('record {number} '))\n"
            "answer = re.search(r'amount: (\\d+)', line).group(1)\n"
            "city = llm_query('Which city is this? ' + line)\n"
            "print(len(context.splitlines()), city)\n```")
    rollout, server = await sandboxed_rollout(env, task, [code, "Somewhere", "FINAL_VAR(answer)"], sandbox)
    assert rollout.state["answer"] == task["answer"] and long_context.correct(rollout.state, "", task) == 1.0
    assert rollout.state["cells"] == 1 and rollout.state["sub_calls"] == 1
    main, sub, last = server.requests
    (asked,) = sub["messages"]  # a conversation of its own: the piece it was given, nothing else
    assert asked["role"] == "user" and asked["content"].startswith(f"Which city is this? record {number} | city:")
    assert last["messages"][-1] == {"role": "user", "content": "REPL output:\n300 Somewhere"}
    assert task["context"] not in str(main["messages"])  # the table never enters the prompt
    assert not sandbox.manager.sessions


async def test_variables_persist_errors_come_back_and_sub_calls_are_asked_once(sandbox: ServedSandboxClient) -> None:
    env = long_context.load_environment(num_tasks=3, num_records=50)
    task = env.load_tasks(1)[0]
    script = ["Let me think about it.",
              "```repl\nx = 1 / 0\n```",
              "```repl\nfirst = llm_query('hello?')\ny = 41\n```",
              "hi there",  # the sub-call's answer
              "```python\nprint(y + 1, first)\n```",
              "The answer: FINAL(42)"]
    rollout, server = await sandboxed_rollout(env, task, script, sandbox)
    replies = [r["messages"][-1]["content"] for r in server.requests if len(r["messages"]) > 1][1:]
    assert replies[0] == NUDGE
    assert "ZeroDivisionError: division by zero" in replies[1] and replies[1].startswith("REPL output:")
    assert replies[2] == "REPL output: (nothing printed)"
    assert replies[3] == "REPL output:\n42 hi there"  # cell 3 replayed with its cached answer: not asked again
    assert len(server.requests) == 6 and rollout.state["sub_calls"] == 1 and rollout.state["cells"] == 3
    assert rollout.state["answer"] == "42" and rollout.state["stop_reason"] == "done"


def test_a_final_answer_is_read_up_to_its_own_parenthesis() -> None:
    assert final_answer("So FINAL(42) (I counted).") == "42"
    assert final_answer("FINAL( f(3) )") == "f(3)"
    assert final_answer("FINAL(unclosed 7") == "unclosed 7"
    assert final_answer("no answer; FINAL_VAR(x) is another form") is None
