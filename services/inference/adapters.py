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
Every adapter's A and B sit side by side in one matrix per layer, and a mask per row keeps
its own adapter's columns: a layer's delta for the whole batch is two matmuls, whatever the
number of adapters in it. A new version of a loaded adapter is written into its own
columns; loading another adapter or evicting one lays the columns out again. The caller (the
batching loop's lock) keeps both from happening during a forward pass. A backend's
``generate(..., adapters=...)`` sets the rows (:meth:`AdapterSlots.set_rows`) before each
forward pass.

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
from flywheel_inference.completion import Completion, OnRowToken

if TYPE_CHECKING:
    from flywheel_inference.backends import TransformersBackend


@dataclass(frozen=True)
class Adapter:
    """One loaded adapter: (A, B) by layer path and the scale alpha / rank."""

    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scale: float

    @property
    def rank(self) -> int:
        return next(iter(self.layers.values()))[0].shape[0] if self.layers else 0

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.layers.values())


class RowLora(torch.nn.Module):
    """A base linear layer plus, per row of the batch, the low-rank delta of that row's adapter.

    Every adapter's A (transposed) and scaled B are kept side by side in one matrix each
    (``a_cat``: in x sum of ranks, ``b_cat``: sum of ranks x out), so the delta of a whole batch
    is ``((x a_cat) * mask) b_cat`` with ``mask`` keeping each row's own adapter's columns:
    two matmuls that read each adapter once, whatever the number of adapters in the batch."""

    def __init__(self, base: torch.nn.Linear, path: str) -> None:
        super().__init__()
        self.base = base
        self.path = path
        self.a_cat: torch.Tensor | None = None  # (in, total rank); None: no adapter has this layer
        self.b_cat: torch.Tensor | None = None  # (total rank, out), each adapter's scale folded in
        self.mask: torch.Tensor | None = None  # (rows, 1, total rank); None: no row uses an adapter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.mask is None or self.a_cat is None or self.b_cat is None:
            return out
        low = (x @ self.a_cat).mul_(self.mask)
        return torch.addmm(out.reshape(-1, out.shape[-1]), low.reshape(-1, low.shape[-1]), self.b_cat).view_as(out)


class AdapterSlots:
    """The adapters loaded over one base model, by name, and which rows use which during a forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.adapters: dict[str, Adapter] = {}
        self._wrapped: dict[str, RowLora] = {}
        parameter = next(model.parameters())
        self._dtype, self._device = parameter.dtype, parameter.device
        self._columns: dict[str, slice] = {}  # each adapter's columns in every layer's a_cat and b_cat
        self._width = 0  # the sum of the adapters' ranks

    def load(self, name: str, data: bytes) -> Adapter:
        """Load (or replace) adapter ``name`` from an adapter blob (:func:`flywheel.sdk.models.save_weights`
        of an adapted model). ValueError, naming the layer, when it does not fit this base;
        the adapter loaded before under that name stays then."""
        from flywheel.sdk import models

        if not models.is_adapter(data):
            raise ValueError(f"adapter {name!r}: the weights are full model weights, not a LoRA adapter; a run on a "
                             "shared base model takes adapter weights only (trainer.adapter set)")
        pairs, scale = models.adapter_parts(data)
        modules = dict(self.model.named_modules())
        layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        ranks = {a.shape[0] for a, _ in pairs.values()}
        for path, (a, b) in pairs.items():
            layer = self._wrapped[path].base if path in self._wrapped else modules.get(path)
            weight = getattr(layer, "weight", None)
            if not isinstance(layer, torch.nn.Linear) or weight is None \
                    or tuple(weight.shape) != (b.shape[0], a.shape[1]) or a.shape[0] != b.shape[1]:
                raise ValueError(f"adapter {name!r} does not fit the base model: {path} is not a linear layer of "
                                 f"shape {(b.shape[0], a.shape[1])} here")
            layers[path] = (a.to(self._device, self._dtype), b.to(self._device, self._dtype))
        if len(ranks) > 1:
            raise ValueError(f"adapter {name!r}: its layers have ranks {sorted(ranks)}; one rank per adapter")
        for path in layers:
            self._wrap(path)
        before = self.adapters.get(name)
        adapter = self.adapters[name] = Adapter(layers, scale)
        if before is not None and before.rank == adapter.rank and set(before.layers) == set(layers):
            self._write(name, self._columns[name])  # a new version of a loaded adapter: its own columns, in place
        else:
            self._relayout()
        return adapter

    def evict(self, name: str) -> None:
        if self.adapters.pop(name, None) is not None:
            self._relayout()

    def _wrap(self, path: str) -> None:
        if path in self._wrapped:
            return
        parent_path, _, child = path.rpartition(".")
        parent = self.model.get_submodule(parent_path)
        wrapper = RowLora(getattr(parent, child), path)
        setattr(parent, child, wrapper)
        self._wrapped[path] = wrapper

    def _relayout(self) -> None:
        """Give every adapter its columns anew and rebuild every layer's a_cat and b_cat."""
        self._columns, start = {}, 0
        for name, adapter in self.adapters.items():
            self._columns[name] = slice(start, start + adapter.rank)
            start += adapter.rank
        self._width = start
        for path, wrapper in self._wrapped.items():
            if start == 0 or not any(path in a.layers for a in self.adapters.values()):
                wrapper.a_cat = wrapper.b_cat = None
                continue
            wrapper.a_cat = torch.zeros((wrapper.base.in_features, start), dtype=self._dtype, device=self._device)
            wrapper.b_cat = torch.zeros((start, wrapper.base.out_features), dtype=self._dtype, device=self._device)
        for name, columns in self._columns.items():
            self._write(name, columns)

    def _write(self, name: str, columns: slice) -> None:
        adapter = self.adapters[name]
        with torch.no_grad():
            for path, (a, b) in adapter.layers.items():
                wrapper = self._wrapped[path]
                assert wrapper.a_cat is not None and wrapper.b_cat is not None
                wrapper.a_cat[:, columns] = a.T
                wrapper.b_cat[columns] = (adapter.scale * b).T

    def set_rows(self, names: Sequence[str | None]) -> None:
        """Row i of the next forward passes uses adapter ``names[i]`` (None: the base alone).
        KeyError naming the adapter when one is not loaded."""
        missing = [n for n in names if n is not None and n not in self._columns]
        if missing:
            raise KeyError(f"adapter {missing[0]!r} is not loaded on this base (loaded: {sorted(self.adapters)})")
        if all(n is None for n in names):
            self.clear()
            return
        mask = torch.zeros((len(names), 1, self._width), dtype=self._dtype, device=self._device)
        for row, name in enumerate(names):
            if name is not None:
                mask[row, 0, self._columns[name]] = 1.0
        for wrapper in self._wrapped.values():
            wrapper.mask = mask

    def clear(self) -> None:
        """No row uses an adapter (the base alone) until the next :meth:`set_rows`."""
        for wrapper in self._wrapped.values():
            wrapper.mask = None


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
