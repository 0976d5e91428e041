"""Data-parallel ranks: one trainer of a run as several processes, launched by torch's launcher.

With the setting ``trainer.ranks`` above 1 the run's owner starts ``python -m
torch.distributed.run --standalone --nproc-per-node N -m flywheel_trainer --run RUN`` instead
of the one process. The launcher sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``;
:func:`start` joins the process group (gloo on CPU, NCCL on GPUs) and every rank's engine
sees the world through :mod:`torch.distributed`.

Rank 0 is the trainer service: it alone consumes the bus, joins, journals, checkpoints its
ledger and publishes weights. The other ranks are *followers* (:func:`follow`): they touch no
bus; rank 0 hands them each piece of model work it does (:class:`Team`: the call's name and
arguments, broadcast as one object over a gloo group), and every rank runs it on its own
engine. In a step (:func:`flywheel_trainer.learner.train_step`) every rank builds the same
sequences from the same groups, then backpropagates its share of the micro-batches (round
robin); the engines sum the gradients over the ranks before clipping and the optimizer
step (:class:`flywheel_trainer.engines.TorchEngine`: one all-reduce; DeepSpeed: its own ZeRO
reduction), so a step on N ranks is the step on one rank with the same global batch, to
float rounding. Figures (loss, clipped share) are summed over ranks.

A follower ignores SIGTERM and SIGINT: the launcher passes a stop on to every rank, and a
checkpoint on the way out (rank 0's graceful stop) is collective with DeepSpeed; rank 0
ends the followers with a ``stop`` call once it is done. A rank that dies makes the launcher
stop the others (it watches them), and the run's owner restarts the whole trainer.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ranks:
    """This process's place among the trainer's ranks."""

    rank: int = 0
    world_size: int = 1
    group: Any = None  # the gloo group that carries rank 0's calls (None: one rank)

    @property
    def leader(self) -> bool:
        return self.rank == 0


def start() -> Ranks:
    """Join the process group the launcher describes (``WORLD_SIZE`` above 1), else one rank."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return Ranks()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return Ranks(dist.get_rank(), dist.get_world_size(), _object_group())


def current_ranks() -> Ranks:
    """The ranks as :mod:`torch.distributed` has them now (one rank when it is not initialized)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return Ranks()
    return Ranks(dist.get_rank(), dist.get_world_size(), _object_group())


def sum_over_ranks(values: list[float]) -> list[float]:
    """``values`` summed element-wise over every rank (as they are, on one rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    device = torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return [float(v) for v in tensor.cpu()]


def share(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (what a follower passes is ignored)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=_object_group())
    return box[0]


_GLOO: list[Any] = []  # the gloo group of a process group on NCCL, once made


def _object_group() -> Any:
    """The group objects go over: gloo, whatever moves the gradients (NCCL wants them on a
    GPU). Made on the first call, which every rank makes at once (:func:`start`)."""
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    if not _GLOO:
        _GLOO.append(dist.new_group(backend="gloo"))
    return _GLOO[0]


class Team:
    """Rank 0's hand on the followers: :meth:`call` runs one named piece of model work on every
    rank (itself included) with the same arguments."""

    def __init__(self, ranks: Ranks, calls: dict[str, Callable[..., Any]]) -> None:
        self.ranks = ranks
        self.calls = calls

    def call(self, name: str, *args: Any) -> Any:
        """Run ``self.calls[name](*args)`` here and on every follower; this rank's result."""
        if self.ranks.world_size > 1:
            dist.broadcast_object_list([(name, args)], src=0, group=self.ranks.group)
        return self.calls[name](*args)

    def stop(self) -> None:
        """End the followers' loops (they exit); a no-op on one rank."""
        if self.ranks.world_size > 1:
            dist.broadcast_object_list([("stop", ())], src=0, group=self.ranks.group)


def follow(ranks: Ranks, calls: dict[str, Callable[..., Any]]) -> None:
    """A follower's life: run each call rank 0 makes, until it says stop."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 decides when the ranks stop (see the module)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log.info("trainer rank %d of %d: following rank 0", ranks.rank, ranks.world_size)
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=ranks.group)
        name, args = box[0]
        if name == "stop":
            log.info("trainer rank %d: stopped by rank 0", ranks.rank)
            return
        calls[name](*args)
