"""``/v1/traces``: a rollout's trace graph, one branch of it, and a live stream of it.

- ``GET /v1/traces/{rollout}``: every node with its parent (the message layer; the token
  layer with ``?tokens=true``, and the teachers' logprobs of the sampled tokens where the
  run names teachers) and the leaves, one per branch (sub-agents, retries). Once
  the rollout is recorded its graph is exactly the nodes the rollout lists, in its order
  (live nodes of an attempt that inference abandoned are dropped, see
  :meth:`flywheel_gateway.store.Store.record`), and ``final_leaf`` is its last node. While
  it runs, the live nodes of every attempt show, an abandoned one as one more branch.
- ``GET /v1/traces/{rollout}/branches/{node}``: the branch from the root to that node,
  both layers, and its token spans concatenated (the tokens the model saw).
- ``GET /v1/traces/{rollout}/stream``: server-sent events. ``node`` for every trace node
  already published for the rollout, then for each new one as inference publishes it; then
  one ``rollout`` (the rollout's fields) when the rollout itself lands, and the stream ends.
  A comment line every ``KEEPALIVE_S`` keeps proxies from closing a quiet stream
  (:mod:`flywheel_gateway.sse` frames the events).

The live stream reads the bus, not the store: an ordered consumer on the rollout's
``traces.<run>.<rollout>`` subject from the start, and a headers-only one on
``rollouts.<run>.>`` from a little before the first trace node, watching for the rollout's
id (its payload is fetched once it shows; a batch message, a group's rollouts, is fetched to
see whether it holds it). When the rollout is already recorded, the stream
replays it from the store instead (the bus keeps traces for its retention only). A client
that disconnects ends both consumers (:class:`flywheel.contract.bus.Replay`). A message that does not
decode as the events its subject promises (:func:`flywheel.contract.bus.decode_events`) is logged and
skipped; it never ends the stream (the recorder dead-letters it).

Not covered: resuming a stream (``Last-Event-ID``; a client that reconnects gets every node
again, each carries its id); a rollout that never lands keeps its stream open until the
client leaves.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from typing import Any

import msgspec
import nats.js.errors
from fastapi import APIRouter, HTTPException
from fastapi.responses import StreamingResponse
from nats.aio.msg import Msg

from flywheel.contract import events
from flywheel.contract.bus import HEADER_MSG_ID, Bus, Replay, Undecodable, decode_events
from flywheel.sdk.tracegraph import ROWS, join_tokens, leaves, walk
from flywheel_gateway import sse
from flywheel_gateway.auth import CallerDep, check_rollout
from flywheel_gateway.deps import BusDep, NodeIdPath, RolloutIdPath, StoreDep, StreamedRolloutIdPath
from flywheel_gateway.models import (
    BranchPublic,
    NodePublic,
    RolloutPublic,
    SignalPublic,
    TokenLayerPublic,
    TracePublic,
)
from flywheel_gateway.responses import ERROR_RESPONSES
from flywheel_gateway.store import Store, shown_error

router = APIRouter(prefix="/v1/traces", tags=["traces"], responses=ERROR_RESPONSES)

# The rollout is published after its first trace node; its stream may be led by another
# server of a cluster, whose clock may differ: watch from this much earlier.
CLOCK_SKEW_S = 30.0
log = logging.getLogger(__name__)


async def _trace(store: Store, rollout_id: str, tokens: bool) -> list[dict[str, Any]]:
    nodes = await store.get_trace(rollout_id, tokens=tokens)
    if nodes is None:
        raise HTTPException(404, f"no trace recorded for rollout {rollout_id!r}")
    return nodes


@router.get("/{rollout_id}", response_model=TracePublic)
async def get_trace(rollout_id: RolloutIdPath, store: StoreDep, bus: BusDep, who: CallerDep,
                    tokens: bool = False) -> TracePublic:
    """The nodes of the rollout's graph in order, each with its parent; live nodes show before
    the rollout finishes. Once it is recorded, the graph is exactly the rollout's nodes and
    ``final_leaf`` its last one. ``?tokens=true`` adds each node's token ids, logprobs and
    loss mask, and each teacher's logprobs of the sampled tokens (``signals``)."""
    await check_rollout(who, store, bus, rollout_id)
    nodes = await _trace(store, rollout_id, tokens)
    finished = await store.has_rollout(rollout_id)
    signals = [SignalPublic.model_validate(row) for row in await store.get_signals(rollout_id)] if tokens else None
    return TracePublic(rollout_id=rollout_id, finished=finished, nodes=[NodePublic.model_validate(n) for n in nodes],
                       leaves=[n["id"] for n in leaves(nodes, ROWS)],
                       final_leaf=nodes[-1]["id"] if finished and nodes else None, signals=signals)


@router.get("/{rollout_id}/branches/{node_id}", response_model=BranchPublic)
async def get_branch(rollout_id: RolloutIdPath, node_id: NodeIdPath, store: StoreDep, bus: BusDep, who: CallerDep,
                     tokens: bool = False) -> BranchPublic:
    """The branch from the root to ``node_id`` (a leaf of /v1/traces/{rollout_id}, or any node
    of the rollout), root first. ``?tokens=true`` adds each node's token layer and the
    branch's, concatenated."""
    await check_rollout(who, store, bus, rollout_id)
    nodes = await _trace(store, rollout_id, tokens)
    if not any(n["id"] == node_id for n in nodes):
        raise HTTPException(404, f"node {node_id!r} is not in the trace of rollout {rollout_id!r}; its leaves are "
                                 f"listed by GET /v1/traces/{rollout_id}")
    branch, complete = walk(nodes, node_id, ROWS)
    return BranchPublic(rollout_id=rollout_id, leaf_id=node_id, complete=complete,
                        nodes=[NodePublic.model_validate(n) for n in branch],
                        tokens=TokenLayerPublic(**vars(join_tokens(branch, ROWS))) if tokens else None)


@router.get("/{rollout_id}/stream", response_class=StreamingResponse, responses=sse.responses("node..., rollout."))
async def stream_trace(rollout_id: StreamedRolloutIdPath, store: StoreDep, bus: BusDep, who: CallerDep,
                       tokens: bool = False) -> StreamingResponse:
    """Follow a rollout: ``node`` events (a node as in /v1/traces, ``position`` in arrival
    order), then one ``rollout`` event when it lands, then the end. ``reward`` in it is null
    while no score is recorded (scores come after the rollout)."""
    await check_rollout(who, store, bus, rollout_id)
    if await store.has_rollout(rollout_id):
        stream = _replay_recorded(store, rollout_id, tokens)
    else:
        first = await _first_trace_message(bus, rollout_id)
        if first is not None:
            stream = _follow_live(bus, first, rollout_id, tokens)
        elif await store.has_rollout(rollout_id):  # it landed and was recorded meanwhile
            stream = _replay_recorded(store, rollout_id, tokens)
        else:
            raise HTTPException(404, f"no trace of rollout {rollout_id!r} on the bus or in the store; a rollout shows "
                                     "once inference publishes its first trace node (when it has run for the "
                                     "inference setting live_trace_after_s) or once it lands")
    return sse.event_stream(stream)


async def _replay_recorded(store: Store, rollout_id: str, tokens: bool) -> sse.Events:
    for node in await _trace(store, rollout_id, tokens):
        yield "node", NodePublic.model_validate(node).model_dump(mode="json")
    rollout = await store.get_rollout(rollout_id)
    yield "rollout", RolloutPublic.model_validate(rollout).model_dump(mode="json")


async def _first_trace_message(bus: Bus, rollout_id: str) -> Any:
    """The first trace node of the rollout on the bus (its subject names the run), or None."""
    try:
        return await bus.js.get_msg("TRACES", seq=1, subject=f"traces.*.{rollout_id}", next=True)
    except nats.js.errors.NotFoundError:
        return None


def _node_public(node: events.Node, position: int, tokens: bool) -> dict[str, Any]:
    return NodePublic.model_validate({
        "id": node.id, "parent_id": node.parent_id, "position": position, "message": msgspec.to_builtins(node.message),
        "tokens": msgspec.to_builtins(node.tokens) if tokens and node.tokens is not None else None,
    }).model_dump(mode="json")


def _rollout_public(r: events.Rollout) -> dict[str, Any]:
    num_tokens = sum(len(n.tokens.token_ids) for n in r.nodes if n.tokens is not None)
    return RolloutPublic(id=r.id, run=r.run, env=r.env, task_id=r.task_id, group_id=r.group_id, index=r.index,
                         policy_version=r.policy_version, status=r.status, error=shown_error(r.status, r.error, []),
                         reward=None, num_tokens=num_tokens, created_at=r.created_at).model_dump(mode="json")


async def _follow_live(bus: Bus, first: Any, rollout_id: str, tokens: bool) -> sse.Events:
    subject: str = first.subject
    run = subject.split(".")[1]
    node_decoder: events.Decoder[events.TraceNode] = events.Decoder(events.TraceNode)
    rollout_decoder: events.Decoder[events.Rollout] = events.Decoder(events.Rollout)
    sent: set[str] = set()
    last_seq = 0

    def node_events(msg: Msg) -> list[tuple[str, Any]]:
        """The message's nodes not sent yet (a model call's nodes come as one batch)."""
        nonlocal last_seq
        last_seq = msg.metadata.sequence.stream
        try:
            found = decode_events(node_decoder, msg)
        except Undecodable as exc:
            log.warning("trace stream of %s: skipping %s seq %d: %s", rollout_id, msg.subject, last_seq, exc)
            return []
        items = []
        for node in (t.node for t in found):
            if node.id not in sent:  # else republished past the bus's duplicate window
                sent.add(node.id)
                items.append(("node", _node_public(node, len(sent) - 1, tokens)))
        return items

    async with (Replay(bus, subject) as traces,
                Replay(bus, f"rollouts.{run}.>", start_time=first.time - timedelta(seconds=CLOCK_SKEW_S),
                       headers_only=True) as landed):
        next_trace = asyncio.ensure_future(traces.next())
        next_landed = asyncio.ensure_future(landed.next())
        try:
            rollout: events.Rollout | None = None
            while rollout is None:
                done, _ = await asyncio.wait({next_trace, next_landed}, timeout=sse.KEEPALIVE_S,
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    yield None
                if next_trace in done:
                    msg = next_trace.result()
                    next_trace = asyncio.ensure_future(traces.next())
                    for item in node_events(msg):
                        yield item
                if next_landed in done:
                    msg = next_landed.result()
                    next_landed = asyncio.ensure_future(landed.next())
                    headers = msg.headers or {}
                    # The rollout alone, or a batch (its group's rollouts) that may hold it: read it.
                    if headers.get(HEADER_MSG_ID) == rollout_id or events.BATCH_HEADER in headers:
                        raw = await bus.js.get_msg("ROLLOUTS", msg.metadata.sequence.stream)
                        try:
                            rollout = next((r for r in decode_events(rollout_decoder, raw) if r.id == rollout_id),
                                           None)
                        except Undecodable as exc:  # not the rollout: keep waiting for it
                            log.warning("trace stream of %s: skipping %s seq %d: %s", rollout_id, raw.subject,
                                        raw.seq, exc)
            # Inference publishes every trace node before the rollout: deliver the ones still on their way.
            end_seq = (await bus.js.get_last_msg("TRACES", subject)).seq or 0
            while last_seq < end_seq:
                msg = await next_trace
                next_trace = asyncio.ensure_future(traces.next())
                for item in node_events(msg):
                    yield item
            for node in rollout.nodes:  # nodes the rollout has that were never published live
                if node.id not in sent:
                    sent.add(node.id)
                    yield "node", _node_public(node, len(sent) - 1, tokens)
            yield "rollout", _rollout_public(rollout)
        finally:
            next_trace.cancel()
            next_landed.cancel()
