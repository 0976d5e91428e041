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

:func:`top_k_divergence` is the dense on-policy distillation term (an ``opd`` advantage with
a ``*_top_k`` estimate), which the learner adds beside these. :func:`ratio_clipped`,
:func:`cispo` and :func:`gspo` are the training API's ``ppo``, ``cispo`` and ``gspo``
(:mod:`flywheel_trainer.adapter_host`), which take the ratio's bounds themselves. Not covered:
entropy bonuses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (logprobs, sampled logprobs, advantages, **the variant's fields) -> (per-token loss, per-token clipped)
LossFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def clipped(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
            clip_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return ratio_clipped(torch.exp(logprobs - old_logprobs), advantages, 1.0 - clip_eps, 1.0 + clip_eps)


def ratio_clipped(ratio: torch.Tensor, advantages: torch.Tensor, low: float | torch.Tensor,
                  high: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's surrogate with the ratio's bounds given as such: ``-min(ratio * A, clip(ratio, low,
    high) * A)`` per token, and which tokens the clip held."""
    unclipped_obj = ratio * advantages
    clipped_obj = _clamp(ratio, low, high) * advantages
    return -torch.minimum(unclipped_obj, clipped_obj), clipped_obj < unclipped_obj


def _clamp(x: torch.Tensor, low: float | torch.Tensor, high: float | torch.Tensor) -> torch.Tensor:
    return torch.clamp(x, torch.as_tensor(low, dtype=x.dtype), torch.as_tensor(high, dtype=x.dtype))


def cispo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, low: float | torch.Tensor,
          high: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO: ``-sg(clip(ratio, low, high)) * A * logprob`` per token. The clip bounds the
    importance weight, not the gradient: every token keeps its gradient (PPO's clip drops it)."""
    ratio = torch.exp(logprobs - old_logprobs)
    weight = _clamp(ratio, low, high).detach()
    return -weight * advantages * logprobs, weight != ratio.detach()


def gspo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, low: float | torch.Tensor,
         high: float | torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (its token form): one ratio a sequence, the geometric mean of its tokens' ratios over
    ``mask`` (``exp(mean(logprob - old))``), clipped PPO-style per token with the token's own
    advantage; each token's gradient is the sequence ratio's times its own logprob's, as GSPO-token
    has it (``sg(s) * exp(logprob - sg(logprob))``)."""
    count = mask.sum().clamp(min=1)
    sequence = torch.exp(((logprobs - old_logprobs) * mask).sum() / count).detach()
    ratio = sequence * torch.exp(logprobs - logprobs.detach())
    loss, held = ratio_clipped(ratio, advantages, low, high)
    return loss * mask, held & mask.bool()


def masked(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
           clip_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    ratio = torch.exp(logprobs - old_logprobs)
    outside = (ratio < 1.0 - clip_eps) | (ratio > 1.0 + clip_eps)
    return torch.where(outside, torch.zeros_like(ratio), -ratio * advantages), outside


LOSSES: dict[str, LossFn] = {"clipped": clipped, "masked": masked}

TAIL_FLOOR = 1e-6  # the least probability a distribution's tail bucket (what its top-k leave) is given


def top_k_divergence(logprobs: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor,
                     valid: torch.Tensor, forward: torch.Tensor) -> torch.Tensor:
    """The KL between a teacher's and the policy's distributions at each of ``N`` positions, over
    the teacher's top-k tokens and one bucket for the rest of the vocabulary (each side's
    probability outside those tokens, at least :data:`TAIL_FLOOR`): KL(teacher || policy) where
    ``forward``, else KL(policy || teacher); ``[N]``.

    ``logprobs``: the policy's log-softmax ``[N, V]``; ``top_ids``, ``top_logprobs``: the
    teacher's tokens and logprobs ``[N, K]``; ``valid``: ``[N, K]`` which of those are real (a
    teacher may give fewer than ``K``); ``forward``: ``[N]`` bool. Differentiable in
    ``logprobs``. The forward KL is cross-entropy to the teacher's distribution (less its
    entropy): mode-covering; the reverse KL is mode-seeking, the exact form of what the sampled
    estimate (``estimate = "sampled"``) approximates with one token."""
    student = torch.where(valid, logprobs.gather(-1, top_ids), torch.zeros_like(top_logprobs))
    teacher = torch.where(valid, top_logprobs, torch.zeros_like(top_logprobs))

    def with_tail(lp: torch.Tensor) -> torch.Tensor:
        mass = (lp.exp() * valid).sum(-1)
        return torch.cat([lp, torch.log((1.0 - mass).clamp(min=TAIL_FLOOR))[:, None]], dim=-1)

    student_b, teacher_b = with_tail(student), with_tail(teacher)
    real = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=-1)
    forward_kl = (teacher_b.exp() * (teacher_b - student_b) * real).sum(-1)
    reverse_kl = (student_b.exp() * (student_b - teacher_b) * real).sum(-1)
    return torch.where(forward, forward_kl, reverse_kl)
