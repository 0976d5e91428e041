"""Policy-gradient losses, token by token, against the logprobs inference sampled with.

Chosen by ``trainer.loss`` in the run config, e.g.
``loss = {type = "clipped", clip_eps = 0.2}``: its ``type`` is a key of :data:`LOSSES`, or
the path of a function of the user's own, and its other fields are keyword arguments (a
test checks the config's variants and this registry agree). Rollouts are sampled
asynchronously, by weights up to ``max_off_policy_steps`` versions old, so every loss is
importance-weighted: ``ratio = exp(logprob_now - logprob_sampled)`` per token, where
``logprob_sampled`` is what inference recorded (``log_softmax(logits / temperature)``) and
``logprob_now`` is the same quantity under the weights being trained.

- ``clipped``: PPO's clipped surrogate, ``-min(ratio * A, clip(ratio, 1-eps, 1+eps) * A)``
  with ``eps = clip_eps``: a token stops pushing once its ratio has moved ``eps`` in the
  direction its advantage wants.
- ``masked``: the plain importance-weighted gradient ``-ratio * A``, with every token whose
  ratio lies outside ``[1-eps, 1+eps]`` masked out (no gradient at all, either direction).

Each entry returns the per-token loss and which tokens were clipped or masked; the caller
sums the loss over loss-mask tokens and divides by the number of loss tokens in the whole
optimizer step, so a long completion weighs more than a short one token for token, and
micro-batches add up to the same gradient as one big batch.

Not covered: KL penalties against a reference model, entropy bonuses, sequence-level
ratios (GSPO).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (logprobs, sampled logprobs, advantages, **the variant's fields) -> (per-token loss, per-token clipped)
LossFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def clipped(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
            clip_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped_obj = ratio * advantages
    clipped_obj = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    return -torch.minimum(unclipped_obj, clipped_obj), clipped_obj < unclipped_obj


def masked(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
           clip_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    ratio = torch.exp(logprobs - old_logprobs)
    outside = (ratio < 1.0 - clip_eps) | (ratio > 1.0 + clip_eps)
    return torch.where(outside, torch.zeros_like(ratio), -ratio * advantages), outside


LOSSES: dict[str, LossFn] = {"clipped": clipped, "masked": masked}
