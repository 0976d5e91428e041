"""Many LoRA adapters over one loaded base model, each row of a batch with its own.

Runs that train an adapter (``trainer.adapter``) over the same base share one copy of it in
an inference process. :class:`AdapterSlots` wraps the base's adapted linear layers (as
they are named in the adapter: ``model.layers.0.self_attn.q_proj``) in :class:`RowLora`
once, and keeps each run's adapter (its A and B per layer, cast to the model's dtype and
device) by name. A forward pass runs with one adapter name (or None: the base alone) per
row; each wrapped layer adds, to the rows of each adapter,

    scale * (x A^T) B^T

the same sum the trainer's peft layer computes (base output plus the low-rank path, not a
merged weight), so the logprobs inference records are the ones the trainer recomputes.
The rows of one adapter are one segment of the batch (a slice when they are contiguous, as
the batching loop queues them, else an index), and each segment costs two matmuls of its
own adapter's rank: a row never computes another adapter's columns. (Every adapter's
columns side by side in one matrix, with a per-row mask, is two matmuls whatever the number
of adapters, but each row then pays for all of them: 15% of a batch on SmolLM2-135M with
four rank-16 adapters, against half that by segments.) Loading a new version of an adapter
writes it into the old version's tensors where the shapes are the same (no allocation: 24 ms
against 29 ms for a SmolLM2-135M rank-16 adapter), else replaces them; the caller (the
batching loop's lock) keeps loads and evictions from happening during a forward pass. A
backend's ``generate(..., adapters=...)`` sets the rows (:meth:`AdapterSlots.set_rows`)
before each forward pass.

:class:`AdapterView` is one run's :class:`~flywheel_inference.completion.Backend` on a
shared base: its swaps load that run's adapter, its version is the run's, and its close
evicts the adapter. The base's batching loop is shared too
(:class:`flywheel_inference.policy.Batcher`), which is what puts rows of different runs
in one batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flywheel.contract import events
from flywheel.sdk import models
from flywheel_inference.completion import Completion, OnRowToken

if TYPE_CHECKING:
    from flywheel_inference.backends import TransformersBackend

# The rows of one adapter in a batch: a slice when contiguous, else their indices.
Rows = slice | torch.Tensor


@dataclass(frozen=True)
class Adapter:
    """One loaded adapter: by layer path, A transposed (in x rank) and B transposed with the
    scale alpha / rank folded in (rank x out), ready for ``(x @ a) @ b``."""

    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def rank(self) -> int:
        return next(iter(self.layers.values()))[0].shape[1] if self.layers else 0

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.layers.values())


class RowLora(torch.nn.Module):
    """A base linear layer plus, for each segment of rows, the low-rank delta of its adapter."""

    def __init__(self, base: torch.nn.Linear, path: str) -> None:
        super().__init__()
        self.base = base
        self.path = path
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # adapter name -> (a, b), see Adapter
        self.segments: list[tuple[str, Rows]] = []  # set by AdapterSlots.set_rows; empty: the base alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        for name, rows in self.segments:
            pair = self.pairs.get(name)
            if pair is None:  # this adapter does not adapt this layer
                continue
            a, b = pair
            if isinstance(rows, slice):  # rows along the first dimension: views, added in place
                x_rows = x[rows].reshape(-1, x.shape[-1])
                out[rows].view(-1, out.shape[-1]).addmm_(x_rows @ a, b)
            else:
                x_rows = x.index_select(0, rows)
                delta = (x_rows.reshape(-1, x.shape[-1]) @ a) @ b
                out.index_add_(0, rows, delta.view(*x_rows.shape[:-1], out.shape[-1]))
        return out


class AdapterSlots:
    """The adapters loaded over one base model, by name, and which rows use which during a forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.adapters: dict[str, Adapter] = {}
        self._wrapped: dict[str, RowLora] = {}
        parameter = next(model.parameters())
        self._dtype, self._device = parameter.dtype, parameter.device

    def load(self, name: str, data: bytes) -> Adapter:
        """Load (or replace) adapter ``name`` from an adapter blob (:func:`flywheel.sdk.models.save_weights`
        of an adapted model). ValueError, naming the layer, when it does not fit this base;
        the adapter loaded before under that name stays then."""
        if not models.is_adapter(data):
            raise ValueError(f"adapter {name!r}: the weights are full model weights, not a LoRA adapter; a run on a "
                             "shared base model takes adapter weights only (trainer.adapter set)")
        pairs, scale = models.adapter_parts(data)
        ranks = {a.shape[0] for a, _ in pairs.values()}
        for path, (a, b) in pairs.items():
            layer = self._wrapped[path].base if path in self._wrapped else self._submodule(path)
            weight = getattr(layer, "weight", None)
            if not isinstance(layer, torch.nn.Linear) or weight is None \
                    or tuple(weight.shape) != (b.shape[0], a.shape[1]) or a.shape[0] != b.shape[1]:
                raise ValueError(f"adapter {name!r} does not fit the base model: {path} is not a linear layer of "
                                 f"shape {(b.shape[0], a.shape[1])} here")
        if len(ranks) > 1:
            raise ValueError(f"adapter {name!r}: its layers have ranks {sorted(ranks)}; one rank per adapter")
        # A new version of a loaded adapter is written into its tensors where their shapes are
        # the same (no allocation, one copy each), else into new ones.
        before = self.adapters[name].layers if name in self.adapters else {}
        layers = {path: self._converted(a, b, scale, before.get(path)) for path, (a, b) in pairs.items()}
        for path in layers:
            self._wrap(path)
        self.evict(name)  # a new version may adapt other layers than the one it replaces
        adapter = self.adapters[name] = Adapter(layers)
        for path, pair in layers.items():
            self._wrapped[path].pairs[name] = pair
        return adapter

    def _converted(self, a: torch.Tensor, b: torch.Tensor, scale: float,
                   into: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of one layer as :class:`Adapter` keeps them: A^T and (scale B)^T, in the
        model's dtype and device; written into ``into`` when it has their shapes."""
        a_t, b_t = a.T, b.T
        if into is None or into[0].shape != a_t.shape or into[1].shape != b_t.shape \
                or a.dtype != self._dtype or b.dtype != self._dtype or self._device.type != "cpu":
            return (a_t.to(self._device, self._dtype).contiguous(),
                    (scale * b).T.to(self._device, self._dtype).contiguous())
        into[0].copy_(a_t)
        torch.mul(b_t, scale, out=into[1])  # the same products as scale * b, each written once
        return into

    def _submodule(self, path: str) -> torch.nn.Module | None:
        try:
            return self.model.get_submodule(path)
        except AttributeError:
            return None

    def evict(self, name: str) -> None:
        if self.adapters.pop(name, None) is not None:
            for wrapper in self._wrapped.values():
                wrapper.pairs.pop(name, None)

    def _wrap(self, path: str) -> None:
        if path in self._wrapped:
            return
        parent_path, _, child = path.rpartition(".")
        parent = self.model.get_submodule(parent_path)
        wrapper = RowLora(getattr(parent, child), path)
        setattr(parent, child, wrapper)
        self._wrapped[path] = wrapper

    def set_rows(self, names: Sequence[str | None]) -> None:
        """Row i of the next forward passes uses adapter ``names[i]`` (None: the base alone).
        KeyError naming the adapter when one is not loaded."""
        missing = [n for n in names if n is not None and n not in self.adapters]
        if missing:
            raise KeyError(f"adapter {missing[0]!r} is not loaded on this base (loaded: {sorted(self.adapters)})")
        by_name: dict[str, list[int]] = {}
        for row, name in enumerate(names):
            if name is not None:
                by_name.setdefault(name, []).append(row)
        segments: list[tuple[str, Rows]] = []
        for name, rows in by_name.items():
            contiguous = rows[-1] - rows[0] + 1 == len(rows)
            segments.append((name, slice(rows[0], rows[-1] + 1) if contiguous
                             else torch.tensor(rows, device=self._device)))
        for wrapper in self._wrapped.values():
            wrapper.segments = segments

    def clear(self) -> None:
        """No row uses an adapter (the base alone) until the next :meth:`set_rows`."""
        for wrapper in self._wrapped.values():
            wrapper.segments = []


class AdapterView:
    """One run's backend on a shared base: swaps load its adapter, ``version`` is its own."""

    def __init__(self, base: TransformersBackend, name: str) -> None:
        self.base = base
        self.name = name
        self.version: int | None = None
        self.tokenizer = base.tokenizer
        self.max_positions = base.max_positions

    def swap(self, data: bytes, version: int) -> None:
        self.base.adapters.load(self.name, data)
        self.version = version

    def generate(self, prompts: Sequence[Sequence[int]], sampling: events.Sampling,
                 seeds: Sequence[int | None] | None = None, on_token: OnRowToken | None = None) -> list[Completion]:
        return self.base.generate(prompts, sampling, seeds, on_token, adapters=[self.name] * len(prompts))

    def close(self) -> None:
        self.base.adapters.evict(self.name)
