"""The trace graph's walks and token joins, the one copy every caller uses: on events.Node
structs (inference, trainer, SDK) and on the store's rows (dicts), with the same answers.
The graph as inference builds it is tested in tests/unit/test_inference_interception.py."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from flywheel.contract import events
from flywheel.sdk.tracegraph import (
    ROWS,
    TokenLayerError,
    TraceGraph,
    branches,
    final_branch,
    join_tokens,
    leaves,
    walk,
)


def test_branches_are_walked_from_their_leaf_to_the_root() -> None:
    graph: list[dict[str, str | None]] = [
        {"id": "s", "parent_id": None}, {"id": "u", "parent_id": "s"}, {"id": "a1", "parent_id": "u"},
        {"id": "t", "parent_id": "a1"}, {"id": "a2", "parent_id": "t"}, {"id": "retry", "parent_id": "u"}]
    assert walk(graph, "a2", ROWS) == (graph[:5], True)
    assert walk(graph, "retry", ROWS) == ([graph[0], graph[1], graph[5]], True)
    assert walk(graph[3:], "a2", ROWS) == (graph[3:5], False)  # a1 not arrived yet
    cycle = [{"id": "x", "parent_id": "y"}, {"id": "y", "parent_id": "x"}]
    assert walk(cycle, "x", ROWS) == ([cycle[1], cycle[0]], False)
    assert [leaf["id"] for leaf in leaves(graph, ROWS)] == ["a2", "retry"]
    assert [[n["id"] for n in b] for b in branches(graph, ROWS)] == [["s", "u", "a1", "t", "a2"], ["s", "u", "retry"]]
    assert final_branch(graph, ROWS) == [graph[0], graph[1], graph[5]] and final_branch([], ROWS) == []
    with pytest.raises(KeyError):
        walk(graph, "nope", ROWS)


def graph() -> TraceGraph:
    """system -> user -> answer (tokens), and a retry of the answer: two branches."""
    g = TraceGraph()
    system, _ = g.add(None, events.Message(role="system", content="be brief"),
                      events.TokenSpan(token_ids=[1, 2], logprobs=[0.0, 0.0], loss_mask=[False, False]))
    user, _ = g.add(system.id, events.Message(role="user", content="2+2?"), events.TokenSpan(token_ids=[3]))
    g.add(user.id, events.Message(role="assistant", content="4"),
          events.TokenSpan(token_ids=[4, 5], logprobs=[-0.5, -0.25], loss_mask=[True, True], policy_version=1))
    g.add(user.id, events.Message(role="assistant", content="four"),
          events.TokenSpan(token_ids=[6], logprobs=[-1.0], loss_mask=[True], policy_version=1))
    return g


def test_the_same_walks_on_nodes_and_on_their_rows() -> None:
    """The store's rows (nodes as the recorder decodes them: defaults left out) walk and join
    as the structs they were encoded from; no caller converts its nodes first."""
    nodes = graph().ordered()
    rows: list[dict[str, Any]] = msgspec.json.decode(msgspec.json.encode(nodes))
    assert "parent_id" not in rows[0] and "logprobs" not in rows[1]["tokens"]  # omitted defaults
    for b_nodes, b_rows in zip(branches(nodes), branches(rows, ROWS), strict=True):
        assert [n.id for n in b_nodes] == [r["id"] for r in b_rows]
    assert [n.message.content for n in final_branch(nodes)] == ["be brief", "2+2?", "four"]
    assert [r["id"] for r in final_branch(rows, ROWS)] == [n.id for n in final_branch(nodes)]
    first = branches(nodes)[0]
    assert join_tokens(first) == join_tokens(branches(rows, ROWS)[0], ROWS)
    # The user node's span has ids only: joined as recorded by the store, refused by the trainer's check.
    assert join_tokens(first).token_ids == [1, 2, 3, 4, 5]
    assert join_tokens(first).loss_mask == [False, False, True, True]
    with pytest.raises(TokenLayerError, match=r"node [0-9a-f]+: 1 token ids but 0 logprobs and 0 loss-mask entries"):
        join_tokens(first, strict=True)


def test_context_nodes_join_with_the_loss_off() -> None:
    g = graph()
    nodes = g.ordered()
    second = branches(nodes)[1]
    shared = {n.id for n in second[:2]}
    joined = join_tokens(second, context=shared)
    assert joined.token_ids == [1, 2, 3, 6] and joined.loss_mask == [False, False, True]
    assert join_tokens(second[2:], context={second[2].id}).loss_mask == [False]
    assert g.branch(second[-1].id) == second and [n.id for n in g.leaves()] == [b[-1].id for b in branches(nodes)]
