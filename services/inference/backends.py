"""Inference backends: sample completions for token prompts, swap in new weights.

A backend does two things, behind one small interface (:class:`Backend`):

- ``generate(prompts, sampling, seeds)``: sample one completion per prompt (token ids in,
  token ids, log-probabilities and a finish reason out), all prompts as one batch;
- ``swap(data, version)``: load a full set of weights (safetensors bytes) in place and
  remember their version.

The caller serialises the two (a lock around each call), so weights never change in the
middle of a sequence. :data:`BACKENDS` maps the ``type`` of the run config's
``inference.backend`` to a builder, called as ``(model folder or hub id, model.dtype,
**the variant's other fields)``; a ``type`` that is a path (``"package.module:Name"``) is a
backend class of the user's own, built the same way (a test checks the config's variants
and this registry agree).

The log-probability of a sampled token is ``log_softmax(logits / temperature)`` at that
token, in float32, before top-p truncation: top-p only changes what is sampled. The
trainer computes the same quantity, so the importance ratio is exactly 1 when the weights
are the same.

Reproducibility: each sequence has its own random generator, seeded from ``seeds[i]``
(by default ``sampling.seed + i``, or fresh entropy when ``sampling.seed`` is None), which
draws its ``max_tokens`` uniforms up front (one per token), so a seeded sequence draws the
same random numbers whatever else is in its batch. The tokens
are the same for the same batch; in a different batch, padding changes the float
rounding of the logits, which can (rarely) flip a draw.

The ``vllm`` backend lives in :mod:`flywheel_inference.backend_vllm`, imported only when a
run asks for it (vLLM is in ``.venv-vllm`` on CPU, ``scripts/setup-vllm.sh``, or on a GPU
machine). Both the backend and the inference service on it are tested on CPU
(``tests/vllm``).

``generate``'s ``on_token`` is called with each row's token as it is sampled (streaming).

LoRA adapters: the transformers backend keeps any number of them over its base weights
(:attr:`TransformersBackend.adapters`, :mod:`flywheel_inference.adapters`), and
``generate(..., adapters=[name per row])`` samples each row with its own; runs on one base
share one backend that way (the vLLM backend too, with vLLM's LoRA support). Not covered:
top-k, logprobs of the alternatives (``top_logprobs``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from flywheel.contract import events
from flywheel.contract.config import BackendPart, InferenceConfig
from flywheel_inference.completion import Backend, Completion, OnRowToken, check_prompts, first_stop, row_seeds

if TYPE_CHECKING:
    import torch
    from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

    from flywheel_inference.adapters import AdapterSlots

def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Every id that ends a sequence: the tokenizer's EOS and the generation config's."""
    ids: set[int] = set()
    for value in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(value)
    if not ids:
        raise ValueError(f"model {model.name_or_path!r}: neither its tokenizer nor its generation config names an "
                         "eos_token_id, so no completion could end before max_tokens")
    return ids


# Below top_p 1, the nucleus is first looked for among this many most likely tokens of each row.
NUCLEUS_CANDIDATES = 1024


def sample_rows(logprobs: torch.Tensor, top_p: float, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row from ``exp(logprobs)``, restricted to the top-p nucleus.

    The nucleus is the smallest set of most likely tokens whose mass reaches ``top_p``
    (the most likely token is always in it). Row i picks by inverse-CDF sampling with
    ``uniforms[i]`` (in [0, 1)), so a row's pick does not depend on the others. With
    ``top_p`` 1 the CDF runs in vocabulary order (no sort: sorting a large vocabulary per
    step cost a quarter of sampling); below 1 it runs over the most likely tokens, the
    ``NUCLEUS_CANDIDATES`` most likely when they hold the nucleus of every row, else all.
    """
    import torch

    probs = logprobs.exp()
    order: torch.Tensor | None = None
    if top_p < 1.0:
        k = min(NUCLEUS_CANDIDATES, probs.shape[-1])
        probs, order = torch.topk(probs, k, dim=-1)  # sorted, most likely first
        if k < logprobs.shape[-1] and bool((probs.sum(-1) < top_p).any()):
            probs, order = torch.sort(logprobs.exp(), dim=-1, descending=True)
        mass_before = probs.cumsum(-1) - probs
        probs = probs.masked_fill(mass_before >= top_p, 0.0)
    cdf = probs.cumsum(-1)
    picks = torch.searchsorted(cdf, (uniforms.to(cdf.device) * cdf[:, -1])[:, None], right=True)
    picks = picks.clamp_(max=cdf.shape[-1] - 1)
    return (picks if order is None else order.gather(-1, picks))[:, 0]


class TransformersBackend:
    """A Hugging Face causal LM and its tokenizer, sampled by a batched loop with a KV cache.

    Prompts are left-padded; the attention mask and explicit position ids make each row
    compute what it would compute alone. Rows with the same prompt (a group's samples)
    share its prefill: it runs once and each row goes on from a copy of its keys and
    values. A finished row leaves the batch (and the cache) at once, so a long completion
    does not make the short ones pay for it.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: str = "cpu") -> None:
        import torch

        from flywheel.sdk import models

        self.device = torch.device(device)
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]  # @wraps on .to hides its self from mypy
        self.tokenizer = tokenizer
        self.version: int | None = None
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.max_positions: int | None = getattr(model.config, "max_position_embeddings", None)
        self._cache_arg = models.cache_argument(model)
        self._adapters: AdapterSlots | None = None

    @property
    def adapters(self) -> AdapterSlots:
        """The LoRA adapters loaded over this backend's weights (none until one is loaded)."""
        if self._adapters is None:
            from flywheel_inference.adapters import AdapterSlots

            self._adapters = AdapterSlots(self.model)
        return self._adapters

    @classmethod
    def build(cls, path: Path | str, dtype: str, device: str = "cpu") -> TransformersBackend:
        from flywheel.sdk import models

        model, tokenizer = models.load_model(path, dtype=dtype, device=device)
        return cls(model, tokenizer, device)

    def close(self) -> None:
        pass  # the model is plain process memory

    def swap(self, data: bytes, version: int) -> None:
        from flywheel.sdk import models

        models.load_weights(self.model, data)
        self.version = version

    def generate(self, prompts: Sequence[Sequence[int]], sampling: events.Sampling,
                 seeds: Sequence[int | None] | None = None, on_token: OnRowToken | None = None,
                 adapters: Sequence[str | None] | None = None) -> list[Completion]:
        """``adapters``: per row, the name of a loaded adapter to sample it with (None: the weights alone)."""
        import torch

        sampling.check()
        longest = check_prompts(prompts, sampling, self.max_positions)
        if adapters is not None and len(adapters) != len(prompts):
            raise ValueError(f"adapters: {len(adapters)} given for {len(prompts)} prompts")
        if not prompts:
            return []
        # Each row's uniforms, one per token it may sample, drawn up front from its own generator.
        uniforms = torch.stack([torch.rand(sampling.max_tokens, generator=torch.Generator().manual_seed(s))
                                for s in row_seeds(sampling, len(prompts), seeds)])
        names = list(adapters) if adapters is not None and any(a is not None for a in adapters) else None
        if names is not None:
            self.adapters.set_rows(names)  # fails here, naming the adapter, if one is not loaded
        try:
            with torch.inference_mode():
                return self._generate(prompts, sampling, uniforms, longest, on_token, names)
        finally:
            if self._adapters is not None:
                self._adapters.clear()

    def _generate(self, prompts: Sequence[Sequence[int]], sampling: events.Sampling, uniforms: torch.Tensor,
                  longest: int, on_token: OnRowToken | None, adapters: list[str | None] | None) -> list[Completion]:
        import torch

        num_rows = len(prompts)
        logits, cache, mask = self._prefill(prompts, longest, adapters)
        next_position = mask.sum(-1, keepdim=True)  # per row: where its next token goes
        rows = list(range(num_rows))  # the original index of each row still in the batch
        token_ids: list[list[int]] = [[] for _ in range(num_rows)]
        logprobs: list[list[float]] = [[] for _ in range(num_rows)]
        results: list[Completion | None] = [None] * num_rows
        for step in range(sampling.max_tokens):
            step_logprobs = torch.log_softmax(logits.float() / sampling.temperature, dim=-1)
            picked = sample_rows(step_logprobs, sampling.top_p, uniforms[rows, step])
            picked_logprobs = step_logprobs.gather(-1, picked[:, None])[:, 0]
            keep: list[int] = []
            last_step = step == sampling.max_tokens - 1
            for j, (r, tok, lp) in enumerate(zip(rows, picked.tolist(), picked_logprobs.tolist(), strict=True)):
                token_ids[r].append(tok)
                logprobs[r].append(lp)
                if on_token is not None:
                    on_token(r, tok, lp)
                results[r] = self._finished(token_ids[r], logprobs[r], sampling.stop, last_step)
                if results[r] is None:
                    keep.append(j)
            if not keep:
                break
            if len(keep) < len(rows):
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                mask, next_position, picked = mask[index], next_position[index], picked[index]
                rows = [rows[j] for j in keep]
                if adapters is not None:
                    self.adapters.set_rows([adapters[r] for r in rows])
            mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=-1)
            out = self.model(input_ids=picked[:, None], attention_mask=mask, position_ids=next_position,
                             use_cache=True, logits_to_keep=1, **{self._cache_arg: cache})
            logits = out.logits[:, -1, :]
            next_position = next_position + 1
        assert all(c is not None for c in results)
        return results  # type: ignore[return-value]  # the assert above: no None is left

    def _prefill(self, prompts: Sequence[Sequence[int]], longest: int,
                 adapters: list[str | None] | None) -> tuple[torch.Tensor, DynamicCache, torch.Tensor]:
        """Run each distinct prompt once (a group's samples share one; a prompt under two
        adapters is two): the logits of its last position, the cache and the attention mask,
        then one row per prompt in ``prompts`` (rows of one prompt get copies of its keys and
        values)."""
        import torch
        from transformers import DynamicCache

        names = adapters if adapters is not None else [None] * len(prompts)
        keys = [(name, tuple(p)) for name, p in zip(names, prompts, strict=True)]
        distinct = list(dict.fromkeys(keys))
        if adapters is not None:
            self.adapters.set_rows([name for name, _ in distinct])
        input_ids = torch.full((len(distinct), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(distinct), longest), dtype=torch.long)
        for i, (_, prompt) in enumerate(distinct):
            input_ids[i, longest - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[i, longest - len(prompt):] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, logits_to_keep=1, **{self._cache_arg: cache})
        logits = out.logits[:, -1, :]
        if len(distinct) < len(keys):
            index = {key: i for i, key in enumerate(distinct)}
            of_row = torch.tensor([index[key] for key in keys], device=self.device)
            cache.batch_select_indices(of_row)
            logits, mask = logits[of_row], mask[of_row]
        if adapters is not None:
            self.adapters.set_rows(adapters)
        return logits, cache, mask

    def _finished(self, token_ids: list[int], logprobs: list[float], stop: Sequence[str],
                  last_step: bool) -> Completion | None:
        """The completion if this row is done (EOS, a stop string, or max_tokens), else None."""
        if token_ids[-1] in self.eos_ids:
            return Completion(list(token_ids), list(logprobs), "stop", self.decode(token_ids))
        if stop:
            text = self.decode(token_ids)
            cut = first_stop(text, stop)
            if cut is not None:
                return Completion(list(token_ids), list(logprobs), "stop", text[:cut])
        if last_step:
            return Completion(list(token_ids), list(logprobs), "length", self.decode(token_ids))
        return None

    def decode(self, token_ids: list[int]) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence of ids decodes to one string (a batch to a list)
        return text


# (model folder or hub id, model.dtype, **the variant's fields) -> Backend
BackendBuilder = Callable[..., Backend]


def _build_vllm(path: Path | str, dtype: str, max_loras: int, max_lora_rank: int, lora: bool = False) -> Backend:
    # Imported here: vllm is only in .venv-vllm (scripts/setup-vllm.sh) or on a GPU
    # machine; without it, building fails with a message naming the package.
    from flywheel_inference.backend_vllm import VLLMBackend

    return VLLMBackend.build(path, dtype, max_loras=max_loras if lora else None, max_lora_rank=max_lora_rank)


BACKENDS: dict[str, BackendBuilder] = {
    "transformers": TransformersBackend.build,
    "vllm": _build_vllm,
}


def build_backend(backend: BackendPart | str, path: Path | str, dtype: str, lora: bool = False) -> Backend:
    """The backend a run config's ``inference.backend`` (or a bare type name) names, on the
    model at ``path``. ``lora``: it is the shared base of LoRA runs (vLLM's engine starts with
    LoRA on; the transformers backend keeps adapters whatever, a backend of the user's own
    merges them into a copy)."""
    part = InferenceConfig(backend=backend).backend if isinstance(backend, str) else backend
    if lora and part.type == "vllm":
        return part.bind(BACKENDS)(path, dtype, lora=True)
    return part.bind(BACKENDS)(path, dtype)
