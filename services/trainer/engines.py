"""Engines: where the model and optimizer live, and how a step updates them.

Chosen by ``trainer.engine`` in the run config, e.g.
``engine = {type = "deepspeed", zero_stage = 2}``: its ``type`` is a key of :data:`ENGINES`,
or the path of a class of the user's own; :func:`build_engine` calls it as ``(model, the
[trainer] section, model.dtype, **the variant's other fields)`` (a test checks the config's
variants and this registry agree). The learner only ever does: forward through
``engine.model``, ``engine.backward(loss)`` once per micro-batch, ``engine.step()`` once
per optimizer step (it clips gradients to ``max_grad_norm`` and returns their norm before
clipping), ``engine.weights()`` for the blob inference loads, ``engine.save(folder)`` /
``engine.load(folder)`` for checkpoints.

- ``torch``: plain PyTorch, AdamW. On one GPU when CUDA is available, else CPU. The
  parameters stay float32; with ``model.dtype = "bfloat16"`` the forward runs under CUDA
  autocast, so the optimizer still updates float32 weights.
- ``deepspeed``: DeepSpeed ZeRO (``zero_stage`` 0 to 3) around a torch AdamW (DeepSpeed's
  fused optimizers compile for a minute first). Gradient accumulation is the caller's:
  ``managed_gradient_accumulation`` is off, so ``backward`` only accumulates and ``step``
  is the boundary. With ``model.dtype = "bfloat16"`` DeepSpeed trains in bf16 with float32
  master weights. The rank variables default to a world of one (gloo on CPU, nccl on a GPU).

On several ranks (:mod:`flywheel_trainer.ranks`) each rank backpropagates its share of a
step's micro-batches and the engine sums the gradients over the ranks before it clips them:
``torch`` with one all-reduce of the flattened gradients in :meth:`TorchEngine.step` (what
DDP does, without its per-backward hooks, since a rank's number of micro-batches varies);
``deepspeed`` with ZeRO's own reduction, its loss times the world size (DeepSpeed averages
over ranks, the learner's loss is already normalised by the whole step's tokens). ZeRO 2 and
3 gather and reduce parameters during each forward and backward, in buckets filled in the
order gradients arrive, so every rank makes as many passes, each the same graph: whole rows
(``same_graph_on_every_rank``: no prompt computed once for its rows, which is a second
forward), and :meth:`Engine.idle_backward`, a rank's pass with no micro-batch left (a zero
loss on a two-token row). On ZeRO 2 an odd pass of another shape gave wrong sums silently.

Not covered: tensor/pipeline parallelism, LoRA on DeepSpeed, CPU offload.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from flywheel.contract.config import TrainerConfig
from flywheel.runtime.natsserver import free_port
from flywheel.sdk import models
from flywheel_trainer.ranks import current_ranks


class Engine(Protocol):
    model: torch.nn.Module  # call for a forward pass (the module itself, or DeepSpeed's engine around it)
    module: torch.nn.Module  # the model itself
    device: torch.device
    # Read on several ranks only (an engine of the user's own that never runs on more may lack
    # it): every pass must be the same graph on every rank (whole rows, no shared prefix), as
    # ZeRO 2 and 3 gather and reduce parameters in the order their hooks fire.
    same_graph_on_every_rank: bool
    # Read where present (False when missing, so an engine of the user's own needs none):
    # ``head_at_loss_positions``, the head and the softmax over the vocabulary may run at the
    # loss's positions alone (flywheel_trainer.batch.loss_logprobs), outside the engine's forward;
    # ``activation_checkpointing``, the decoder layers recompute their forward in the backward
    # (then no prefix is shared through a key/value cache, which a recomputed layer drops).

    def autocast(self) -> contextlib.AbstractContextManager[None]: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def idle_backward(self) -> None: ...  # a rank's pass with no micro-batch left (several ranks only)
    # The optimizer's step on this step's gradients, clipped; the norm before clipping. Gradients
    # that are not finite (a NaN or inf anywhere) are discarded instead, the weights and the
    # optimizer's state left as they were, and the norm returned is not finite.
    def step(self) -> float: ...
    def weights(self) -> bytes: ...
    def save(self, folder: Path) -> None: ...
    def load(self, folder: Path) -> None: ...


def checkpoint_layers(model: torch.nn.Module, cfg: TrainerConfig) -> bool:
    """With ``trainer.activation_checkpointing``, make ``model``'s decoder layers keep only their
    input in the forward and recompute themselves in the backward (transformers' own
    checkpointing, non-reentrant). It runs only on layers in training mode: the layers alone
    are put in it, so dropout elsewhere stays off (the recomputed logprobs are the sampler's).
    Whether it is on."""
    if not cfg.activation_checkpointing:
        return False
    from transformers.modeling_layers import GradientCheckpointingLayer

    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers 5's name
    if callable(enable):
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif callable(enable := getattr(model, "gradient_checkpointing_enable", None)):
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        raise ValueError(f"trainer.activation_checkpointing = true needs a transformers model; "
                         f"{type(model).__name__} has no activation_checkpointing_enable: set it to false")
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"trainer.activation_checkpointing = true: {type(model).__name__} has no decoder layers "
                         "transformers can checkpoint; set it to false")
    for layer in layers:
        layer.training = True  # the layer's own flag only: its submodules (dropout) stay in eval mode
    return True


def adamw(model: torch.nn.Module, cfg: TrainerConfig) -> torch.optim.AdamW:
    """Over the parameters that train (a LoRA model's adapter alone)."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                             weight_decay=cfg.weight_decay)


def with_adapter(model: torch.nn.Module, cfg: TrainerConfig) -> torch.nn.Module:
    """``model`` as the run trains it: with the LoRA adapter of ``trainer.adapter``, else as it is."""
    if cfg.adapter is None:
        return model
    return models.add_adapter(model, cfg.adapter.rank, cfg.adapter.alpha, cfg.adapter.target_modules)


class TorchEngine:
    def __init__(self, model: torch.nn.Module, cfg: TrainerConfig, dtype: str) -> None:
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.module = self.model = model.to(device=self.device, dtype=torch.float32)
        self.module.eval()  # no dropout: the recomputed logprobs are the sampler's
        self.activation_checkpointing = checkpoint_layers(self.module, cfg)
        self.optimizer = adamw(model, cfg)
        self.max_grad_norm = cfg.max_grad_norm
        self.autocast_dtype = torch.bfloat16 if dtype == "bfloat16" and self.device.type == "cuda" else None
        self.ranks = current_ranks()
        self.same_graph_on_every_rank = False
        self.head_at_loss_positions = True
        if self.ranks.world_size > 1:  # every rank starts from rank 0's weights (its warm-up's)
            for tensor in self.module.state_dict().values():
                torch.distributed.broadcast(tensor, src=0)

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def idle_backward(self) -> None:
        pass  # gradients meet only in step()

    def step(self) -> float:
        if self.ranks.world_size > 1:
            sum_gradients([p for p in self.module.parameters() if p.requires_grad])
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.max_grad_norm)
        if torch.isfinite(norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def weights(self) -> bytes:
        return models.save_weights(self.module)

    def save(self, folder: Path) -> None:
        if not self.ranks.leader:
            return  # every rank holds the same state: rank 0 writes it
        folder.mkdir(parents=True)
        torch.save({"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}, folder / "engine.pt")

    def load(self, folder: Path) -> None:
        state = torch.load(folder / "engine.pt", map_location=self.device, weights_only=True)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


class DeepSpeedEngine:
    CHECKPOINT_TAG = "state"

    def __init__(self, model: torch.nn.Module, cfg: TrainerConfig, dtype: str, zero_stage: int = 0) -> None:
        import deepspeed

        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                            ("MASTER_PORT", str(free_port()))):
            os.environ.setdefault(name, value)
        deepspeed.init_distributed("nccl" if torch.cuda.is_available() else "gloo")
        self.stage = zero_stage
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False,
            "zero_optimization": {"stage": self.stage},
            "bf16": {"enabled": dtype == "bfloat16"},
            "steps_per_print": 2**31 - 1,
        }
        # ZeRO 1-3 clip inside their optimizer and report the norm; stage 0 clips here.
        if self.stage > 0:
            config["gradient_clipping"] = cfg.max_grad_norm
        self.max_grad_norm = cfg.max_grad_norm
        self.engine, *_ = deepspeed.initialize(model=model.to(torch.float32), optimizer=adamw(model, cfg),
                                               config=config)
        self.model = self.engine
        self.module = self.engine.module
        self.module.eval()  # no dropout: the recomputed logprobs are the sampler's
        self.activation_checkpointing = checkpoint_layers(self.module, cfg)
        self.device = torch.device(self.engine.device)
        self.ranks = current_ranks()
        self.same_graph_on_every_rank = self.ranks.world_size > 1 and self.stage >= 2
        # ZeRO 3 gathers each parameter around the engine's own forward (a head called outside it
        # gave another loss), and several ranks of ZeRO 2 need every pass the same graph.
        self.head_at_loss_positions = self.stage < 2 or (self.stage == 2 and self.ranks.world_size == 1)
        self._deepspeed = deepspeed

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # bf16, when asked for, is DeepSpeed's own

    def backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed averages gradients over ranks; the loss is normalised over the whole step.
        self.engine.backward(loss * self.ranks.world_size, scale_wrt_gas=False)

    def idle_backward(self) -> None:
        if self.stage >= 2:  # ZeRO 2 and 3 reduce in every backward: every rank makes as many
            logits = self.engine(input_ids=torch.zeros((1, 2), dtype=torch.long, device=self.device)).logits
            self.engine.backward(logits.sum() * 0.0, scale_wrt_gas=False)

    def step(self) -> float:
        norm = None
        if self.stage == 0:
            if self.ranks.world_size > 1:
                # Clipping needs the reduced gradients; DeepSpeed's own average in step() then
                # leaves them as they are (every rank holds the same).
                sum_gradients([p for p in self.module.parameters() if p.requires_grad], average=True)
            norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.max_grad_norm)
            if not torch.isfinite(norm):
                self.engine.zero_grad()
                return float(norm)
        # ZeRO 1-3 in float32 find the overflow themselves: they skip the step and report inf.
        self.engine.step()
        if norm is None:
            norm = self.engine.get_global_grad_norm()
            assert norm is not None, "ZeRO reports the gradient norm after a step"
        return float(norm)

    def weights(self) -> bytes:
        gather = (self._deepspeed.zero.GatheredParameters(list(self.module.parameters())) if self.stage == 3
                  else contextlib.nullcontext())
        with gather:
            return models.save_weights(self.module)

    def save(self, folder: Path) -> None:
        self.engine.save_checkpoint(str(folder), tag=self.CHECKPOINT_TAG)

    def load(self, folder: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(folder), tag=self.CHECKPOINT_TAG)
        assert path is not None, f"no DeepSpeed checkpoint in {folder}"


def sum_gradients(parameters: list[torch.nn.Parameter], average: bool = False) -> None:
    """Each parameter's gradient summed (or averaged) over the ranks, in one all-reduce of
    them flattened; a parameter without a gradient counts as zeros (a rank whose micro-batches
    never reached it)."""
    grads = []
    for p in parameters:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    flat = torch._utils._flatten_dense_tensors(grads)
    torch.distributed.all_reduce(flat)
    if average:
        flat /= torch.distributed.get_world_size()
    for grad, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(reduced)


# (model, the [trainer] section, model.dtype, **the variant's fields) -> Engine
ENGINES: dict[str, Callable[..., Engine]] = {
    "torch": TorchEngine,
    "deepspeed": DeepSpeedEngine,
}


def build_engine(model: torch.nn.Module, cfg: TrainerConfig, dtype: str) -> Engine:
    """The engine ``cfg.engine`` names, around ``model``."""
    return cfg.engine.bind(ENGINES)(model, cfg, dtype)
