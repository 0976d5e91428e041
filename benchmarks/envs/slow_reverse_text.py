"""slow-reverse-text: reverse-text whose reward takes a heavy-tailed time, for ``benchmarks/vs_trl.py``.

The tasks, prompts and reward values are reverse-text's; only the reward's latency differs:
each rollout's similarity waits ``min(CAP_S, exp(N(ln MEDIAN_S, SIGMA)))`` seconds first
(lognormal, median 50 ms, capped at 1 s), as a remote judge, a test suite or a sandbox
would. The wait is drawn from the rollout's id (the same waits in every run of a seed).
The TRL side of the benchmark (``benchmarks/trl_grpo.py --latency lognormal``) draws from
the same distribution. Importable by name once this folder is on ``PYTHONPATH`` (the
benchmark sets it for the services it starts).
"""

from __future__ import annotations

import asyncio
import math
import random

import reverse_text
from flywheel.contract import events
from flywheel.sdk.environment import Environment, Metric, Reward

MEDIAN_S = 0.05
SIGMA = 1.0
CAP_S = 1.0


def latency_s(key: str) -> float:
    return min(CAP_S, math.exp(random.Random(key).gauss(math.log(MEDIAN_S), SIGMA)))


async def similarity(completion: str, task: dict, rollout: events.Rollout) -> float:
    await asyncio.sleep(latency_s(rollout.id))
    return reverse_text.similarity(completion, task)


def load_environment() -> Environment:
    base = reverse_text.load_environment()
    return Environment(
        name="slow_reverse_text",
        tasks=base.tasks,
        harness=base.harness,
        prompt=reverse_text.prompt,
        reference=reverse_text.reference,
        rewards=[Reward(similarity), Metric(reverse_text.exact)],
        version="0.1.0",
        description=__doc__.split("\n\n")[0],
    )
