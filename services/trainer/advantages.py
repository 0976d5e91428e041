"""Advantages: how a group's rewards become one number per rollout.

Chosen by ``trainer.advantage`` in the run config, e.g.
``advantage = {type = "group_mean", normalize_std = true}``: its ``type`` is a key of
:data:`ADVANTAGES`, or the path of a function of the user's own, and its other fields are
keyword arguments (a test checks the config's variants and this registry agree). Every
entry takes the rewards of one group (the rollouts of one task, compared with each other)
and returns one advantage per rollout, in the same order; every token a rollout sampled
gets its rollout's advantage. Plain Python: a group holds a handful of floats.

- ``group_mean``: the group's mean reward is the baseline (GRPO); with
  ``normalize_std`` the result is divided by the group's standard deviation (population
  std, plus a small epsilon so a group of equal rewards gives zeros, not NaNs).
- ``leave_one_out``: each rollout's baseline is the mean of the *other* rollouts' rewards
  (RLOO), an unbiased baseline; a group of one has no other rollout and gets 0.

- ``opd`` (on-policy distillation): ``reward_weight`` x ``group_mean``; the part's per-token
  term, ``coef`` x (the teacher's logprob - the sampled logprob) on every sampled token less
  its mean over the step's sampled tokens, is added by :func:`flywheel_trainer.learner.rl_step`
  from the teacher's signal (as is a run's ``trainer.kl`` term).

Not covered: advantages from a learned value function, per-token rewards.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

STD_EPS = 1e-6

# (rewards of one group, **the variant's fields) -> one advantage per rollout
AdvantageFn = Callable[..., list[float]]


def _population_std(values: Sequence[float], mean: float) -> float:
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def _scaled(advantages: list[float], rewards: Sequence[float], normalize_std: bool) -> list[float]:
    if not normalize_std:
        return advantages
    std = _population_std(rewards, sum(rewards) / len(rewards))
    return [a / (std + STD_EPS) for a in advantages]


def group_mean(rewards: Sequence[float], normalize_std: bool = False) -> list[float]:
    assert rewards, "a group has at least one rollout"
    mean = sum(rewards) / len(rewards)
    return _scaled([r - mean for r in rewards], rewards, normalize_std)


def leave_one_out(rewards: Sequence[float], normalize_std: bool = False) -> list[float]:
    assert rewards, "a group has at least one rollout"
    n = len(rewards)
    if n == 1:
        return [0.0]
    total = sum(rewards)
    return _scaled([r - (total - r) / (n - 1) for r in rewards], rewards, normalize_std)


def opd(rewards: Sequence[float], reward_weight: float = 0.0, normalize_std: bool = False) -> list[float]:
    """On-policy distillation's rewards part: ``reward_weight`` x the group-mean advantage (its
    per-token part, from the teacher's logprobs, is added token by token by the learner)."""
    return [reward_weight * a for a in group_mean(rewards, normalize_std)]


ADVANTAGES: dict[str, AdvantageFn] = {"group_mean": group_mean, "leave_one_out": leave_one_out, "opd": opd}
