"""reverse-text: the model is given a short lowercase string and answers with it reversed.

Small enough for a model of a few hundred thousand parameters to learn on a CPU in
minutes, which makes it the environment of the embedded training run. The reward is the
similarity of the answer to the reversed text (difflib's ratio, 0 to 1), so partial
answers earn partial credit; ``exact`` (a metric: weight 0) reports exact matches.
One chat turn, no tools: the default harness.
"""

from __future__ import annotations

import difflib
import random
import string

from flywheel.sdk.environment import Environment, Metric, Reward, TaskSet
from flywheel.sdk.harness import ChatHarness

SYSTEM_PROMPT = "Reverse the text."
ALPHABET = string.ascii_lowercase[:12]
MIN_CHARS, MAX_CHARS = 3, 6


def generate(num: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"text": "".join(rng.choice(ALPHABET) for _ in range(rng.randint(MIN_CHARS, MAX_CHARS)))}
            for _ in range(num)]


def prompt(task: dict) -> str:
    return task["text"]


def reference(task: dict) -> str:
    return task["text"][::-1]


def similarity(completion: str, task: dict) -> float:
    return difflib.SequenceMatcher(None, completion.strip(), reference(task)).ratio()


def exact(completion: str, task: dict) -> float:
    return float(completion.strip() == reference(task))


def load_environment() -> Environment:
    return Environment(
        name="reverse_text",
        tasks=TaskSet.from_generator(generate, schema={"text": str}),
        harness=ChatHarness(system_prompt=SYSTEM_PROMPT, max_turns=1),
        prompt=prompt,
        reference=reference,
        rewards=[Reward(similarity, inline=True), Metric(exact, inline=True)],  # string comparisons: microseconds
        version="0.1.0",
        description=__doc__.split("\n\n")[0],
    )
