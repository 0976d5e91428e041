"""wordle: the multi-turn hello world. The model guesses a secret five-letter word; after each
guess the environment answers with the usual feedback, until it is found or the guesses run out.

Each reply must hold one guess as ``<guess>word</guess>`` (reasoning around it is allowed).
Feedback marks each letter ``G`` (right letter, right place), ``Y`` (in the word, elsewhere) or
``X`` (not in the word, or no more of it left), with repeated letters handled as the game does:
exact matches first, then "elsewhere" marks left to right while the secret still holds an
unmatched copy of the letter. A reply without a well-formed guess (no tag, wrong length,
non-letters, or a word outside ``allowed_words`` when a list is given) gets a message that
says what was wrong and costs no guess; ``max_invalid`` of them are tolerated over the game.

The board lives in the rollout's state: ``guesses``, ``feedback``, ``solved``, ``invalid``,
``max_guesses``. Rewards: ``solved`` (1 or 0), ``fewer_guesses`` (weight 0.25: 1 for a first
guess win down to 1/max_guesses for a last guess win), ``letters`` (weight 0.1: partial credit
from the last guess's marks, G = 1, Y = 0.5, over five), ``valid_guesses`` (weight 0.1: the
share of replies that held a well-formed guess); metrics ``num_guesses`` and ``num_invalid``.
No reference answer: the best opening guess is not an answer to the task.
"""

from __future__ import annotations

import re
from collections import Counter
from importlib.resources import files
from pathlib import Path
from typing import Any

from flywheel.sdk.environment import Environment, EnvironmentLoadError, Metric, Reward, TaskSet
from flywheel.sdk.harness import ChatHarness

WORD_LENGTH = 5
SYSTEM_PROMPT = """You are playing Wordle. Find the secret {length}-letter English word in at most {max_guesses} \
guesses.

After each guess you get one mark per letter:
G: the letter is in the word, in this position.
Y: the letter is in the word, in another position.
X: the letter is not in the word (or not as many times as you used it).

Think as much as you like, then give exactly one guess per reply, written as <guess>word</guess>."""

_GUESS = re.compile(r"<guess>(.*?)</guess>", re.IGNORECASE | re.DOTALL)


def feedback(guess: str, answer: str) -> str:
    """The marks of ``guess`` against ``answer`` (lowercase, same length), e.g. ``"GXYXX"``."""
    marks = ["X"] * len(guess)
    unmatched = Counter(a for g, a in zip(guess, answer, strict=True) if g != a)
    for i, (g, a) in enumerate(zip(guess, answer, strict=True)):
        if g == a:
            marks[i] = "G"
        elif unmatched[g] > 0:
            marks[i] = "Y"
            unmatched[g] -= 1
    return "".join(marks)


def parse_guess(reply: str, allowed: frozenset[str] | None) -> tuple[str | None, str]:
    """(guess, "") for a well-formed reply, else (None, what was wrong, for the model)."""
    found = _GUESS.findall(reply)
    if not found:
        return None, "no guess found: write your guess as <guess>word</guess>"
    guess = found[-1].strip().lower()
    if len(guess) != WORD_LENGTH or not guess.isascii() or not guess.isalpha():
        return None, f"{found[-1].strip()!r} is not a {WORD_LENGTH}-letter word of letters a-z"
    if allowed is not None and guess not in allowed:
        return None, f"{guess!r} is not in the word list"
    return guess, ""


def read_words(path: Path) -> list[str]:
    words = [w.strip().lower() for w in path.read_text().split()]
    bad = [w for w in words if len(w) != WORD_LENGTH or not w.isascii() or not w.isalpha()]
    if bad or not words:
        raise EnvironmentLoadError(f"wordle: {path} must hold {WORD_LENGTH}-letter words of a-z, one a line "
                                   f"(bad: {bad[:5] if bad else 'the file is empty'})")
    return sorted(set(words))


class Game:
    """The rules of one game: the harness's setup and env_response, and the board in ``state``."""

    def __init__(self, max_guesses: int, max_invalid: int, allowed: frozenset[str] | None) -> None:
        self.max_guesses = max_guesses
        self.max_invalid = max_invalid
        self.allowed = allowed

    def setup(self, state: dict[str, Any]) -> None:
        state.update(guesses=[], feedback=[], solved=False, invalid=0, max_guesses=self.max_guesses)

    def respond(self, messages: list[dict[str, Any]], state: dict[str, Any], task: dict[str, Any]) -> str | None:
        """Feedback on the latest guess, or None when the game is over."""
        guess, problem = parse_guess(messages[-1].get("content") or "", self.allowed)
        if guess is None:
            state["invalid"] += 1
            if state["invalid"] > self.max_invalid:
                return None
            return f"Invalid guess: {problem}. This did not use up a guess."
        marks = feedback(guess, task["answer"])
        state["guesses"].append(guess)
        state["feedback"].append(marks)
        if guess == task["answer"]:
            state["solved"] = True
            return None
        left = self.max_guesses - len(state["guesses"])
        if left == 0:
            return None
        return f"{guess.upper()}\n{' '.join(marks)}\n{left} guess{'es' if left > 1 else ''} left."


# --- rewards: read from the board ---------------------------------------------------------


def solved(state: dict) -> float:
    return float(bool(state.get("solved")))


def fewer_guesses(state: dict) -> float:
    if not state.get("solved"):
        return 0.0
    max_guesses = state["max_guesses"]
    return (max_guesses - len(state["guesses"]) + 1) / max_guesses


def letters(state: dict) -> float:
    if not state.get("feedback"):
        return 0.0
    last = state["feedback"][-1]
    return (last.count("G") + 0.5 * last.count("Y")) / len(last)


def valid_guesses(state: dict) -> float:
    num_valid = len(state.get("guesses", []))
    total = num_valid + state.get("invalid", 0)
    return num_valid / total if total else 0.0


def num_guesses(state: dict) -> float:
    return float(len(state.get("guesses", [])))


def num_invalid(state: dict) -> float:
    return float(state.get("invalid", 0))


def load_environment(max_guesses: int = 6, max_invalid: int = 2, words_file: str | None = None,
                     allowed_words_file: str | None = None) -> Environment:
    """``words_file``: secret words, one a line (default: the packaged list of common words);
    ``allowed_words_file``: when given, guesses must come from it (the secret words are added);
    otherwise any five letters are a guess."""
    if max_guesses < 1 or max_invalid < 0:
        raise EnvironmentLoadError(f"wordle: max_guesses={max_guesses} (at least 1), max_invalid={max_invalid} "
                                   f"(at least 0)")
    words = read_words(Path(words_file) if words_file else Path(str(files(__name__) / "words.txt")))
    allowed = frozenset(read_words(Path(allowed_words_file))) | frozenset(words) if allowed_words_file else None
    game = Game(max_guesses, max_invalid, allowed)
    return Environment(
        name="wordle",
        tasks=TaskSet.from_rows([{"answer": w} for w in words], schema={"answer": str}, name="wordle words"),
        harness=ChatHarness(system_prompt=SYSTEM_PROMPT.format(length=WORD_LENGTH, max_guesses=max_guesses),
                            setup=game.setup, env_response=game.respond, max_turns=max_guesses + max_invalid),
        prompt=lambda task: f"Make your first guess. You have {max_guesses} guesses.",
        rewards=[Reward(solved), Reward(fewer_guesses, weight=0.25), Reward(letters, weight=0.1),
                 Reward(valid_guesses, weight=0.1), Metric(num_guesses), Metric(num_invalid)],
        sampling={"temperature": 1.0, "max_tokens": 1024},
        version="0.1.0",
        description=__doc__.split("\n\n")[0],
    )
