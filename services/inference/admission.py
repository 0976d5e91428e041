"""Admission control: how far sampling may run ahead of the trainer, per run.

A run may have issued at most ``(trainer_step + max_off_policy_steps + 1) *
trainer.batch_size + num_dropped`` rollouts, where ``trainer_step`` is the latest weight
version of the run and ``num_dropped`` the rollouts the trainer dropped so far (stale, or
failed by a scorer; the trainer reports it with each weight update): the trainer
consumes ``batch_size`` rollouts per step, so this is enough to keep it busy and never
more than it could train on before they go stale, and a drop does not shrink the
lookahead for good. The version
counts once this replica has loaded it, not when it is first seen, so the rollouts a new
version lets in are sampled by it (with ``max_off_policy_steps = 0`` they would
otherwise be stale on arrival). On top of that
at most ``inference.max_rollouts_in_flight`` rollouts of the run are being sampled at
once. A task that does not fit waits (the bus layer keeps its message alive), so the
pipeline never runs away from the trainer, and memory does not grow with the backlog.

"Issued" counts rollouts admitted in this process, started from the number already in
the ROLLOUTS stream for the run when the run is first seen (so a restarted replica does
not issue a fresh allowance). Not covered: a bound shared by several replicas (each
replica keeps its own count once started).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from flywheel.config import RunConfig


class RunEnded(Exception):
    """The run finished or failed: its remaining tasks are not sampled."""


@dataclass
class Admission:
    """The counters and the rule; :meth:`slot` waits for room."""

    batch_size: int
    max_off_policy_steps: int
    max_in_flight: int
    trainer_step: int = 0
    num_dropped: int = 0  # rollouts the trainer dropped so far: their allowance comes back
    num_issued: int = 0
    num_in_flight: int = 0
    num_waiting: int = 0
    ended: bool = False  # the run finished or failed; waiting and new tasks get RunEnded
    num_skipped: int = 0  # rollouts of tasks left over when the run ended
    on_change: Callable[[], None] | None = None  # called after every change of the counters
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition, repr=False)

    @classmethod
    def for_run(cls, cfg: RunConfig, num_issued: int = 0, on_change: Callable[[], None] | None = None) -> Admission:
        return cls(batch_size=cfg.trainer.batch_size, max_off_policy_steps=cfg.trainer.max_off_policy_steps,
                   max_in_flight=cfg.inference.max_rollouts_in_flight, num_issued=num_issued, on_change=on_change)

    def _counted(self) -> None:
        if self.on_change is not None:
            self.on_change()

    @property
    def max_issued(self) -> int:
        return (self.trainer_step + self.max_off_policy_steps + 1) * self.batch_size + self.num_dropped

    def fits(self, n: int) -> bool:
        return self.num_issued + n <= self.max_issued and self.num_in_flight + n <= self.max_in_flight

    def check(self, n: int) -> None:
        """Refuse a group that could never be admitted (it would wait forever)."""
        first_allowance = (self.max_off_policy_steps + 1) * self.batch_size
        if n > self.max_in_flight:
            raise ValueError(f"num_rollouts={n} exceeds inference.max_rollouts_in_flight={self.max_in_flight}")
        if n > first_allowance:
            raise ValueError(f"num_rollouts={n} exceeds (trainer.max_off_policy_steps + 1) * trainer.batch_size = "
                             f"{first_allowance}: the trainer could not step before this group is sampled")

    async def advance(self, trainer_step: int, num_dropped: int = 0) -> None:
        """A newer weight version was loaded: more rollouts may be issued."""
        async with self._changed:
            if trainer_step > self.trainer_step or num_dropped > self.num_dropped:
                self.trainer_step = max(self.trainer_step, trainer_step)
                self.num_dropped = max(self.num_dropped, num_dropped)
                self._changed.notify_all()
                self._counted()

    async def end(self) -> None:
        """The run ended: release every waiting task (with RunEnded) and refuse new ones."""
        async with self._changed:
            self.ended = True
            self._changed.notify_all()
            self._counted()

    @asynccontextmanager
    async def slot(self, n: int) -> AsyncIterator[None]:
        """Hold ``n`` rollouts in flight; they stay issued unless the block raises.

        Raises RunEnded when the run ends before (or while) the task waits for room."""
        self.check(n)
        async with self._changed:
            self.num_waiting += n
            self._counted()
            try:
                await self._changed.wait_for(lambda: self.ended or self.fits(n))
            finally:
                self.num_waiting -= n
            if self.ended:
                self.num_skipped += n
                self._counted()
                raise RunEnded()
            self.num_issued += n
            self.num_in_flight += n
            self._counted()
        try:
            yield
        except BaseException:
            self.num_issued -= n  # never published: give the allowance back
            raise
        finally:
            async with self._changed:
                self.num_in_flight -= n
                self._changed.notify_all()
                self._counted()

    def counters(self) -> dict[str, int]:
        return {"trainer_step": self.trainer_step, "num_dropped": self.num_dropped, "max_issued": self.max_issued, "num_issued": self.num_issued,
                "num_in_flight": self.num_in_flight, "num_waiting": self.num_waiting, "num_skipped": self.num_skipped}
