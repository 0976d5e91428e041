"""What every inference backend shares: the :class:`Backend` interface, the
:class:`Completion` it returns, and the checks and helpers both backends apply the same way
(sampling settings, prompt lengths, per-sequence seeds, stop strings). The backends
themselves are in :mod:`flywheel_inference.backends` (transformers, and the registry) and
:mod:`flywheel_inference.backend_vllm`.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from flywheel.contract import events

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FinishReason = Literal["stop", "length"]
# (row of the batch, token id, logprob): called from the backend's thread as each token is sampled
OnRowToken = Callable[[int, int, float], None]


@dataclass(frozen=True)
class Completion:
    """One sampled completion. ``token_ids`` include the end-of-sequence token when the
    model produced one, and every token of a stop string; ``text`` is the decoded
    completion without special tokens, cut before the stop string that ended it."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str


class Backend(Protocol):
    tokenizer: PreTrainedTokenizerBase
    version: int | None  # the version of the loaded weights; None before the first swap
    max_positions: int | None  # prompt plus completion tokens the model can attend to

    def generate(self, prompts: Sequence[Sequence[int]], sampling: events.Sampling,
                 seeds: Sequence[int | None] | None = None, on_token: OnRowToken | None = None) -> list[Completion]:
        """One completion per prompt, sampled as one batch; ``on_token`` (when given) is called
        with each row's tokens as they are sampled, in order."""
        ...

    def swap(self, data: bytes, version: int) -> None: ...

    def close(self) -> None:
        """Release what the backend holds outside this process's memory (engine processes)."""
        ...


def check_prompts(prompts: Sequence[Sequence[int]], sampling: events.Sampling, max_positions: int | None) -> int:
    """Refuse empty prompts and prompts that leave no room for ``max_tokens``; returns the
    longest prompt's length (0 when there are no prompts)."""
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompts[{i}] is empty: a completion needs at least one prompt token")
    longest = max((len(p) for p in prompts), default=0)
    if prompts and max_positions is not None and longest + sampling.max_tokens > max_positions:
        raise ValueError(f"sampling.max_tokens={sampling.max_tokens} plus the longest prompt ({longest} tokens) "
                         f"exceeds the model's context of {max_positions} positions")
    return longest


def row_seeds(sampling: events.Sampling, num_rows: int, seeds: Sequence[int | None] | None) -> list[int]:
    """One seed per sequence: ``seeds`` if given, else ``sampling.seed + i``, else fresh entropy."""
    if seeds is not None:
        if len(seeds) != num_rows:
            raise ValueError(f"seeds: {len(seeds)} given for {num_rows} prompts")
        return [s if s is not None else secrets.randbits(63) for s in seeds]
    if sampling.seed is not None:
        return [sampling.with_seed_offset(i).seed or 0 for i in range(num_rows)]
    return [secrets.randbits(63) for _ in range(num_rows)]


def first_stop(text: str, stop: Sequence[str]) -> int | None:
    """Where the earliest stop string starts in ``text`` (None if none occurs)."""
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(found) if found else None
