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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flywheel.contract import events


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
        out = []
        node: events.Node | None = self.nodes[leaf_id]
        while node is not None:
            out.append(node)
            node = self.nodes.get(node.parent_id) if node.parent_id else None
        return out[::-1]

    def leaves(self) -> list[events.Node]:
        parents = {n.parent_id for n in self.nodes.values()}
        return [n for n in self.nodes.values() if n.id not in parents]

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


def branches(nodes: Sequence[events.Node]) -> list[list[events.Node]]:
    """Every root-to-leaf branch of a rollout's nodes, in the order their leaves were created."""
    by_id = {n.id: n for n in nodes}
    parents = {n.parent_id for n in nodes}
    out = []
    for leaf in (n for n in nodes if n.id not in parents):
        branch = []
        node: events.Node | None = leaf
        while node is not None:
            branch.append(node)
            node = by_id.get(node.parent_id) if node.parent_id else None
        out.append(branch[::-1])
    return out


def rollout_from_messages(*, run: str, env: str, task_id: str, task_data: dict[str, Any],
                          messages: Sequence[events.Message], index: int = 0, group_size: int = 1,
                          state: dict[str, Any] | None = None, status: str = "completed",
                          error: str | None = None, metrics: dict[str, float] | None = None,
                          rollout_id: str | None = None) -> events.Rollout:
    """A message-only rollout (no token layer) whose one branch is ``messages``."""
    graph = TraceGraph()
    parent: str | None = None
    for message in messages:
        node, _ = graph.add(parent, message)
        parent = node.id
    kwargs = {"id": rollout_id} if rollout_id else {}
    return events.Rollout(run=run, env=env, task_id=task_id, group_id=task_id, index=index, task_data=task_data,
                          nodes=graph.ordered(), status=status, error=error, metrics=metrics or {},
                          group_size=group_size, state=state or {}, **kwargs)
