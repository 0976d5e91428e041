"""wordle: feedback with repeated letters, guess parsing, rewards from the board, and whole
games through the chat harness against a scripted model."""

from __future__ import annotations

from pathlib import Path

import pytest

import wordle
from flywheel.sdk.environment import EnvironmentLoadError
from tests.helpers import num_tasks
from tests.scripted_openai import ScriptedOpenAI, make_rollout, run_rollout


@pytest.mark.parametrize(("guess", "answer", "marks"), [
    ("crane", "crane", "GGGGG"),
    ("crane", "trace", "YGGXG"),
    ("speed", "abide", "XXYXY"),   # two e's guessed, one in the word: only the first is marked
    ("eerie", "there", "YXYXG"),   # the exact match is served first: one e left for a Y
    ("llama", "hello", "YYXXX"),
    ("geese", "eerie", "XGYXG"),
    ("abbey", "babes", "YYGGX"),
    ("mamma", "maxim", "GGYXX"),
])
def test_feedback_handles_repeated_letters(guess: str, answer: str, marks: str) -> None:
    assert wordle.feedback(guess, answer) == marks


@pytest.mark.parametrize(("reply", "guess", "problem"), [
    ("I'll try <guess>Crane</guess>", "crane", ""),
    ("<guess>slate</guess> no wait <guess> crane </guess>", "crane", ""),
    ("crane", None, "no guess found"),
    ("<guess>cranes</guess>", None, "5-letter"),
    ("<guess>cr4ne</guess>", None, "5-letter"),
    ("<guess>crâne</guess>", None, "5-letter"),
    ("<guess></guess>", None, "5-letter"),
])
def test_parse_guess(reply: str, guess: str | None, problem: str) -> None:
    found, why = wordle.parse_guess(reply, None)
    assert found == guess and problem in why
    assert wordle.parse_guess("<guess>qzxvk</guess>", frozenset({"crane"})) == (None, "'qzxvk' is not in the word list")


def test_the_word_list_loads_and_can_be_swapped(tmp_path: Path) -> None:
    env = wordle.load_environment()
    rows = env.load_tasks(50, seed=0)
    assert len({r["answer"] for r in rows}) == 50 and num_tasks(env) > 500
    for row in rows:
        env.check_task(row)
        assert len(row["answer"]) == 5 and row["answer"].isalpha()
    assert [m.role for m in env.prompt_messages(rows[0])] == ["system", "user"]
    (tmp_path / "mine.txt").write_text("Plumb\nplumb\nquart\n")
    assert sorted(r["answer"] for r in wordle.load_environment(words_file=str(tmp_path / "mine.txt"))
                  .load_tasks(2)) == ["plumb", "quart"]
    (tmp_path / "bad.txt").write_text("plumbs\n")
    with pytest.raises(EnvironmentLoadError, match="plumbs"):
        wordle.load_environment(words_file=str(tmp_path / "bad.txt"))


async def test_rewards_read_the_board() -> None:
    env = wordle.load_environment()
    task = {"answer": "crane"}

    async def rewards(state: dict) -> dict[str, float]:
        rollout = make_rollout("wordle", task, [{"role": "assistant", "content": "<guess>crane</guess>"}], state)
        return {name: (await r(rollout)).value for name, r in env.rollout_rewards.items()}

    won_third = await rewards({"guesses": ["slate", "trace", "crane"], "feedback": ["XXGXG", "YGGYG", "GGGGG"],
                               "solved": True, "invalid": 1, "max_guesses": 6})
    assert won_third == {"solved": 1.0, "fewer_guesses": 4 / 6, "letters": 1.0, "valid_guesses": 0.75,
                         "num_guesses": 3.0, "num_invalid": 1.0}
    lost = await rewards({"guesses": ["slate"] * 6, "feedback": ["XXGXG"] * 6, "solved": False, "invalid": 0,
                          "max_guesses": 6})
    assert lost["solved"] == 0.0 and lost["fewer_guesses"] == 0.0 and lost["letters"] == 0.4
    nothing = await rewards({})  # a rollout that failed before the game began
    assert set(nothing.values()) == {0.0}


async def test_a_won_game_with_a_malformed_reply() -> None:
    env = wordle.load_environment()
    with ScriptedOpenAI({"agent": ["Start with common letters. <guess>slate</guess>", "crane!",
                                   "<guess>trace</guess>", "<guess>crane</guess>"]}) as server:
        rollout = await run_rollout(env, {"answer": "crane"}, server)
        said = [m["content"] for m in server.conversation("agent") if m["role"] == "user"]
    assert said[1:] == ["SLATE\nX X G X G\n5 guesses left.",
                        ("Invalid guess: no guess found: write your guess as <guess>word</guess>. "
                         "This did not use up a guess."),
                        "TRACE\nX G G Y G\n4 guesses left."]
    assert rollout.state["guesses"] == ["slate", "trace", "crane"] and rollout.state["solved"] is True
    assert rollout.state["stop_reason"] == "done" and rollout.state["turns"] == 4
    assert (await env.rollout_rewards["fewer_guesses"](rollout)).value == 4 / 6


async def test_games_end_when_guesses_or_patience_run_out() -> None:
    env = wordle.load_environment(max_guesses=2, max_invalid=1)
    with ScriptedOpenAI({"agent": ["<guess>slate</guess>", "<guess>trace</guess>", "?", "??"]}) as server:
        lost = await run_rollout(env, {"answer": "crane"}, server)
        rambling = await run_rollout(env, {"answer": "crane"}, server)
    assert lost.state["guesses"] == ["slate", "trace"] and lost.state["solved"] is False
    assert lost.state["stop_reason"] == "done"
    assert rambling.state["invalid"] == 2 and rambling.state["guesses"] == []
    assert rambling.state["stop_reason"] == "done"
    assert (await env.rollout_rewards["valid_guesses"](rambling)).value == 0.0
