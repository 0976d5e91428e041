"""wiki_search: the corpus and its questions, ranking, the tools' answers to good and bad calls,
answer matching, and a search-read-answer rollout through the chat harness against a
scripted model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import wiki_search
from flywheel.sdk.environment import EnvironmentLoadError
from flywheel.sdk.harness import RolloutContext
from tests.helpers import num_tasks
from tests.scripted_openai import ScriptedOpenAI, ScriptEntry, make_rollout, run_rollout, tool_call

TASK = {"id": "baikal-outflow", "question": "What is the only river that flows out of Lake Baikal?",
        "answer": "Angara", "aliases": ["Angara River"], "docs": ["lake_baikal"]}


@pytest.fixture(scope="module")
def env():
    return wiki_search.load_environment()


def library(docs_dir: Path | None = None, top_k: int = 5) -> wiki_search.Library:
    return wiki_search.Library(wiki_search.read_corpus(docs_dir or Path(wiki_search.__file__).parent / "docs"), top_k)


def test_every_question_names_documents_that_rank_for_it(env) -> None:
    rows, ranking = env.load_tasks(env.tasks.size), library()
    assert len(rows) == env.tasks.size >= 25 and len({r["id"] for r in rows}) == len(rows)
    for row in rows:
        env.check_task(row)
        top = [doc_id for doc_id, _, _ in ranking.ranked(row["question"])]
        assert any(d in top for d in row["docs"]), (row["id"], top)  # the corpus can answer it
        assert wiki_search.correct(f"Answer: {row['answer']}", row) == 1.0
    assert [m.role for m in env.prompt_messages(TASK)] == ["system", "user"]


def test_the_tools_answer_good_and_bad_calls() -> None:
    lib = library(top_k=2)
    ctx = RolloutContext(task=TASK, base_url="", api_key="", model="")
    found = lib.search("river flowing out of Lake Baikal", ctx)
    assert found.startswith("1. [lake_baikal] Lake Baikal") and found.count("\n") == 3
    assert lib.search("xyzzy plugh", ctx) == "No document matches 'xyzzy plugh'. Try other keywords."
    with pytest.raises(wiki_search.ToolError, match="empty"):
        lib.search("  ", ctx)
    page = lib.read_document("[lake_baikal]", ctx)
    assert page.startswith("[lake_baikal] page 1 of 1") and "Angara" in page
    with pytest.raises(wiki_search.ToolError, match="no document 'atlantis'"):
        lib.read_document("atlantis", ctx)
    with pytest.raises(wiki_search.ToolError, match="page=2 is out of range"):
        lib.read_document("lake_baikal", ctx, page=2)
    assert ctx.state == {"searches": ["river flowing out of Lake Baikal", "xyzzy plugh"],
                         "seen": ctx.state["seen"], "read": ["lake_baikal"]}


def test_a_swapped_corpus_with_long_documents(tmp_path: Path) -> None:
    (tmp_path / "handbook").mkdir()
    long_text = "\n\n".join(f"Section {i}. " + "Filler words about nothing much. " * 30 for i in range(8))
    (tmp_path / "handbook" / "vacation.md").write_text(f"# Vacation policy\n\n{long_text}\n\nStaff get 30 days.")
    (tmp_path / "notes.txt").write_text("Parking is free on weekends.")
    row = {"id": "days", "question": "How many vacation days?", "answer": "30", "aliases": [],
           "docs": ["handbook/vacation"]}
    (tmp_path / "tasks.jsonl").write_text(json.dumps(row) + "\n")
    assert num_tasks(wiki_search.load_environment(docs_dir=str(tmp_path))) == 1
    lib = library(tmp_path)
    assert sorted(lib.docs) == ["handbook/vacation", "notes"] and lib.docs["notes"].title == "notes"
    ctx = RolloutContext(task=row, base_url="", api_key="", model="")
    assert "[handbook/vacation] Vacation policy" in lib.search("vacation days staff", ctx)
    last = lib.read_document("handbook/vacation", ctx, page=3)
    assert "page 3 of 3" in last and last.endswith("30 days.")
    (tmp_path / "tasks.jsonl").write_text(json.dumps({**row, "docs": ["handbook/sick_leave"]}) + "\n")
    with pytest.raises(EnvironmentLoadError, match="sick_leave"):
        wiki_search.load_environment(docs_dir=str(tmp_path))
    with pytest.raises(EnvironmentLoadError, match="no tasks_file given"):
        wiki_search.load_environment(docs_dir=str(tmp_path / "handbook"))
    with pytest.raises(EnvironmentLoadError, match="not a folder"):
        wiki_search.load_environment(docs_dir=str(tmp_path / "nowhere"), tasks_file=str(tmp_path / "tasks.jsonl"))


@pytest.mark.parametrize(("reply", "correct", "exact"), [
    ("The Angara flows out.\nAnswer: Angara", 1.0, 1.0),
    ("Answer: the Angara River.", 1.0, 1.0),
    ("Answer: **Angara**", 1.0, 1.0),
    ("Answer: it is the Angara, which joins the Yenisei", 1.0, 0.0),
    ("Angara", 1.0, 1.0),
    ("Answer: Selenga", 0.0, 0.0),
    ("Answer: Selenga, Angara, Yenisei, Lena, Ob, Irtysh, Amur, Volga", 0.0, 0.0),  # a list is not an answer
    ("", 0.0, 0.0),
])
def test_answer_matching(reply: str, correct: float, exact: float) -> None:
    assert wiki_search.correct(reply, TASK) == correct and wiki_search.exact(reply, TASK) == exact
    numbers = {"answer": "8849", "aliases": ["8848.86"]}
    assert wiki_search.correct("Answer: 8,849 metres", numbers) == 1.0
    assert wiki_search.correct("Answer: 8,848.86 m", numbers) == 1.0
    assert wiki_search.correct("Answer: 884886", numbers) == 0.0


async def test_rewards_on_hand_made_rollouts(env) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": TASK["question"]},
                {"role": "assistant", "content": "Answer: Angara River"}]
    values = {name: (await r(make_rollout("wiki_search", TASK, messages, {"searches": ["baikal"],
                                                                          "seen": ["lake_baikal"]}))).value
              for name, r in env.rollout_rewards.items()}
    assert values == {"correct": 1.0, "exact": 1.0, "f1": 1.0, "read_source": 1.0, "num_searches": 1.0}
    assert (await env.rollout_rewards["f1"](make_rollout("wiki_search", TASK, [
        {"role": "assistant", "content": "Answer: the Angara and the Selenga"}]))).value == pytest.approx(0.5)


async def test_a_search_read_answer_rollout(env) -> None:
    script: list[ScriptEntry] = [tool_call("search", query="Baikal outflow river"),
              tool_call("read_document", doc_id="lake_baikal", page=3),
              tool_call("read_document", doc_id="lake_baikal"),
              tool_call("lookup", term="Angara"),
              {"content": "", "tool_calls": [{"id": "bad", "type": "function",
                                              "function": {"name": "search", "arguments": "{not json"}}]},
              "The lake has one outflow.\nAnswer: Angara"]
    with ScriptedOpenAI({"agent": script}) as server:
        rollout = await run_rollout(env, TASK, server)
        tools = server.requests_for("agent")[0]["tools"]
    assert sorted(t["function"]["name"] for t in tools) == ["read_document", "search"]
    said = [m["content"] for m in server.conversation("agent") if m["role"] == "tool"]
    assert said[0].startswith("1. [lake_baikal]")
    assert said[1] == "error: 'lake_baikal' has 1 page(s); page=3 is out of range"
    assert "only one river flows out: the Angara" in said[2]
    assert said[3].startswith("error: no tool named 'lookup'") and said[4].startswith("error: arguments of search")
    assert rollout.state["stop_reason"] == "done" and rollout.state["read"] == ["lake_baikal"]
    values = {name: (await r(rollout)).value for name, r in env.rollout_rewards.items()}
    assert values["correct"] == 1.0 and values["read_source"] == 1.0 and values["num_searches"] == 1.0
