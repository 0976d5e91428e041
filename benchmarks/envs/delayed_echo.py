"""delayed-echo: the benchmark environment of ``benchmarks/async_vs_sync.py``.

The model echoes a lowercase string; then the environment takes its turn (in agentic RL:
a tool call, a sandbox run, a user simulator answering) for a time drawn from a
heavy-tailed distribution, while the rollout keeps its inference slot. Both sources of
rollout time are heavy-tailed and seeded, so two runs with the same seed see the same mix:

- generated length: the text's length is Pareto-distributed (most strings are a few
  letters, a few are long), and the model learns in the SFT warm-up to echo it;
- environment time: each task draws a scale (lognormal: some tasks are slow), each of its
  rollouts a jitter around it (lognormal), capped at ``MAX_WAIT_S``.

The environment's turn is the chat harness's ``env_response``: awaited after the model's
answer, while the rollout holds its admission slot; it ends the rollout.
Importable by name once this folder is on ``PYTHONPATH`` (the benchmark sets it for the
services it starts). Not a training environment: the reward (similarity to the text) only
keeps the trainer honest.
"""

from __future__ import annotations

import asyncio
import difflib
import math
import random
import string

from flywheel.sdk.environment import Environment, Reward, TaskSet
from flywheel.sdk.harness import ChatHarness, RolloutContext

SYSTEM_PROMPT = "Echo the text."
ALPHABET = string.ascii_lowercase[:12]
MAX_CHARS = 40
WAIT_MEDIAN_S = 0.5  # median of a task's scale
WAIT_SIGMA = 1.0  # lognormal sigma of the task scale: the heavy tail
JITTER_SIGMA = 0.4  # lognormal sigma of one rollout around its task's scale
MAX_WAIT_S = 12.0
NUM_WAITS = 16  # waits drawn per task; rollout i takes wait_s[i % NUM_WAITS]


def generate(num_tasks: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(num_tasks):
        length = min(MAX_CHARS, int(2 * rng.paretovariate(1.3)))
        text = "".join(rng.choice(ALPHABET) for _ in range(length))
        scale = rng.lognormvariate(math.log(WAIT_MEDIAN_S), WAIT_SIGMA)
        wait_s = [round(min(MAX_WAIT_S, scale * rng.lognormvariate(0.0, JITTER_SIGMA)), 4) for _ in range(NUM_WAITS)]
        rows.append({"text": text, "wait_s": wait_s})
    return rows


def similarity(completion: str, task: dict) -> float:
    return difflib.SequenceMatcher(None, completion.strip(), task["text"]).ratio()


async def environment_turn(task: dict, ctx: RolloutContext) -> None:
    """The environment's turn after the model answered: it waits as a tool or sandbox would, then ends."""
    await asyncio.sleep(task["wait_s"][ctx.index % len(task["wait_s"])])


def load_environment() -> Environment:
    return Environment(
        name="delayed_echo",
        tasks=TaskSet.from_generator(generate, schema={"text": str, "wait_s": list}),
        harness=ChatHarness(system_prompt=SYSTEM_PROMPT, max_turns=1, env_response=environment_turn),
        prompt=lambda task: task["text"],
        reference=lambda task: task["text"],
        rewards=[Reward(similarity)],
    )
