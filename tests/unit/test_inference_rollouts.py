"""Rollout events from a task and its completions: node chain, token layers, ids."""

from __future__ import annotations

from pathlib import Path

from flywheel import events, models
from flywheel.environment import load_environment
from flywheel_inference import rollouts
from flywheel_inference.backends import Completion

MESSAGES = load_environment("reverse_text").prompt({"text": "abc"})


def test_prompt_tokens_are_split_per_message_and_concatenate_to_the_prompt(tiny_model_dir: Path) -> None:
    _, tok = models.load_model(tiny_model_dir)
    prompt = models.render_prompt(tok, MESSAGES)
    spans = rollouts.split_prompt(MESSAGES, prompt, lambda ms: models.render_messages(tok, ms))
    assert [m.role for m in MESSAGES] == ["system", "user"]
    assert spans[0] == models.render_messages(tok, MESSAGES[:1]) and spans[0] + spans[1] == prompt


def test_a_template_that_is_not_prefix_stable_puts_every_prompt_token_on_the_last_node() -> None:
    prompt = [1, 2, 3, 4]
    assert rollouts.split_prompt(MESSAGES, prompt, lambda ms: [9]) == [[], [1, 2, 3, 4]]


def test_a_rollout_is_a_chain_with_both_layers() -> None:
    task = events.Task(id="t1", run="r1", env="reverse_text", data={"text": "abc"}, num_rollouts=3)
    nodes = rollouts.prompt_nodes(MESSAGES, [[1, 2], [3]])
    completion = Completion(token_ids=[7, 8, 9], logprobs=[-0.1, -0.2, -0.3], finish_reason="length", text="cb")
    answer = rollouts.assistant_node(nodes[-1].id, completion, version=4)
    r = rollouts.build_rollout(task, 2, [*nodes, answer], completion, 4, generation_s=0.5)
    system, user, assistant = r.nodes
    assert (system.parent_id, user.parent_id, assistant.parent_id) == (None, system.id, user.id)
    assert system.tokens == events.TokenSpan(token_ids=[1, 2], logprobs=[0.0, 0.0], loss_mask=[False, False])
    assert assistant.message == events.Message(role="assistant", content="cb")
    assert assistant.tokens == events.TokenSpan(token_ids=[7, 8, 9], logprobs=[-0.1, -0.2, -0.3],
                                                loss_mask=[True] * 3, policy_version=4)
    assert assistant.id == events.node_id(user.id, assistant.message, assistant.tokens)
    assert (r.group_id, r.index, r.group_size, r.policy_version, r.status) == ("t1", 2, 3, 4, "truncated")
    assert r.metrics == {"num_completion_tokens": 3.0, "num_prompt_tokens": 3.0, "generation_s": 0.5}
    assert r.id == rollouts.rollout_id("t1", 2) != rollouts.rollout_id("t1", 1)
    assert "." not in r.id  # it is a subject token of traces.<run>.<rollout>
