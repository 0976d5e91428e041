"""What every inference backend must do, checked the same way for each (transformers in
tests/unit, vLLM in tests/vllm)."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from flywheel.contract import events

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 23, 24]]


def full_forward_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int],
                          temperature: float) -> torch.Tensor:
    """The trainer's logprobs: log_softmax(logits / T) of ``completion`` from one unpadded
    forward, no cache."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1:-1]
    return logprobs.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def check_one_completion_per_prompt(backend: Any) -> None:
    """One completion per prompt, logprobs aligned with tokens, the right finish reason,
    text that decodes the tokens; no prompts, no completions."""
    out = backend.generate(PROMPTS, events.Sampling(max_tokens=6, seed=0))
    assert len(out) == len(PROMPTS)
    for c in out:
        assert 1 <= len(c.token_ids) <= 6 and len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0.0 for lp in c.logprobs)
        assert c.finish_reason == ("stop" if c.token_ids[-1] in backend.eos_ids else "length")
        assert c.text == backend.decode(c.token_ids)
    assert backend.generate([], events.Sampling()) == []


def check_tokens_are_called_back_as_sampled(backend: Any) -> None:
    """``on_token`` hears every row's tokens, in order, with their logprobs, as they are
    sampled: the rows' tokens interleave (step by step, not row by row once each is done)."""
    heard: list[tuple[int, int, float]] = []
    out = backend.generate(PROMPTS, events.Sampling(max_tokens=8, seed=2),
                           on_token=lambda row, token_id, logprob: heard.append((row, token_id, logprob)))
    for row, c in enumerate(out):
        assert [(t, lp) for r, t, lp in heard if r == row] == list(zip(c.token_ids, c.logprobs, strict=True))
    rows = [r for r, _, _ in heard]
    runs = 1 + sum(a != b for a, b in itertools.pairwise(rows))  # blocks of one row's tokens
    assert runs > len(PROMPTS) + 2, rows
    # The same tokens as without a listener.
    assert [c.token_ids for c in backend.generate(PROMPTS, events.Sampling(max_tokens=8, seed=2))] == [
        c.token_ids for c in out]
