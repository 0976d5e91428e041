"""From token sequences to tensors, and the logprobs the trainer recomputes on them.

Each rollout is one sequence (its token spans concatenated, see
:func:`flywheel_trainer.join.tokens_of`). A micro-batch pads its sequences on the right
and masks the padding out of attention, so every real position sees exactly the tokens
before it, as during sampling. Targets are shifted by one: position ``t`` of the
logits predicts token ``t + 1``, so the loss mask, the sampled logprobs and the
recomputed logprobs are all ``[batch, length - 1]`` and line up with the *target* token.

:func:`token_logprobs` computes what inference records for a sampled token,
``log_softmax(logits / temperature)`` in float32, each sequence at the temperature it was
sampled with (a task may set its own), so under the same weights the ratio is 1 up to
float rounding (tests hold the difference under 1e-3).

:func:`micro_batches` sorts sequences by length before cutting them into micro-batches,
so sequences of like length share one and little compute goes to padding. Not covered:
packing several sequences into one row (it needs per-sequence attention masks the
default attention path does not take).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flywheel_trainer.join import Tokens


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] long, right-padded
    attention_mask: torch.Tensor  # [B, T] long, 1 on real tokens
    loss_mask: torch.Tensor  # [B, T-1] bool, by target token
    old_logprobs: torch.Tensor  # [B, T-1] float32, by target token (what inference sampled with)
    advantages: torch.Tensor  # [B] float32
    temperatures: torch.Tensor  # [B] float32, what each sequence was sampled at

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


def pad(sequences: list[Tokens], advantages: list[float], pad_id: int, device: torch.device | str = "cpu",
        temperatures: list[float] | None = None) -> Batch:
    """Right-pad ``sequences`` into one :class:`Batch` on ``device``; ``temperatures``: what each
    was sampled at (None: 1.0 each, as for reference answers)."""
    temperatures = temperatures if temperatures is not None else [1.0] * len(sequences)
    assert sequences and len(sequences) == len(advantages) == len(temperatures)
    length = max(len(s.token_ids) for s in sequences)
    rows = len(sequences)
    input_ids = torch.full((rows, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, length), dtype=torch.long)
    loss_mask = torch.zeros((rows, length), dtype=torch.bool)
    old_logprobs = torch.zeros((rows, length), dtype=torch.float32)
    for i, s in enumerate(sequences):
        n = len(s.token_ids)
        input_ids[i, :n] = torch.tensor(s.token_ids, dtype=torch.long)
        attention_mask[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
        old_logprobs[i, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
    return Batch(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        loss_mask=loss_mask[:, 1:].to(device),
        old_logprobs=old_logprobs[:, 1:].to(device),
        advantages=torch.tensor(advantages, dtype=torch.float32, device=device),
        temperatures=torch.tensor(temperatures, dtype=torch.float32, device=device),
    )


def micro_batches(sequences: list[Tokens], size: int) -> list[list[int]]:
    """Indices of ``sequences`` in micro-batches of at most ``size``, longest first."""
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i].token_ids))
    return [order[i:i + size] for i in range(0, len(order), size)]


def token_logprobs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` of each target token, float32, ``[B, T-1]``, each
    row at its own sequence's temperature."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    logprobs = torch.log_softmax(logits.float() / batch.temperatures[:, None, None], dim=-1)
    return logprobs.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
