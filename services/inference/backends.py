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
The transformers backend also opens sessions (:meth:`TransformersBackend.session`): batches
that rows join and leave between tokens (continuous batching, :class:`DecodeSession`);
``generate`` is one session with every row added at the start.

LoRA adapters: the transformers backend keeps any number of them over its base weights
(:attr:`TransformersBackend.adapters`, :mod:`flywheel_inference.adapters`), and
``generate(..., adapters=[name per row])`` samples each row with its own; runs on one base
share one backend that way (the vLLM backend too, with vLLM's LoRA support). Not covered:
top-k, logprobs of the alternatives (``top_logprobs``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from flywheel.contract import events
from flywheel.contract.config import BackendPart, InferenceConfig
from flywheel_inference.completion import Backend, Completion, OnRowToken, check_prompts, first_stop, row_seeds

if TYPE_CHECKING:
    import torch
    from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
    from transformers.cache_utils import DynamicLayer

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

    def clear_adapters(self) -> None:
        """Sample the next forward with the weights alone (no adapter set on any row)."""
        if self._adapters is not None:
            self._adapters.clear()

    def swap(self, data: bytes, version: int) -> None:
        from flywheel.sdk import models

        models.load_weights(self.model, data)
        self.version = version

    def generate(self, prompts: Sequence[Sequence[int]], sampling: events.Sampling,
                 seeds: Sequence[int | None] | None = None, on_token: OnRowToken | None = None,
                 adapters: Sequence[str | None] | None = None) -> list[Completion]:
        """``adapters``: per row, the name of a loaded adapter to sample it with (None: the weights alone)."""
        session = self.session(sampling, on_token)
        try:
            session.add(prompts, seeds, adapters)
            results: list[Completion | None] = [None] * len(prompts)
            while session.num_rows:
                for row, completion in session.step():
                    results[row] = completion
        finally:
            session.close()
        assert all(c is not None for c in results)
        return results  # type: ignore[return-value]  # the assert above: no None is left

    def session(self, sampling: events.Sampling, on_token: OnRowToken | None = None) -> DecodeSession:
        """A batch that rows may join between its steps (continuous batching): see :class:`DecodeSession`."""
        sampling.check()
        return DecodeSession(self, sampling, on_token)

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


@dataclass
class _Row:
    """One sequence of a :class:`DecodeSession`: its caller's index, its uniforms (one per token
    it may sample), its adapter, and what it sampled so far."""

    index: int
    uniforms: torch.Tensor
    adapter: str | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class DecodeSession:
    """Rows sampled together one token at a time, which rows may join between steps
    (continuous batching): a joining row's prompt is prefilled (a group's samples share it)
    and its keys and values are merged into the batch's cache, left-padded to the same length
    (the attention mask hides the padding; each row keeps its own position ids), so it is
    sampled in the same forward as the rows already running. A finished row leaves at once,
    its completion returned by the :meth:`step` that finished it, and padding no row needs any
    more is cut off. Rows of one session share the sampling settings (the caller batches by
    them); each row's random numbers are its own seed's, as in :meth:`TransformersBackend.generate`.
    Runs on the caller's thread; the caller holds the backend (no weight swap meanwhile).
    """

    def __init__(self, backend: TransformersBackend, sampling: events.Sampling, on_token: OnRowToken | None) -> None:
        self.backend = backend
        self.sampling = sampling
        self.on_token = on_token
        self.rows: list[_Row] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [rows, cache length] long, 1 on real tokens
        self.next_position: torch.Tensor | None = None  # [rows, 1]: where each row's next token goes
        self.logits: torch.Tensor | None = None  # [rows, vocab]: each row's next-token logits
        self._added = 0  # rows added so far: the index of the next one

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def can_join(self) -> bool:
        """Whether rows may join while others run: the cache's layers are plain (a sliding-window
        layer keeps a rolling window the merge does not align)."""
        from transformers.cache_utils import DynamicLayer

        return self.cache is None or all(type(layer) is DynamicLayer for layer in self.cache.layers)

    def add(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int | None] | None = None,
            adapters: Sequence[str | None] | None = None) -> list[int]:
        """Prefill ``prompts`` and join them to the batch; their indices (in the order added,
        counted over the session: what :meth:`step` returns them with)."""
        import torch

        backend, sampling = self.backend, self.sampling
        longest = check_prompts(prompts, sampling, backend.max_positions)
        if adapters is not None and len(adapters) != len(prompts):
            raise ValueError(f"adapters: {len(adapters)} given for {len(prompts)} prompts")
        if not prompts:
            return []
        if self.rows and not self.can_join:
            raise RuntimeError("this model's cache cannot take rows while others run (a sliding-window layer)")
        uniforms = [torch.rand(sampling.max_tokens, generator=torch.Generator().manual_seed(s))
                    for s in row_seeds(sampling, len(prompts), seeds)]
        names = list(adapters) if adapters is not None and any(a is not None for a in adapters) else None
        if names is not None:
            backend.adapters.set_rows(names)  # fails here, naming the adapter, if one is not loaded
        try:
            with torch.inference_mode():
                logits, cache, mask = backend._prefill(prompts, longest, names)
        finally:
            backend.clear_adapters()
        indices = list(range(self._added, self._added + len(prompts)))
        self._added += len(prompts)
        new_rows = [_Row(i, u, None if names is None else names[j])
                    for j, (i, u) in enumerate(zip(indices, uniforms, strict=True))]
        position = mask.sum(-1, keepdim=True)
        if self.cache is None or self.mask is None or self.next_position is None or self.logits is None:
            self.cache, self.mask, self.next_position, self.logits = cache, mask, position, logits
        else:
            self.mask = _join_caches(self.cache, self.mask, cache, mask)
            self.next_position = torch.cat([self.next_position, position])
            self.logits = torch.cat([self.logits, logits])
        self.rows += new_rows
        return indices

    def step(self) -> list[tuple[int, Completion]]:
        """Sample one token for every row, then run the rows that go on one position further;
        the rows that finished, with their completions."""
        import torch

        assert self.cache is not None and self.mask is not None and self.next_position is not None
        assert self.logits is not None
        backend, sampling = self.backend, self.sampling
        done: list[tuple[int, Completion]] = []
        with torch.inference_mode():
            step_logprobs = torch.log_softmax(self.logits.float() / sampling.temperature, dim=-1)
            uniforms = torch.stack([r.uniforms[len(r.token_ids)] for r in self.rows])
            picked = sample_rows(step_logprobs, sampling.top_p, uniforms)
            picked_logprobs = step_logprobs.gather(-1, picked[:, None])[:, 0]
            keep: list[int] = []
            for j, (row, tok, lp) in enumerate(zip(self.rows, picked.tolist(), picked_logprobs.tolist(), strict=True)):
                row.token_ids.append(tok)
                row.logprobs.append(lp)
                if self.on_token is not None:
                    self.on_token(row.index, tok, lp)
                finished = backend._finished(row.token_ids, row.logprobs, sampling.stop,
                                             len(row.token_ids) == sampling.max_tokens)
                if finished is None:
                    keep.append(j)
                else:
                    done.append((row.index, finished))
            if not keep:
                self.close()
                return done
            mask, next_position = self.mask, self.next_position
            if len(keep) < len(self.rows):
                index = torch.tensor(keep, device=backend.device)
                self.cache.batch_select_indices(index)
                mask, next_position, picked = mask[index], next_position[index], picked[index]
                self.rows = [self.rows[j] for j in keep]
                if self.can_join:  # plain layers: the padding no row needs is cut
                    mask = _trim_padding(self.cache, mask)
            names = [r.adapter for r in self.rows]
            if any(n is not None for n in names):
                backend.adapters.set_rows(names)
            try:
                mask = torch.cat([mask, mask.new_ones((len(self.rows), 1))], dim=-1)
                out = backend.model(input_ids=picked[:, None], attention_mask=mask, position_ids=next_position,
                                    use_cache=True, logits_to_keep=1, **{backend._cache_arg: self.cache})
            finally:
                backend.clear_adapters()
        self.logits, self.mask, self.next_position = out.logits[:, -1, :], mask, next_position + 1
        return done

    def close(self) -> None:
        """Drop the batch (its cache); rows not finished are abandoned."""
        self.rows, self.cache, self.mask, self.next_position, self.logits = [], None, None, None, None


def _join_caches(cache: DynamicCache, mask: torch.Tensor, joining: DynamicCache, joining_mask: torch.Tensor
                 ) -> torch.Tensor:
    """Append ``joining``'s rows to ``cache`` in place, the shorter of the two left-padded to the
    other's length (keys and values of zeros, masked out); the joined attention mask."""
    import torch

    length, joining_length = mask.shape[1], joining_mask.shape[1]
    width = max(length, joining_length)

    def left_pad(t: torch.Tensor, by: int) -> torch.Tensor:  # [B, H, S, D] or [B, S]
        if not by:
            return t
        shape = list(t.shape)
        shape[-2 if t.dim() == 4 else -1] = by
        return torch.cat([t.new_zeros(shape), t], dim=-2 if t.dim() == 4 else -1)

    for (layer, keys, values), (_, other_keys, other_values) in zip(_layers(cache), _layers(joining), strict=True):
        layer.keys = torch.cat([left_pad(keys, width - length), left_pad(other_keys, width - joining_length)])
        layer.values = torch.cat([left_pad(values, width - length), left_pad(other_values, width - joining_length)])
    return torch.cat([left_pad(mask, width - length), left_pad(joining_mask, width - joining_length)])


def _layers(cache: DynamicCache) -> list[tuple[DynamicLayer, torch.Tensor, torch.Tensor]]:
    """Each layer of ``cache`` with its keys and values; RuntimeError for a layer that is not a
    plain one holding them (:attr:`DecodeSession.can_join` keeps sessions off such caches)."""
    from transformers.cache_utils import DynamicLayer

    found = []
    for layer in cache.layers:
        if type(layer) is not DynamicLayer or layer.keys is None or layer.values is None:
            raise RuntimeError(f"a cache layer of type {type(layer).__name__} cannot be joined or trimmed")
        found.append((layer, layer.keys, layer.values))
    return found


def _trim_padding(cache: DynamicCache, mask: torch.Tensor) -> torch.Tensor:
    """Cut the leading cache positions that no remaining row attends to (left padding of rows
    that have left); the trimmed mask."""
    real = mask.any(0).nonzero()
    start = int(real[0]) if len(real) else 0
    if start == 0:
        return mask
    for layer, keys, values in _layers(cache):
        layer.keys, layer.values = keys[..., start:, :], values[..., start:, :]
    return mask[:, start:]


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
