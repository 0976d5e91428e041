"""Rollout partitions split over a scorer's replicas: each partition consumed by one replica at a time.

A rollout's subject ends in its group's partition (``rollouts.<run>.<env>.<partition>``,
:func:`flywheel.contract.events.partition_of`), so every member of a group is in one partition.
A scorer with durable ``D`` consumes partition ``k`` with the durable ``D-p<k>``: its subjects
with ``.<k>`` appended. The replicas of ``D`` (processes of one scorer) split the partitions
between them by leases in the bus's partitions bucket, entries the server removes
``PARTITION_LEASE_S`` after their last write:

- ``D.member.<replica>``: the replica is live (each renews its own);
- ``D.partition.<k>``: the replica that consumes partition ``k`` (claimed by create: one owner).

Every :data:`ROUND_S` each replica renews its leases and works out its share: partition ``k``
goes to the live replica at position ``k mod n`` of their sorted names. A partition no longer
its own it gives up: the group members it holds are handed back at once (nak), the partition's
consumer drains what is being scored, and the lease is deleted; then the new owner claims it,
and the handed-back members are redelivered to it, so the group forms again whole there. A
replica that dies stops renewing: its leases lapse within ``PARTITION_LEASE_S``, the others'
next round counts it gone and claims its partitions, and what it had fetched and not acked is
redelivered after the durable's ack wait (the setting ``scorer.ack_wait_s``).

A handed-back message counts as a delivery on the server, so a partition's consumer allows
``HANDBACK_ALLOWANCE`` deliveries beyond the usual ``MAX_DELIVER``: a rollout handed back at
several rebalances in a row is not dead-lettered for it (one that fails is, a few deliveries
later than elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from flywheel.contract import metrics
from flywheel.contract.bus import PARTITION_LEASE_S, PARTITIONS_BUCKET, Bus, Consumer, ConsumerStats, wait_at_most
from flywheel.contract.events import ROLLOUT_PARTITIONS, partition_of
from flywheel.contract.service import instance_name

log = logging.getLogger(__name__)

ROUND_S = PARTITION_LEASE_S / 3  # leases renewed, and shares worked out, this often
HANDBACK_ALLOWANCE = 4  # deliveries a partition's consumer allows beyond MAX_DELIVER: hand-backs at rebalances
_TOKEN = re.compile(r"[^-_A-Za-z0-9]")


def partition_filter(subjects: str | list[str] | None, k: int) -> str | list[str]:
    """A scorer's rollout subjects (None: every rollout) narrowed to partition ``k``."""
    if subjects is None:
        return f"rollouts.*.*.{k}"
    if isinstance(subjects, str):
        return f"{subjects}.{k}"
    return [f"{s}.{k}" for s in subjects]


def share(replicas: list[str], replica: str) -> set[int]:
    """The partitions ``replica`` consumes when ``replicas`` are live: ``k`` goes to the one at ``k mod n``."""
    live = sorted(set(replicas) | {replica})
    return {k for k in range(ROLLOUT_PARTITIONS) if live[k % len(live)] == replica}


@dataclass
class _Owned:
    consumer: Consumer
    running: asyncio.Task[None]
    revision: int  # of its lease entry, for compare-and-set renewals


class Partitions:
    """The partitions of durable ``durable`` this replica consumes, each with its consumer
    (``consumer_for(k)``). ``hand_back(k)``: hand back the members of partition ``k``'s groups
    held now (called as the partition is given up, before its consumer drains). Runs like a
    :class:`Consumer`: :meth:`run` until :meth:`stop`."""

    def __init__(self, bus: Bus, durable: str, consumer_for: Callable[[int], Consumer],
                 hand_back: Callable[[int], None], replica: str | None = None,
                 on_first: Callable[[Consumer], None] | None = None) -> None:
        self.bus = bus
        self.durable = durable
        self.replica = replica or instance_name()
        self.consumer_for = consumer_for
        self.hand_back = hand_back
        self.on_first = on_first  # called with the first partition's consumer once it is bound
        self.owned: dict[int, _Owned] = {}
        self._consumers: list[Consumer] = []  # every partition consumer this replica ran, for stats
        self._stopping = asyncio.Event()
        self._waiting_since: dict[int, float] = {}  # partitions of this replica's share held by another
        self._said_waiting: set[int] = set()

    def owns(self, group_id: str) -> bool:
        """Whether this replica consumes the partition of group ``group_id`` now."""
        return partition_of(group_id) in self.owned

    def stop(self) -> None:
        self._stopping.set()

    @property
    def stats(self) -> ConsumerStats:
        """The outcomes of every partition consumer this replica ran, summed."""
        return ConsumerStats(**{f: sum(getattr(c.stats, f) for c in self._consumers)
                                for f in ("acked", "naked", "dead_lettered", "handed_back")})

    async def serve(self, stopping: asyncio.Event) -> None:
        """:meth:`run` until ``stopping`` is set (a service's background task)."""
        running = asyncio.ensure_future(self.run())
        stop_wait = asyncio.ensure_future(stopping.wait())
        try:
            await asyncio.wait([running, stop_wait], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_wait.cancel()
            self.stop()
        await running

    async def run(self) -> None:
        kv = await self.bus.partitions_kv()
        try:
            while not self._stopping.is_set():
                try:
                    await self._round(kv)
                except (nats.errors.Error, TimeoutError) as exc:  # the bus restarting: leases are renewed next round
                    log.warning("%s: partition round failed (%s); retrying", self.durable, exc)
                await wait_at_most(self._stopping.wait(), ROUND_S)
        finally:
            await asyncio.gather(*(self._give_up(kv, k) for k in list(self.owned)))
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await kv.delete(self._member_key)

    @property
    def _member_key(self) -> str:
        return f"{self.durable}.member.{_TOKEN.sub('_', self.replica)}"

    def _partition_key(self, k: int) -> str:
        return f"{self.durable}.partition.{k}"

    async def _members(self, kv: KeyValue) -> list[str]:
        prefix = f"{self.durable}.member."
        names = []
        for key in await self.bus.kv_keys(PARTITIONS_BUCKET):
            if not key.startswith(prefix):
                continue
            try:
                entry = await kv.get(key)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                continue  # lapsed or left since the listing
            try:
                names.append(str(json.loads(entry.value or b"{}")["replica"]))
            except (ValueError, KeyError, TypeError):
                log.warning("%s: partitions entry %s is not a member's lease; left out", self.durable, key)
        return names

    async def _round(self, kv: KeyValue) -> None:
        for k, owned in list(self.owned.items()):
            if owned.running.done():  # a partition's consumer failed: so does the process (its supervisor restarts it)
                failed = None if owned.running.cancelled() else owned.running.exception()
                await self._give_up(kv, k)
                raise RuntimeError(f"{self.durable}: partition {k}'s consumer stopped: {failed!r}") from failed
        await kv.put(self._member_key, json.dumps({"replica": self.replica}).encode())
        members = await self._members(kv)
        mine = share(members, self.replica)
        for k in sorted(self.owned):
            if k not in mine:
                log.info("%s: partition %d goes to another replica; handing it over", self.durable, k)
                await self._give_up(kv, k)
                continue
            owned = self.owned[k]
            try:
                owned.revision = await kv.update(self._partition_key(k), self._lease(), last=owned.revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                log.warning("%s: partition %d's lease lapsed (this replica was stalled past %.0fs); another replica "
                            "may have it: giving it up", self.durable, k, PARTITION_LEASE_S)
                await self._give_up(kv, k, lapsed=True)
        before = set(self.owned)
        for k in sorted(mine - before):
            await self._claim(kv, k)
        if set(self.owned) != before:
            log.info("%s: this replica consumes partitions %s of %d (%d live replicas)", self.durable,
                     sorted(self.owned), ROLLOUT_PARTITIONS, len(set(members) | {self.replica}))

    def _lease(self) -> bytes:
        return json.dumps({"owner": self.replica}).encode()

    async def _claim(self, kv: KeyValue, k: int) -> None:
        try:
            revision = await kv.create(self._partition_key(k), self._lease())
        except nats.js.errors.KeyWrongLastSequenceError:
            self._say_waiting(k)
            return
        self._waiting_since.pop(k, None)
        self._said_waiting.discard(k)
        consumer = self.consumer_for(k)
        try:
            await consumer.ensure()
        except BaseException:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await kv.delete(self._partition_key(k), last=revision)
            raise
        if self.on_first is not None and not self.owned:
            self.on_first(consumer)
            self.on_first = None
        self._consumers.append(consumer)
        self.owned[k] = _Owned(consumer, asyncio.ensure_future(consumer.run()), revision)
        metrics.PARTITIONS.labels(self.durable).set(len(self.owned))

    def _say_waiting(self, k: int) -> None:
        """A partition of this replica's share is still another's: say so once it waits a lease long."""
        since = self._waiting_since.setdefault(k, time.monotonic())
        if time.monotonic() - since > PARTITION_LEASE_S and k not in self._said_waiting:
            self._said_waiting.add(k)
            log.info("%s: waiting for partition %d: another replica still holds its lease (it gives it up at its "
                     "next round, or the lease lapses if it died)", self.durable, k)

    async def _give_up(self, kv: KeyValue, k: int, lapsed: bool = False) -> None:
        owned = self.owned.pop(k)  # owns() is False from here: its groups' new arrivals are handed back
        metrics.PARTITIONS.labels(self.durable).set(len(self.owned))
        owned.consumer.stop()
        # The held members go back once nothing more is fetched (a fetch under way would bring
        # them straight back here), and before the drain, which waits for them.
        await wait_at_most(owned.consumer.fetching_ended.wait(), owned.consumer.fetch_timeout_s + 1)
        self.hand_back(k)
        await asyncio.gather(owned.running, return_exceptions=True)
        if not lapsed:
            with contextlib.suppress(nats.errors.Error, nats.js.errors.KeyWrongLastSequenceError, TimeoutError):
                await kv.delete(self._partition_key(k), last=owned.revision)
