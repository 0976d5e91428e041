"""Admission control: how far sampling may run ahead of the trainer, per run.

A run may have issued at most ``(trainer_step + max_off_policy_steps + 1) *
trainer.batch_size + num_unused + spare_rollouts`` rollouts, where ``trainer_step`` is the
latest weight version of the run and ``num_unused`` the rollouts of the groups the trainer
consumed with nothing trained (each member dropped: stale, or failed by a scorer; the trainer
reports it with each weight update, as its field ``num_unused_total``; :meth:`Admission.loaded`
reads both): the trainer consumes ``batch_size`` rollouts per step, in whole groups that
train something, so without spares this is enough to keep it busy and never more than it
could train on before they go stale, and a group lost does not shrink the lookahead for
good. A dropped member of a group that trained is not given back: its group counted in
its step. ``inference.spare_rollouts`` (0 by default) admits that many more: when
rollout times are heavy-tailed, the budget is otherwise held by groups still waiting on
their slowest member (and by done rollouts waiting for them), and inference idles; with
spares the fastest groups fill each step, and what arrives too late is dropped as stale,
counted (and given back here as dropped). The version counts once this replica has loaded it, not when it is
first seen, so the rollouts a new version lets in are sampled by it (with
``max_off_policy_steps = 0`` they would otherwise be stale on arrival); nothing is
admitted before the run's first weights are loaded. A task that does not fit waits (the
bus layer keeps its message alive), so the pipeline never runs away from the trainer, and
memory does not grow with the backlog. Waiting tasks are admitted in the order they came
(one that arrives when room frees up does not go before those already waiting), so a
seeded run's tasks are sampled in the same steps every time.

On top of that, at most ``inference.max_rollouts_in_flight`` rollouts of the run are being
rolled out at once, counted rollout by rollout (:meth:`Admission.rollout`): a rollout takes
a place when it starts and gives it back when its harness ends, not when its whole group
does, so the rollouts that finished early do not keep the slow ones' siblings from
starting. A group is admitted whole against the budget above (the trainer takes whole
groups) and its rollouts then start as places free up, first come first served. A rollout
that has its run's place then takes one of its tenant's (:class:`TenantPlaces`: at most
the setting ``inference.tenant_max_rollouts_in_flight`` over all the tenant's runs in this
process, first come first served among them), so one tenant's runs, however many or slow,
cannot take every place of the process; it waits for the tenant's place holding only its
run's, which no other run needs. Places are per process; the budget above is the run's.

"Issued" counts what reached the bus, by rollout id, never attempts: it starts from the
number of rollouts already in the ROLLOUTS stream for the run when the run is first seen
(so a restarted replica does not issue a fresh allowance); a group holds its allowance
while it is sampled, and once published keeps only the rollouts the bus stored
(:attr:`Slot.num_stored`): a redelivered task whose rollouts were stored before (same
ids, deduplicated by the bus) gives its allowance back, so a redelivery or a restart
cannot use up the run's budget while the trainer waits for rollouts that never come. A
group that fails before it is published gives its whole allowance back.

When the run ends (finished, failed, stopped, or abandoned by its owner:
:func:`flywheel.contract.runs.end_of`), every waiting task is released with :class:`RunEnded` at
once, so it stops holding its consumer's slots; a run that is resumed takes tasks again. A
waiting task holds a slot of its own run's consumer only
(:mod:`flywheel_inference.run_tasks`): a run that waits, paused or far ahead of its trainer,
never holds the slots of another.

Replicas share the budget (:class:`SharedIssued`): the run's issued rollouts over every
inference replica are one entry of the bus's admission bucket, ``published`` (rollouts the bus
stored) plus what each replica ``holds`` (admitted, not yet published), changed only by
compare-and-set; a group is admitted when the shared total fits, so N replicas together never
issue more than one would. A replica's holding carries a lease it renews while it holds
anything (:data:`LEASE_S`): a killed replica's holding stops counting once its lease runs out
(its tasks are redelivered and admitted again elsewhere), and ``published`` is brought up to
the stream's count whenever a replica renews, so a replica killed between publishing and
recording it costs nothing for long. A replica joining mid-run counts what the others hold
from its first admission. The local counters above still bound this replica (they never
exceed the shared ones).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from flywheel.contract import events
from flywheel.contract.bus import Bus, wait_at_most
from flywheel.contract.config import RunConfig

log = logging.getLogger(__name__)

LEASE_S = 15.0  # a replica's holding counts this long after its last renewal
RENEW_S = LEASE_S / 3
RETRY_S = 0.5  # a group refused by the shared total asks again this often (others may have published)


class RunEnded(Exception):
    """The run ended (the message says how and when): its remaining tasks are not sampled."""


class SharedIssued:
    """One run's issued rollouts over every inference replica, in the admission bucket (key: the
    run): ``{"published": P, "held": {replica: [n, lease_until]}}``, read and written by
    compare-and-set. ``published(run)``: the ROLLOUTS stream's count for the run (the truth the
    entry is brought up to)."""

    def __init__(self, bus: Bus, run: str, replica: str, published: Callable[[str], Awaitable[int]]) -> None:
        self.bus = bus
        self.run = run
        self.replica = replica
        self._published = published
        self.held = 0  # what this replica holds, as it last wrote it
        # One change of the entry at a time in this replica: ``held`` moves with the write. A
        # release that ran between a reservation's write and its ``held += n`` would write the
        # old ``held`` back, and the other replicas would admit n more than the bound.
        self._writing = asyncio.Lock()
        self._renewing: asyncio.Task[None] | None = None
        self._bucket: KeyValue | None = None
        # The entry as this replica last read or wrote it, with its revision: a change is written
        # on it by compare-and-set without reading first, which fails only when another replica
        # wrote since (then it is read again). Alone, a replica makes one round trip a change, not two.
        self._last: tuple[dict[str, Any], int] | None = None

    async def total(self) -> int:
        """Published plus every live holding: the run's issued rollouts now."""
        entry, _ = await self._read()
        return _total(entry, time.time())

    async def reserve(self, n: int, max_issued: int) -> bool:
        """Hold ``n`` more if the shared total then stays within ``max_issued``; False if not."""
        def change(entry: dict[str, Any], now: float) -> bool:
            if _total(entry, now) + n > max_issued:
                return False
            entry["held"][self.replica] = [self.held + n, now + LEASE_S]
            return True

        async with self._writing:
            if not await self._update(change):
                return False
            self.held += n
        if self._renewing is None or self._renewing.done():
            self._renewing = asyncio.ensure_future(self._renew())
        return True

    async def release(self, n: int, stored: int) -> None:
        """``n`` held come off this replica's holding; ``stored`` of them the bus stored (published)."""
        def change(entry: dict[str, Any], now: float) -> bool:
            entry["published"] += stored
            entry["held"][self.replica] = [self.held, now + LEASE_S]
            return True

        try:
            async with self._writing:
                self.held = max(self.held - n, 0)  # what a failed write leaves, renewals (or the lease) mend
                await self._update(change)
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("run %s: could not give back %d admitted rollouts on the bus (%s); they count until this "
                        "replica's lease is renewed or runs out", self.run, n, exc)

    async def close(self) -> None:
        if self._renewing is not None:
            self._renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewing

    async def _renew(self) -> None:
        """While this replica holds anything: renew its lease, and bring ``published`` up to the stream."""
        while self.held > 0:
            await asyncio.sleep(RENEW_S)
            try:
                count = await self._published(self.run)
                async with self._writing:
                    await self._update(functools.partial(self._renewed, count))
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("run %s: could not renew this replica's admission lease: %s", self.run, exc)

    async def _kv(self) -> KeyValue:
        if self._bucket is None:
            self._bucket = await self.bus.admission_kv()
        return self._bucket

    def _renewed(self, count: int, entry: dict[str, Any], now: float) -> bool:
        entry["published"] = max(entry["published"], count)
        entry["held"][self.replica] = [self.held, now + LEASE_S]
        return True

    async def _read(self) -> tuple[dict[str, Any], int | None]:
        kv = await self._kv()
        try:
            found = await kv.get(self.run)
        except nats.js.errors.KeyNotFoundError:
            return {"published": await self._published(self.run), "held": {}}, None
        return json.loads(found.value or b"{}"), found.revision

    async def _update(self, change: Callable[[dict[str, Any], float], bool]) -> bool:
        """Apply ``change`` to the entry (it returns False to leave it), by compare-and-set
        until no other replica wrote in between; dead holdings are dropped on the way. The
        entry this replica last saw is tried first; a refusal is only ever made on the entry as
        the bus holds it now, read afresh."""
        kv = await self._kv()
        while True:
            if self._last is None:
                entry, revision = await self._read()
                fresh = True
                if revision is not None:
                    self._last = ({"published": entry["published"], "held": dict(entry["held"])}, revision)
            else:
                (seen, seen_revision), fresh = self._last, False
                entry, revision = {"published": seen["published"], "held": dict(seen["held"])}, seen_revision
            now = time.time()
            entry["held"] = {r: v for r, v in entry["held"].items() if (v[1] > now and v[0] > 0) or r == self.replica}
            if not change(entry, now):
                if fresh:
                    return False
                self._last = None  # what this replica saw may be old: judge again on what the bus holds
                continue
            data = json.dumps(entry).encode()
            try:
                if revision is None:
                    written = await kv.create(self.run, data)
                else:
                    written = await kv.update(self.run, data, last=revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                self._last = None  # another replica wrote first (or made the entry): read again
                continue
            except BaseException:
                self._last = None  # not known whether it was written
                raise
            self._last = (entry, written)
            return True


def _total(entry: dict[str, Any], now: float) -> int:
    return int(entry["published"]) + sum(int(n) for n, until in entry["held"].values() if until > now)


@dataclass
class TenantPlaces:
    """The rollouts of one tenant's runs being rolled out in this process: at most ``limit``
    (``inference.tenant_max_rollouts_in_flight``), taken first come first served by the
    tenant's runs (:meth:`Admission.rollout` takes one after its run's place)."""

    tenant: str
    limit: int
    num_in_flight: int = 0
    num_waiting: int = 0
    _freed: asyncio.Condition = field(default_factory=asyncio.Condition, repr=False)
    _queue: deque[object] = field(default_factory=deque, repr=False)

    async def take(self, ended: Callable[[], str | None]) -> None:
        """Wait for a place; RunEnded when the rollout's run ends first (``ended()``: why, or None)."""
        ticket = object()
        async with self._freed:
            self.num_waiting += 1
            self._queue.append(ticket)
            try:
                await self._freed.wait_for(lambda: ended() is not None or (
                    self._queue[0] is ticket and self.num_in_flight < self.limit))
            finally:
                self.num_waiting -= 1
                self._queue.remove(ticket)
                self._freed.notify_all()
            reason = ended()
            if reason is not None:
                raise RunEnded(reason)
            self.num_in_flight += 1

    async def give(self) -> None:
        async with self._freed:
            self.num_in_flight -= 1
            self._freed.notify_all()

    async def wake(self) -> None:
        """A run of the tenant ended: its rollouts waiting here leave (RunEnded)."""
        async with self._freed:
            self._freed.notify_all()


@dataclass
class Slot:
    """One group's admission: ``n`` rollouts, of which the bus stored ``num_stored`` once
    the group is published (None until then: all ``n`` count)."""

    n: int
    num_stored: int | None = None


@dataclass
class Admission:
    """The counters and the rule; :meth:`slot` waits for room."""

    batch_size: int
    max_off_policy_steps: int
    max_in_flight: int
    trainer_step: int = 0
    weights_loaded: bool = False  # nothing is admitted before the run's first weights are loaded
    spare: int = 0  # inference.spare_rollouts: admitted beyond the staleness budget
    num_unused: int = 0  # rollouts of the groups the trainer consumed untrained: their allowance comes back
    num_issued: int = 0
    num_in_flight: int = 0
    num_waiting: int = 0
    ended: str | None = None  # why the run takes no tasks (RunEnd's reason); None while it does
    num_skipped: int = 0  # rollouts of tasks left over when the run ended
    on_change: Callable[[], None] | None = None  # called after every change of the counters
    shared: SharedIssued | None = None  # the bound shared with the other replicas (None: this one's alone)
    tenant: TenantPlaces | None = None  # the places of the run's tenant in this process (None: no quota)
    num_waiting_tenant: int = 0  # rollouts that hold the run's place and wait for one of the tenant's
    _num_placed: int = 0  # the run's places taken: rolling out, or waiting for the tenant's place
    # Two conditions on one lock: tasks waiting for budget wake when the budget moves, rollouts waiting
    # for a place when a place frees (a place changes three times a rollout: waking every waiting
    # task then cost more than the rest of admission).
    _changed: asyncio.Condition = field(init=False, repr=False)  # the budget
    _place_freed: asyncio.Condition = field(init=False, repr=False)
    _queue: deque[object] = field(default_factory=deque, repr=False)  # tasks waiting for budget, in order
    _places: deque[object] = field(default_factory=deque, repr=False)  # rollouts waiting for a place, in order

    def __post_init__(self) -> None:
        lock = asyncio.Lock()
        self._changed, self._place_freed = asyncio.Condition(lock), asyncio.Condition(lock)

    @classmethod
    def for_run(cls, cfg: RunConfig, num_issued: int = 0, on_change: Callable[[], None] | None = None,
                shared: SharedIssued | None = None, tenant: TenantPlaces | None = None) -> Admission:
        return cls(batch_size=cfg.trainer.batch_size, max_off_policy_steps=cfg.trainer.max_off_policy_steps,
                   max_in_flight=cfg.inference.max_rollouts_in_flight, spare=cfg.inference.spare_rollouts,
                   num_issued=num_issued, on_change=on_change, shared=shared, tenant=tenant)

    def _counted(self) -> None:
        if self.on_change is not None:
            self.on_change()

    @property
    def max_issued(self) -> int:
        return (self.trainer_step + self.max_off_policy_steps + 1) * self.batch_size + self.num_unused + self.spare

    def fits(self, n: int) -> bool:
        return self.weights_loaded and self.num_issued + n <= self.max_issued

    def check(self, n: int) -> None:
        """Refuse a group that could never be admitted (it would wait forever)."""
        first_allowance = (self.max_off_policy_steps + 1) * self.batch_size
        if n > first_allowance:
            raise ValueError(f"num_rollouts={n} exceeds (trainer.max_off_policy_steps + 1) * trainer.batch_size = "
                             f"{first_allowance}: the trainer could not step before this group is sampled")

    async def loaded(self, update: events.WeightUpdate) -> None:
        """This replica loaded ``update``'s weights: its version and the trainer's count of dropped
        rollouts (typed fields; ``update.metrics`` are figures for people, not read here)."""
        await self.advance(update.version, update.num_unused_total)

    async def advance(self, trainer_step: int, num_unused: int = 0) -> None:
        """Weights of version ``trainer_step`` were loaded: more rollouts may be issued."""
        async with self._changed:
            if not self.weights_loaded or trainer_step > self.trainer_step or num_unused > self.num_unused:
                self.weights_loaded = True
                self.trainer_step = max(self.trainer_step, trainer_step)
                self.num_unused = max(self.num_unused, num_unused)
                self._changed.notify_all()
                self._counted()

    async def set_ended(self, reason: str | None) -> None:
        """The run ended (``reason``): release every waiting task (with RunEnded) and refuse new
        ones; None: it takes tasks (again, when it was resumed)."""
        async with self._changed:
            if reason != self.ended:
                self.ended = reason
                self._changed.notify_all()
                self._place_freed.notify_all()
                self._counted()
        if reason is not None and self.tenant is not None:
            await self.tenant.wake()

    def skip(self, n: int) -> None:
        """Count ``n`` rollouts of a task left over from before the run ended (never sampled)."""
        self.num_skipped += n
        self._counted()

    @asynccontextmanager
    async def slot(self, n: int) -> AsyncIterator[Slot]:
        """Issue ``n`` rollouts (a group) against the run's budget; on leaving, the rollouts the
        bus stored stay issued (set :attr:`Slot.num_stored` once the group is published), the
        rest are given back. Each rollout then takes its place with :meth:`rollout`.

        Raises RunEnded when the run ends before (or while) the task waits for room."""
        self.check(n)
        ticket = object()
        async with self._changed:
            self.num_waiting += n
            self._queue.append(ticket)
            self._counted()
        admitted = False
        try:
            while True:
                async with self._changed:
                    await self._changed.wait_for(lambda: self.ended is not None or (self._queue[0] is ticket
                                                                                     and self.fits(n)))
                    if self.ended is not None:
                        self.num_skipped += n
                        self._counted()
                        raise RunEnded(self.ended)
                    bound = self.max_issued
                # First in line and within this replica's bound: within the run's, over every replica?
                if self.shared is None or await self.shared.reserve(n, bound):
                    admitted = True
                    break
                async with self._changed:  # until the bound moves, or the others may have published
                    await wait_at_most(self._changed.wait(), RETRY_S)
        finally:
            async with self._changed:
                if admitted:
                    self.num_issued += n
                self.num_waiting -= n
                self._queue.remove(ticket)
                self._changed.notify_all()  # the next in line may fit now
                self._counted()
        slot = Slot(n)
        failed = False
        try:
            yield slot
        except BaseException as exc:
            failed = True
            if isinstance(exc, RunEnded):  # its rollouts waited for places when the run ended
                self.num_skipped += n
            raise
        finally:
            # Published: what the bus did not store (it was there already) comes back. Never
            # published (the block raised first): all of it comes back.
            stored = slot.num_stored if slot.num_stored is not None else 0 if failed else n
            if self.shared is not None:
                await self.shared.release(n, stored)
            async with self._changed:
                self.num_issued -= n - stored
                self._changed.notify_all()
                self._counted()

    @asynccontextmanager
    async def rollout(self) -> AsyncIterator[None]:
        """Hold one of the run's ``max_in_flight`` places, then one of its tenant's, while one
        rollout of an admitted group runs; places go first come first served. Raises RunEnded
        when the run ends while the rollout waits."""
        ticket = object()
        async with self._place_freed:
            self.num_waiting += 1
            self._places.append(ticket)
            self._counted()
            try:
                await self._place_freed.wait_for(lambda: self.ended is not None or (
                    self._places[0] is ticket and self._num_placed < self.max_in_flight))
            finally:
                self.num_waiting -= 1
                self._places.remove(ticket)
                self._place_freed.notify_all()
            if self.ended is not None:
                self._counted()
                raise RunEnded(self.ended)
            self._num_placed += 1
        try:
            if self.tenant is not None:
                self.num_waiting_tenant += 1
                self._counted()
                try:
                    await self.tenant.take(lambda: self.ended)
                finally:
                    self.num_waiting_tenant -= 1
            self.num_in_flight += 1
            self._counted()
            try:
                yield
            finally:
                self.num_in_flight -= 1
                if self.tenant is not None:
                    await self.tenant.give()
        finally:
            async with self._place_freed:
                self._num_placed -= 1
                self._place_freed.notify_all()
                self._counted()

    def counters(self) -> dict[str, Any]:
        tenant = {} if self.tenant is None else {
            "tenant": self.tenant.tenant, "num_waiting_tenant": self.num_waiting_tenant,
            "tenant_in_flight": self.tenant.num_in_flight, "tenant_max_in_flight": self.tenant.limit}
        return {"trainer_step": self.trainer_step, "num_unused": self.num_unused, "max_issued": self.max_issued,
                "num_issued": self.num_issued, "num_in_flight": self.num_in_flight, "num_waiting": self.num_waiting,
                "num_skipped": self.num_skipped, "ended": self.ended, **tenant}
