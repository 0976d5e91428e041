"""A rollout's trace graph as it is built: nodes deduplicated by content hash, with parents.

Every chat request a harness makes is a list of messages. :meth:`TraceGraph.match` finds the
longest path of the graph, from a root, whose messages equal the request's first messages; the
rest of the request and the model's answer hang below that path as new nodes. So a multi-turn
conversation is one chain, a retry (the same messages asked again) is a sibling answer, a
sub-agent (another system prompt) is another root, and a harness that edits its history starts
a branch where the history changed.

This module holds the message layer and the bookkeeping; the token layer (what the inference
service sampled, how a new turn extends the sampled tokens) is filled in by whoever builds the
nodes. :func:`rollout_from_messages` builds a message-only rollout from a finished
conversation (evaluation against an endpoint that returns no tokens, tests of rewards).

It is also the one owner of walks over a rollout's graph, whoever holds its nodes:
:func:`walk` (root to a node), :func:`leaves`, :func:`branches` (one per leaf),
:func:`final_branch` (the one that ends at the last node: what rewards read) and
:func:`join_tokens` (a branch's token spans concatenated: what the model saw). They work on
any node type through a :class:`NodeFields` that says how to read an id, a parent and a
token span: :data:`NODES` for :class:`flywheel.contract.events.Node` (inference, scorer,
trainer, the SDK), :data:`ROWS` for the trace store's rows and decoded events (dicts), so no
caller converts its nodes first. Not covered: ordering beyond what callers pass in (a
node's place is its index in the sequence given).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import Any, Generic, Literal, TypeVar

from flywheel.contract import events

N = TypeVar("N")
TokenLayer = tuple[Sequence[int], Sequence[float], Sequence[bool]]  # token ids, logprobs, loss mask


@dataclass(frozen=True)
class NodeFields(Generic[N]):
    """How to read a node of one kind: its id, its parent's id (None for a root), and its token
    layer (ids, logprobs and loss mask; None for a node without tokens)."""

    id: Callable[[N], str]
    parent_id: Callable[[N], str | None]
    token_layer: Callable[[N], TokenLayer | None]


def _node_layer(node: events.Node) -> TokenLayer | None:
    span = node.tokens
    return None if span is None else (span.token_ids, span.logprobs, span.loss_mask)


def _row_layer(row: Mapping[str, Any]) -> TokenLayer | None:
    span = row.get("tokens")
    # An encoded TokenSpan leaves out empty lists (defaults are omitted on the wire).
    return None if span is None else (span.get("token_ids", ()), span.get("logprobs", ()), span.get("loss_mask", ()))


NODES: NodeFields[events.Node] = NodeFields(attrgetter("id"), attrgetter("parent_id"), _node_layer)
# Dicts with "id", "parent_id" (absent: a root) and "tokens" (a TokenSpan as a dict, or None):
# the store's rows, and nodes of a Rollout event decoded to builtins.
ROWS: NodeFields[Mapping[str, Any]] = NodeFields(itemgetter("id"), lambda row: row.get("parent_id"), _row_layer)


class TokenLayerError(ValueError):
    """A node whose token ids, logprobs and loss mask differ in length."""


@dataclass(frozen=True)
class Tokens:
    """Token spans concatenated in node order: along a branch, exactly what the model saw."""

    token_ids: list[int]
    logprobs: list[float]
    loss_mask: list[bool]
    # The environment's tokens (aligned with token_ids; empty: not worked out): what the trainer's
    # echo term learns to predict (see flywheel_trainer.join.environment_mask).
    env_mask: list[bool] = field(default_factory=list)


def _by_id(nodes: Mapping[str, N] | Sequence[N], fields: NodeFields[Any]) -> Mapping[str, N]:
    return nodes if isinstance(nodes, Mapping) else {fields.id(n): n for n in nodes}


def walk(nodes: Mapping[str, N] | Sequence[N], leaf_id: str, fields: NodeFields[Any] = NODES) -> tuple[list[N], bool]:
    """The branch that ends at ``leaf_id``, root first, following parent links among ``nodes``
    (a sequence, or a mapping by id); and whether it reaches a root. It stops short (False) at a
    parent that is not among ``nodes`` (a live trace whose earlier node has not arrived yet) or
    at a node already on the branch (a cycle, which content-hashed ids rule out unless a
    producer breaks the contract). KeyError when ``leaf_id`` is not among them."""
    by_id = _by_id(nodes, fields)
    branch: list[N] = []
    seen: set[str] = set()
    node: N | None = by_id[leaf_id]
    while node is not None:
        node_id = fields.id(node)
        if node_id in seen:
            break
        branch.append(node)
        seen.add(node_id)
        parent_id = fields.parent_id(node)
        if parent_id is None:
            return branch[::-1], True
        node = by_id.get(parent_id)
    return branch[::-1], False


def leaves(nodes: Sequence[N], fields: NodeFields[Any] = NODES) -> list[N]:
    """The nodes no other node names as its parent, in the order given: one per branch."""
    parents = {fields.parent_id(n) for n in nodes}
    return [n for n in nodes if fields.id(n) not in parents]


def branches(nodes: Sequence[N], fields: NodeFields[Any] = NODES) -> list[list[N]]:
    """Every root-to-leaf branch of a rollout's nodes, in the order their leaves come."""
    by_id = _by_id(nodes, fields)
    return [walk(by_id, fields.id(leaf), fields)[0] for leaf in leaves(nodes, fields)]


def final_branch(nodes: Sequence[N], fields: NodeFields[Any] = NODES) -> list[N]:
    """The branch, root first, that ends at the last of ``nodes`` (a rollout lists its final
    answer last): the conversation rewards read. Empty for no nodes."""
    return walk(nodes, fields.id(nodes[-1]), fields)[0] if nodes else []


def join_tokens(nodes: Iterable[N], fields: NodeFields[Any] = NODES, *, context: Collection[str] = (),
                strict: bool = False) -> Tokens:
    """The token spans of ``nodes`` concatenated in order (nodes without tokens add nothing).
    Nodes whose ids are in ``context`` add their tokens with the loss mask off (shared with a
    branch trained before). ``strict``: raise :class:`TokenLayerError` naming the node whose
    lists differ in length (the trainer's check); otherwise they are joined as they are (the
    store shows what was recorded)."""
    token_ids: list[int] = []
    logprobs: list[float] = []
    loss_mask: list[bool] = []
    for node in nodes:
        layer = fields.token_layer(node)
        if layer is None:
            continue
        ids, probs, mask = layer
        n = len(ids)
        if strict and (len(probs) != n or len(mask) != n):
            raise TokenLayerError(f"node {fields.id(node)}: {n} token ids but {len(probs)} logprobs and "
                                  f"{len(mask)} loss-mask entries")
        token_ids += ids
        logprobs += probs
        loss_mask += [False] * len(mask) if context and fields.id(node) in context else mask
    return Tokens(token_ids, logprobs, loss_mask)


class TraceGraph:
    """The nodes of one rollout, in creation order (parents before children)."""

    def __init__(self) -> None:
        self.nodes: dict[str, events.Node] = {}  # insertion order = creation order
        self.last: events.Node | None = None  # the newest node: the end of the final branch

    def add(self, parent_id: str | None, message: events.Message, tokens: events.TokenSpan | None = None
            ) -> tuple[events.Node, bool]:
        """The node for ``message`` (with ``tokens``) below ``parent_id``; True when it is new."""
        node_id = events.node_id(parent_id, message, tokens)
        existing = self.nodes.get(node_id)
        if existing is not None:
            self.last = existing
            return existing, False
        node = events.Node(id=node_id, parent_id=parent_id, message=message, tokens=tokens)
        self.nodes[node_id] = node
        self.last = node
        return node, True

    def children(self, parent_id: str | None) -> list[events.Node]:
        return [n for n in self.nodes.values() if n.parent_id == parent_id]

    def match(self, messages: Sequence[events.Message]) -> list[events.Node]:
        """The longest path from a root whose messages equal ``messages[:len(path)]``.

        Where several nodes carry the same message below one parent (answers sampled twice),
        the newest wins: a harness continues the conversation it last saw."""
        path: list[events.Node] = []
        parent: str | None = None
        for message in messages:
            same = [n for n in self.children(parent) if n.message == message]
            if not same:
                break
            path.append(same[-1])
            parent = same[-1].id
        return path

    def branch(self, leaf_id: str) -> list[events.Node]:
        """Root to ``leaf_id``."""
        return walk(self.nodes, leaf_id)[0]

    def leaves(self) -> list[events.Node]:
        return leaves(list(self.nodes.values()))

    def ordered(self) -> list[events.Node]:
        """Every node, parents first, the newest node (end of the final branch) last."""
        nodes = list(self.nodes.values())
        if self.last is None or nodes[-1].id == self.last.id:
            return nodes
        # The final branch may end at a node met again (deduplicated); move its branch to the end
        # so the last node is its leaf while parents still come first.
        tail = [n.id for n in self.branch(self.last.id)]
        rest = [n for n in nodes if n.id not in tail]
        return rest + [self.nodes[i] for i in tail]


def rollout_from_messages(*, run: str, env: str, task_id: str, task_data: dict[str, Any],
                          messages: Sequence[events.Message], index: int = 0, group_size: int = 1,
                          state: dict[str, Any] | None = None,
                          status: Literal["completed", "truncated", "error"] = "completed",
                          error: str | None = None, metrics: dict[str, float] | None = None,
                          rollout_id: str | None = None) -> events.Rollout:
    """A message-only rollout (no token layer) whose one branch is ``messages``."""
    graph = TraceGraph()
    parent: str | None = None
    for message in messages:
        node, _ = graph.add(parent, message)
        parent = node.id
    kwargs: dict[str, Any] = {"id": rollout_id} if rollout_id else {}
    return events.Rollout(run=run, env=env, task_id=task_id, group_id=task_id, index=index, task_data=task_data,
                          nodes=graph.ordered(), status=status, error=error, metrics=metrics or {},
                          group_size=group_size, state=state or {}, **kwargs)
