"""Many LoRA adapters trained on one copy of a base model: what the training API trains.

A :class:`Base` holds one model, its weights frozen, with one named peft adapter per training
model (a session's ``create_model``): each its own rank and targets, its own AdamW state and step
count. Gradients accumulate in an adapter's own parameters across ``forward_backward`` calls
until its ``optim_step``; only the adapter a request names is active while it runs, so one
model's requests never touch another's weights, gradients or optimizer. Requests on one base
run one at a time (its lock); the API orders them (``flywheel_trainer.tinker_api``).

Losses, on each datum's tokens (``model_input``) and per-position ``loss_fn_inputs``, summed over
positions and datums (no mean), as the Tinker SDK documents them:

- ``cross_entropy``: ``-sum(weights * logprobs)`` of ``target_tokens``;
- ``importance_sampling``: ``-sum(exp(logprobs - sampler_logprobs) * advantages)``, the
  sampler's ``logprobs`` of ``target_tokens`` given as an input (the REINFORCE estimate,
  corrected for the sampler being another policy).

Each returns the model's ``logprobs`` of the targets per datum, and ``loss:sum``.
Checkpoints (``save``/``load``) hold an adapter's tensors, its config and, optionally, its
optimizer state and step, in one file under the data dir.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flywheel.sdk.models import load_model, resolve_model

LOSSES = ("cross_entropy", "importance_sampling")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)
LOSS_INPUTS = {"cross_entropy": ("target_tokens", "weights"),
               "importance_sampling": ("target_tokens", "logprobs", "advantages")}


class UserError(ValueError):
    """A request this model cannot do as asked; the message says what to change."""


@dataclass
class Datum:
    """One sequence: its tokens and its per-position inputs (arrays of the tokens' length)."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]


@dataclass
class Adapter:
    """One training model: an adapter of its base, with its optimizer and step count."""

    name: str
    rank: int
    targets: tuple[str, ...]
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.AdamW
    steps: int = 0
    pending: int = 0  # forward_backward calls since the last optim_step


@dataclass
class Base:
    """One base model and the adapters trained on it (see the module)."""

    name: str
    data_dir: Path
    model: Any = None
    peft: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    adapters: dict[str, Adapter] = field(default_factory=dict)
    context: int = 0

    def __post_init__(self) -> None:
        model, _ = load_model(resolve_model(self.name, self.data_dir))
        for param in model.parameters():
            param.requires_grad_(False)
        self.model = model
        self.context = int(getattr(model.config, "max_position_embeddings", 0) or 0)

    def add(self, name: str, rank: int, seed: int | None, train_attn: bool, train_mlp: bool,
            train_unembed: bool) -> Adapter:
        """A new adapter ``name`` (B at zero: it computes what the base does until trained)."""
        present = {n.rsplit(".", 1)[-1] for n, _ in self.model.named_modules()}
        targets = tuple(t for t in (*(ATTN if train_attn else ()), *(MLP if train_mlp else ()),
                                    *(UNEMBED if train_unembed else ())) if t in present)
        if not targets:
            raise UserError(f"lora_config: no layer of {self.name} to train with train_attn={train_attn}, "
                            f"train_mlp={train_mlp}, train_unembed={train_unembed}")
        return self.attach(name, rank, seed, targets)

    def attach(self, name: str, rank: int, seed: int | None, targets: tuple[str, ...]) -> Adapter:
        """A new adapter ``name`` of ``rank`` on ``targets`` (layer names of the base)."""
        from peft import LoraConfig, get_peft_model

        if not 1 <= rank <= 1024:
            raise UserError(f"lora_config.rank={rank}: 1 to 1024")
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets), bias="none", lora_dropout=0.0)
        with self.lock:
            if seed is not None:
                torch.manual_seed(seed)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=UserWarning)  # peft on a tied lm_head
                warnings.filterwarnings("ignore", category=FutureWarning)
                if self.peft is None:
                    self.peft = get_peft_model(self.model, config, adapter_name=name)
                else:
                    self.peft.add_adapter(name, config)
            params = [p for n, p in self.peft.named_parameters() if f".{name}." in n]
            optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
            adapter = self.adapters[name] = Adapter(name, rank, targets, params, optimizer)
        return adapter

    def remove(self, name: str) -> None:
        """Let go of adapter ``name`` (its session finished): its weights and optimizer state
        (peft keeps a base's last adapter module until another replaces it)."""
        with self.lock:
            adapter = self.adapters.pop(name, None)
            if adapter is None:
                return
            adapter.optimizer.state.clear()
            if self.adapters:
                with warnings.catch_warnings():  # peft says which adapter it made active instead: any is
                    warnings.filterwarnings("ignore", message=".*was active which is now deleted.*")
                    self.peft.delete_adapter(name)

    def _use(self, adapter: Adapter) -> None:
        self.peft.set_adapter(adapter.name)
        for param in adapter.params:  # set_adapter marks the active adapter trainable; ours always are
            param.requires_grad_(True)

    def forward_backward(self, adapter: Adapter, data: Sequence[Datum], loss_fn: str,
                         forward_only: bool) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Per datum the model's logprobs of its targets; ``loss:sum``. Gradients accumulate
        (unless ``forward_only``) until :meth:`optim_step`."""
        if loss_fn not in LOSSES:
            raise UserError(f"loss_fn {loss_fn!r}: this server trains with {', '.join(LOSSES)}")
        for i, datum in enumerate(data):
            _check(datum, i, loss_fn, self.context)
        outputs: list[dict[str, np.ndarray]] = []
        total = 0.0
        with self.lock:
            self._use(adapter)
            for datum in data:
                with torch.set_grad_enabled(not forward_only):
                    logits = self.peft(input_ids=torch.tensor([datum.tokens])).logits[0].float()
                    targets = torch.as_tensor(datum.inputs["target_tokens"], dtype=torch.long)
                    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]
                    loss = _loss(loss_fn, logprobs, datum.inputs)
                    if not forward_only:
                        loss.backward()
                total += float(loss.detach())
                outputs.append({"logprobs": logprobs.detach().numpy().astype(np.float32)})
            if not forward_only:
                adapter.pending += 1
        return outputs, {"loss:sum": total}

    def optim_step(self, adapter: Adapter, learning_rate: float, beta1: float, beta2: float, eps: float,
                   weight_decay: float, grad_clip_norm: float) -> dict[str, float]:
        """Apply the gradients accumulated since the last step (AdamW, these hyperparameters)."""
        with self.lock:
            metrics = {}
            if grad_clip_norm > 0:
                metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(adapter.params, grad_clip_norm))
            for group in adapter.optimizer.param_groups:
                group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
            adapter.optimizer.step()
            adapter.optimizer.zero_grad(set_to_none=True)
            adapter.steps += 1
            adapter.pending = 0
        return {**metrics, "step": float(adapter.steps)}

    def save(self, adapter: Adapter, path: Path) -> None:
        """The adapter's tensors, config, optimizer state and step, in one file."""
        with self.lock:
            tensors = {n.replace(f".{adapter.name}.", ".{adapter}."): p.detach().clone()
                       for n, p in self.peft.named_parameters() if f".{adapter.name}." in n}
            state = {"base": self.name, "rank": adapter.rank, "targets": list(adapter.targets), "tensors": tensors,
                     "optimizer": adapter.optimizer.state_dict(), "steps": adapter.steps}
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        torch.save(state, partial)
        partial.rename(path)

    def load(self, adapter: Adapter, path: Path, optimizer: bool) -> None:
        """Set the adapter to a checkpoint of an adapter of this base with the same rank and
        targets (its optimizer state and step too, when ``optimizer``)."""
        state = torch.load(path, weights_only=True)
        if state["base"] != self.name or state["rank"] != adapter.rank or tuple(state["targets"]) != adapter.targets:
            raise UserError(f"{path.name}: a checkpoint of a rank-{state['rank']} adapter of {state['base']} on "
                            f"{state['targets']}; this model is rank {adapter.rank} of {self.name} on "
                            f"{list(adapter.targets)}")
        with self.lock:
            named = dict(self.peft.named_parameters())
            with torch.no_grad():
                for key, tensor in state["tensors"].items():
                    named[key.replace(".{adapter}.", f".{adapter.name}.")].copy_(tensor)
            if optimizer:
                adapter.optimizer.load_state_dict(state["optimizer"])
                adapter.steps = int(state["steps"])
            adapter.optimizer.zero_grad(set_to_none=True)
            adapter.pending = 0


def checkpoint_of(path: Path) -> tuple[str, int, tuple[str, ...]]:
    """(base model, rank, targets) of a checkpoint :meth:`Base.save` wrote."""
    state = torch.load(path, weights_only=True)
    return str(state["base"]), int(state["rank"]), tuple(state["targets"])


def _check(datum: Datum, index: int, loss_fn: str, context: int) -> None:
    n = len(datum.tokens)
    if n == 0:
        raise UserError(f"data[{index}]: no tokens")
    if context and n > context:
        raise UserError(f"data[{index}]: {n} tokens, past the model's context of {context}")
    for name in LOSS_INPUTS[loss_fn]:
        if name not in datum.inputs:
            raise UserError(f"data[{index}].loss_fn_inputs: {loss_fn} needs {name!r} (it has "
                            f"{sorted(datum.inputs)})")
        if datum.inputs[name].shape != (n,):
            raise UserError(f"data[{index}].loss_fn_inputs[{name!r}]: shape {list(datum.inputs[name].shape)}, not "
                            f"[{n}] (one a token of model_input)")


def _loss(loss_fn: str, logprobs: torch.Tensor, inputs: dict[str, np.ndarray]) -> torch.Tensor:
    if loss_fn == "cross_entropy":
        weights = torch.as_tensor(inputs["weights"], dtype=torch.float32)
        return -(weights * logprobs).sum()
    sampler = torch.as_tensor(inputs["logprobs"], dtype=torch.float32)
    advantages = torch.as_tensor(inputs["advantages"], dtype=torch.float32)
    return -(torch.exp(logprobs - sampler) * advantages).sum()
