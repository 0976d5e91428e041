"""reverse-text: the model is given a short lowercase string and answers with it reversed.

Small enough for a model of a few hundred thousand parameters to learn on a CPU in
minutes, which makes it the environment of the embedded training run. The reward is the
similarity of the answer to the reversed text (difflib's ratio, 0 to 1), so partial
answers earn partial credit; ``exact`` (weight 0 by default) reports exact matches.
"""

from __future__ import annotations

import difflib
import random
import string

SYSTEM_PROMPT = "Reverse the text."
ALPHABET = string.ascii_lowercase[:12]
MIN_CHARS, MAX_CHARS = 3, 6


def load_tasks(num_tasks: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(num_tasks):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(MIN_CHARS, MAX_CHARS)))
        rows.append({"text": text})
    return rows


def prompt(task: dict) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["text"]}]


def reference(task: dict) -> str:
    return task["text"][::-1]


def similarity(completion: str, task: dict) -> float:
    return difflib.SequenceMatcher(None, completion.strip(), reference(task)).ratio()


def exact(completion: str, task: dict) -> float:
    return float(completion.strip() == reference(task))


REWARDS = {"similarity": (similarity, 1.0), "exact": (exact, 0.0)}
