"""From a task and its sampled completions to trace nodes and rollout events.

A single-turn rollout is a chain of nodes: one per prompt message (system, user), then the
assistant's answer. Each node carries both layers: the message, and the tokens it adds to
its branch, so concatenating the chain's token spans gives exactly what the model saw
and sampled. The prompt's tokens are split across its messages where rendering the first
messages alone is a token prefix of the whole prompt (true of ordinary chat templates);
where it is not, every prompt token goes on the last prompt node and the others add none.
Prompt tokens have logprob 0.0, loss mask False and no policy version; the assistant's
tokens have their sampled logprobs, loss mask True and the version that sampled them.

Rollout ids are a hash of (task id, index), so a redelivered task publishes the same ids
and the bus deduplicates them. Not covered: multi-turn and tool-calling harnesses.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

from flywheel import events
from flywheel_inference.backends import Completion

RenderMessages = Callable[[Sequence[events.Message]], list[int]]


def rollout_id(task_id: str, index: int) -> str:
    return hashlib.sha256(f"{task_id}\x00{index}".encode()).hexdigest()[:32]


def split_prompt(messages: Sequence[events.Message], prompt_ids: Sequence[int],
                 render_messages: RenderMessages) -> list[list[int]]:
    """The prompt tokens each message adds (concatenated, they are ``prompt_ids``)."""
    cuts = [0]
    for k in range(1, len(messages)):
        prefix = render_messages(messages[:k])
        if len(prefix) < cuts[-1] or list(prompt_ids[:len(prefix)]) != prefix:
            return [[] for _ in messages[:-1]] + [list(prompt_ids)]
        cuts.append(len(prefix))
    cuts.append(len(prompt_ids))
    return [list(prompt_ids[a:b]) for a, b in zip(cuts, cuts[1:])]


def prompt_nodes(messages: Sequence[events.Message], spans: Sequence[Sequence[int]]) -> list[events.Node]:
    """A chain of nodes for the prompt messages, each with the tokens it adds."""
    nodes: list[events.Node] = []
    parent: str | None = None
    for message, span in zip(messages, spans, strict=True):
        tokens = events.TokenSpan(token_ids=list(span), logprobs=[0.0] * len(span), loss_mask=[False] * len(span))
        node = events.Node(id=events.node_id(parent, message, tokens), parent_id=parent, message=message, tokens=tokens)
        nodes.append(node)
        parent = node.id
    return nodes


def assistant_node(parent_id: str | None, completion: Completion, version: int) -> events.Node:
    message = events.Message(role="assistant", content=completion.text)
    n = len(completion.token_ids)
    tokens = events.TokenSpan(token_ids=list(completion.token_ids), logprobs=list(completion.logprobs),
                              loss_mask=[True] * n, policy_version=version)
    return events.Node(id=events.node_id(parent_id, message, tokens), parent_id=parent_id, message=message,
                       tokens=tokens)


def build_rollout(task: events.Task, index: int, nodes: list[events.Node], completion: Completion,
                  version: int, generation_s: float) -> events.Rollout:
    """The finished rollout; ``nodes`` ends with the assistant node."""
    return events.Rollout(
        id=rollout_id(task.id, index),
        run=task.run,
        env=task.env,
        task_id=task.id,
        group_id=task.id,
        index=index,
        policy_version=version,
        task_data=task.data,
        nodes=nodes,
        status="truncated" if completion.finish_reason == "length" else "completed",
        metrics={"num_completion_tokens": float(len(completion.token_ids)),
                 "num_prompt_tokens": float(sum(len(n.tokens.token_ids) for n in nodes[:-1] if n.tokens)),
                 "generation_s": generation_s},
        group_size=task.num_rollouts,
    )
