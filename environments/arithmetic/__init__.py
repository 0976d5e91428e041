"""arithmetic: integer arithmetic problems with a verified answer.

Each task is an expression such as ``(17 - 5) * 3 + 48 / 6``, generated from a seed at one of
three difficulties (``easy``: two or three small terms, ``+ - *``; ``medium``: up to four terms
with exact division; ``hard``: nested parentheses, larger numbers, negatives). The answer is
computed exactly (``fractions.Fraction``) and is always an integer.

The model may reason, then ends with ``Answer: <number>``. The verifier reads the number after
the last ``Answer:`` or "the answer is" (failing that, ``\\boxed{...}``, or the last number of
the reply), tolerating thousands separators, a Unicode minus, markdown emphasis and ``12.0``
for 12; anything else is wrong, never an error. Rewards: ``correct`` (1 or 0),
``shortest_correct`` (a group reward, weight 0.1: the shortest correct reply of the group gets
it, a pressure against runaway length); metrics ``formatted`` (the answer was stated as one,
not left as a bare number), ``chars``, and ``closeness``: partial credit, 1 for the right
number and falling linearly to 0 at an error of the answer's size plus 10 (a model too small
to get answers exactly right can still learn their size: give it a weight in the run's
``[rewards.closeness]`` or its ``[[envs]]`` table's ``rewards``).
One chat turn, no tools. ``reference(task)`` is the bare answer line, for a supervised warm-up.
"""

from __future__ import annotations

import operator
import random
import re
from fractions import Fraction

from flywheel.sdk.environment import Environment, EnvironmentLoadError, Metric, Reward, TaskSet, shortest_correct_reward
from flywheel.sdk.harness import ChatHarness

SYSTEM_PROMPT = ("Solve the arithmetic problem. Use the usual order of operations; division is exact. "
                 "Think briefly if you need to, then end with a last line of the form `Answer: <integer>`.")

# difficulty -> (number of terms, largest operand, operators, parentheses)
DIFFICULTIES = {
    "easy": ((2, 3), 20, "+-*", False),
    "medium": ((3, 4), 50, "+-*/", False),
    "hard": ((4, 6), 200, "+-*/", True),
}

_NUMBER = r"[-\u2212\u2013]?\s*\d[\d,]*(?:\.\d+)?"  # a hyphen, a minus sign or an en dash
_DECORATION = r"[\s*_`]*"  # markdown emphasis and code marks around the answer
_ANSWER_LINE = re.compile(r"answer(?:\s+is)?" + _DECORATION + "[:=]?" + _DECORATION + "(" + _NUMBER + ")",
                          re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{\s*(" + _NUMBER + r")\s*\}")
_ANY_NUMBER = re.compile(_NUMBER)


# --- tasks ----------------------------------------------------------------------------------


def _flat(rng: random.Random, num_terms: int, largest: int, ops: str) -> str:
    """Terms joined by operators, no parentheses: precedence decides."""
    text = str(rng.randint(1, largest))
    for _ in range(num_terms - 1):
        op = rng.choice(ops)
        # Products stay readable, and a division has a fair chance to be exact.
        right = rng.randint(2, 12) if op == "/" else rng.randint(1, min(largest, 25) if op == "*" else largest)
        text = f"{text} {op} {right}"
    return text


def _nested(rng: random.Random, num_terms: int, largest: int, ops: str) -> tuple[str, Fraction, int]:
    """A random expression tree: (text, exact value, precedence of its top operator; 3 for a number).
    Parentheses appear only where they change the meaning."""
    if num_terms == 1:
        n = rng.randint(1, largest)
        return (f"({-n})", Fraction(-n), 3) if rng.random() < 0.15 else (str(n), Fraction(n), 3)
    split = rng.randint(1, num_terms - 1)
    left, left_value, left_prec = _nested(rng, split, largest, ops)
    right, right_value, right_prec = _nested(rng, num_terms - split, largest, ops)
    op = rng.choice(ops)
    if op == "/" and (right_value == 0 or (left_value / right_value).denominator != 1):
        op = "*"
    if op == "*" and abs(left_value * right_value) > 100_000:
        op = rng.choice("+-")
    prec = 2 if op in "*/" else 1
    if left_prec < prec:
        left = f"({left})"
    if right_prec < prec or (right_prec == prec and op in "-/"):
        right = f"({right})"
    return f"{left} {op} {right}", _apply(op, left_value, right_value), prec


_OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def _apply(op: str, left: Fraction, right: Fraction) -> Fraction:
    return _OPERATIONS[op](left, right)


def evaluate(expression: str) -> Fraction:
    """The exact value of an expression of integers, ``+ - * /`` and parentheses."""
    tokens = re.findall(r"\d+|[-+*/()]", expression)
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def atom() -> Fraction:
        token = take()
        if token == "(":
            value = expr()
            take()
            return value
        if token == "-":
            return -atom()
        return Fraction(int(token))

    def product() -> Fraction:
        value = atom()
        while peek() in ("*", "/"):
            value = _apply(take(), value, atom())
        return value

    def expr() -> Fraction:
        value = product()
        while peek() in ("+", "-"):
            value = _apply(take(), value, product())
        return value

    return expr()


def generate(difficulty: str):
    def rows(num: int, seed: int) -> list[dict]:
        rng = random.Random(f"arithmetic-{difficulty}-{seed}")
        out: list[dict] = []
        while len(out) < num:
            (low, high), largest, ops, nested = DIFFICULTIES[difficulty]
            num_terms = rng.randint(low, high)
            text = _nested(rng, num_terms, largest, ops)[0] if nested else _flat(rng, num_terms, largest, ops)
            value = evaluate(text)
            if value.denominator == 1:
                out.append({"question": text, "answer": str(value.numerator), "difficulty": difficulty})
        return out

    rows.__qualname__ = f"arithmetic_{difficulty}"
    return rows


# --- verifying ------------------------------------------------------------------------------


def parse_answer(text: str) -> Fraction | None:
    """The number the reply gives as its answer, or None when there is none."""
    for pattern in (_ANSWER_LINE, _BOXED):
        found = pattern.findall(text)
        if found:
            return _number(found[-1])
    found = _ANY_NUMBER.findall(text)
    return _number(found[-1]) if found else None


def _number(raw: str) -> Fraction | None:
    cleaned = re.sub(r"\s", "", raw).replace("\u2212", "-").replace("\u2013", "-").replace(",", "")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def is_correct(completion: str, task: dict) -> bool:
    return parse_answer(completion) == Fraction(int(task["answer"]))


def correct(completion: str, task: dict) -> float:
    return float(is_correct(completion, task))


def closeness(completion: str, task: dict) -> float:
    """1 for the right number, less the further the given one is from it: 0 at an error of
    ``|answer| + 10`` or more, and when the reply gives no number."""
    got = parse_answer(completion)
    if got is None:
        return 0.0
    want = int(task["answer"])
    return float(max(Fraction(0), 1 - abs(got - want) / (abs(want) + 10)))


def formatted(completion: str) -> float:
    """1.0 when the reply ends its reasoning with an ``Answer:`` line holding a number."""
    return float(bool(_ANSWER_LINE.search(completion)))


def chars(completion: str) -> float:
    return float(len(completion))


def prompt(task: dict) -> str:
    return f"What is {task['question']}?"


def reference(task: dict) -> str:
    return f"Answer: {task['answer']}"


def load_environment(difficulty: str = "medium", max_tokens: int = 512, shortest_correct_weight: float = 0.1,
                     system_prompt: str = SYSTEM_PROMPT) -> Environment:
    """``difficulty``: easy, medium or hard; ``max_tokens``: the default reply budget;
    ``system_prompt``: the instructions (a small model with a short context does better with
    short ones)."""
    if difficulty not in DIFFICULTIES:
        raise EnvironmentLoadError(f"arithmetic: difficulty={difficulty!r}; use one of {', '.join(DIFFICULTIES)}")
    return Environment(
        name="arithmetic",
        tasks=TaskSet.from_generator(generate(difficulty), schema={"question": str, "answer": str, "difficulty": str}),
        harness=ChatHarness(system_prompt=system_prompt, max_turns=1),
        prompt=prompt,
        reference=reference,
        rewards=[Reward(correct), shortest_correct_reward(is_correct, weight=shortest_correct_weight),
                 Metric(formatted), Metric(chars), Metric(closeness)],
        sampling={"temperature": 1.0, "max_tokens": max_tokens},
        version="0.1.0",
        description=__doc__.split("\n\n")[0],
    )
