"""A group's rollouts onto the bus: one message, fitted to what the bus takes, counted as stored.

The group goes out as one message when every rollout of it has ended. A rollout the bus cannot
take (over nats-server's ``max_payload``: the server drops a connection that sends one) goes as
an ``error`` saying so, without its graph, so its group is done and the run goes on.

Budgets count what reached the bus, never attempts: rollout ids hash (task id, index), so the
bus keeps one copy of a group rolled out twice, and the admission keeps only the rollouts the
bus stored (:func:`num_stored`; :mod:`flywheel_inference.admission`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import msgspec
import nats.errors
import nats.js.errors
from nats.js.api import PubAck

from flywheel.contract import events, metrics
from flywheel.contract.bus import Bus, PayloadTooLarge

log = logging.getLogger(__name__)


async def publish_group(bus: Bus, rollouts: list[events.Rollout]) -> int:
    """Publish a group's ``rollouts`` together (one message); returns how many of them the bus
    stored (the others it had already)."""
    try:
        acks = await bus.publish_many(rollouts, events.MSGPACK, together=True)  # the group: one message
    except PayloadTooLarge:  # the bus's guard: nothing of the group was sent
        # A rollout the bus cannot take (the server drops a connection that sends one): it goes
        # as an error saying so, without its graph, so its group is done and the run goes on.
        rollouts = [fitted(bus, r) for r in rollouts]
        acks = await bus.publish_many(rollouts, events.MSGPACK, together=True)
    for done in rollouts:
        metrics.ROLLOUTS.labels(done.run, done.status).inc()
        if done.usage is not None:
            metrics.TOKENS.labels(done.run).inc(done.usage.sampled_tokens)
    return await num_stored(bus, rollouts, acks)


def fitted(bus: Bus, rollout: events.Rollout) -> events.Rollout:
    """``rollout``, or when the bus cannot take it (over nats-server's max_payload), the same
    rollout failed with the reason and without its trace graph, state and task row."""
    try:
        bus.check_fits(rollout, events.MSGPACK)
        return rollout
    except PayloadTooLarge as exc:
        size, most = exc.size, exc.limit
    log.warning("rollout %s of task %s: %d bytes, more than the bus takes (%d); published as an error",
                rollout.id, rollout.task_id, size, most)
    return msgspec.structs.replace(
        rollout, status="error", nodes=[], state={}, task_data={},
        error=f"rollout {rollout.id}: its trace graph and state are {size} bytes, more than the bus takes "
              f"({most} bytes, nats-server's max_payload); lower sampling.max_tokens or the harness's turns, "
              "or raise max_payload")


async def num_stored(bus: Bus, rollouts: Sequence[events.Rollout], acks: Sequence[PubAck]) -> int:
    """How many of ``rollouts`` this publish stored (a batch's share its ack). A duplicate's
    ack names the stored copy: the same bytes are this publish's own (its ack was lost and it
    was sent again); other bytes were sampled by an earlier delivery of the task (another
    process, or before a restart)."""
    num = 0
    by_message: dict[int, tuple[PubAck, list[events.Rollout]]] = {}
    for rollout, ack in zip(rollouts, acks, strict=True):
        by_message.setdefault(ack.seq, (ack, []))[1].append(rollout)
    for ack, members in by_message.values():
        if not ack.duplicate:
            num += len(members)
            continue
        try:
            stored = await bus.js.get_msg(ack.stream, ack.seq)
        except nats.js.errors.NotFoundError:  # gone already (the stream's limits): not this one's
            continue
        ours = (events.encode_many(members, events.MSGPACK) if len(members) > 1
                else events.encode(members[0], events.MSGPACK))
        if stored.data == ours:
            num += len(members)
    if num < len(rollouts):
        log.info("task %s: %d of its %d rollouts were on the bus already (an earlier delivery); not counted",
                 rollouts[0].task_id, len(rollouts) - num, len(rollouts))
    return num
