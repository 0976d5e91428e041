"""A teacher's values (flywheel_inference.teacher.teacher_signals) on the tiny model, against its
own plain forward pass: rollouts built as the interception endpoint builds them (the real
tokenizer, multi-turn, a retry that branches), rows of one prompt that compute it once, a
model that can only run whole rows, the privileged context that replaces the prompt, and the
rollouts that get an error signal instead of values."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from flywheel.contract import events
from flywheel.contract.bus import PayloadTooLarge
from flywheel.sdk import models
from flywheel.sdk.environment import load_environment
from flywheel.sdk.tracegraph import TokenLayerError, TraceGraph, branches, join_tokens
from flywheel_inference.completion import Completion
from flywheel_inference.interception import Renderer, record
from flywheel_inference.teacher import Request, can_share_prefixes, context_of, teacher_signals

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[Any, Any]:
    return models.load_model(tiny_model_dir)


class Conversation:
    """A rollout's trace graph as the interception endpoint records it: each call's messages are
    matched against the graph, and the answer (random letters and EOS) hangs below them."""

    def __init__(self, tok: Any, seed: int = 0) -> None:
        self.tok = tok
        self.renderer = Renderer.of(tok)
        self.graph = TraceGraph()
        self.rng = random.Random(seed)

    def call(self, messages: list[events.Message], num_tokens: int = 6) -> events.Message:
        """One model call on ``messages``; returns the answer's message (for the next call's history)."""
        text = "".join(self.rng.choice("abcdefgh") for _ in range(num_tokens))
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        plan = self.renderer.plan(self.graph, messages, None, tools_ok=True)
        record(self.graph, plan, Completion(ids, [-1.0] * len(ids), "stop", text), version=0,
               texts=self.renderer.token_texts)
        return events.Message(role="assistant", content=text)

    def rollout(self, rollout_id: str = "ro1", temperature: float = 0.7, run: str = "r") -> events.Rollout:
        return events.Rollout(id=rollout_id, run=run, env="reverse_text", task_id="t1", group_id="t1",
                              nodes=self.graph.ordered(), sampling=events.Sampling(temperature=temperature))


def multi_turn(tok: Any, prompt: list[events.Message], seed: int = 0, rollout_id: str = "ro1",
               temperature: float = 0.7, run: str = "r") -> events.Rollout:
    """Three branches: a first answer retried (two siblings), and a second turn after a user
    message below the first answer, retried too (two siblings sharing the first answer)."""
    chat = Conversation(tok, seed)
    first = chat.call(prompt)
    chat.call(prompt)  # a retry of the first call: a sibling branch
    again = [*prompt, first, events.Message(role="user", content="again")]
    chat.call(again)
    chat.call(again, num_tokens=9)  # a retry of the second turn: shares the prompt, the first answer, "again"
    return chat.rollout(rollout_id, temperature, run)


def sampled_nodes(rollout: events.Rollout) -> list[events.Node]:
    return [n for n in rollout.nodes if n.tokens is not None and any(n.tokens.loss_mask)]


def plain_logprobs(model: Any, token_ids: list[int], temperature: float) -> list[float]:
    """The model's own forward on one sequence: value of token t given the tokens before it."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([token_ids])).logits[0].float()
    picked = torch.log_softmax(logits[:-1] / temperature, dim=-1).gather(-1, torch.tensor(token_ids[1:])[:, None])
    return [0.0, *picked.squeeze(-1).tolist()]


def expected_values(model: Any, rollout: events.Rollout, temperature: float) -> dict[str, list[float]]:
    """Each sampled node's values from a plain forward of every branch it is on (checked the
    same in each)."""
    expected: dict[str, list[float]] = {}
    for branch in branches(rollout.nodes):
        logprobs = plain_logprobs(model, join_tokens(branch).token_ids, temperature)
        start = 0
        for node in branch:
            assert node.tokens is not None
            span = node.tokens
            if any(span.loss_mask):
                values = [logprobs[start + j] if m else 0.0 for j, m in enumerate(span.loss_mask)]
                if node.id in expected:
                    assert values == pytest.approx(expected[node.id], abs=TOLERANCE)
                expected[node.id] = values
            start += len(span.token_ids)
    return expected


def assert_close(got: dict[str, list[float]], expected: dict[str, list[float]]) -> None:
    assert got.keys() == expected.keys()
    for node_id, values in expected.items():
        assert len(got[node_id]) == len(values)
        assert max(abs(a - b) for a, b in zip(got[node_id], values, strict=True)) < TOLERANCE, node_id


PROMPT = [events.Message(role="system", content="Reverse the text."), events.Message(role="user", content="abcd")]


def test_values_equal_the_models_own_forward_on_every_branch_shared_nodes_once(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    rollout = multi_turn(tok, PROMPT)
    assert len(branches(rollout.nodes)) == 3 and len(sampled_nodes(rollout)) == 4
    other = multi_turn(tok, PROMPT, seed=1)
    # Five sequences in passes of two, of different lengths (right-padded), at the rollouts' temperatures.
    (signal, other_signal), usage = teacher_signals(
        model, [Request(rollout, 0.7), Request(other, 1.3)], source="t", model_name="tiny", max_batch_size=2)
    assert_close(signal.values, expected_values(model, rollout, 0.7))
    assert_close(other_signal.values, expected_values(model, other, 1.3))
    assert (signal.id, signal.rollout_id, signal.source, signal.model, signal.temperature, signal.error) == (
        "ro1.t", "ro1", "t", "tiny", 0.7, None)
    assert signal.subject() == "signals.r.reverse_text.t"
    # The first answer is on two branches and valued once: the sampled tokens counted are each node's once.
    num_sampled = sum(sum(n.tokens.loss_mask) for r in (rollout, other) for n in sampled_nodes(r) if n.tokens)
    assert usage.num_sampled_tokens == num_sampled
    # Each value of a node with sampled tokens is its loss mask's: the generation prompt gets 0.0.
    first = sampled_nodes(rollout)[0]
    assert first.tokens is not None and not first.tokens.loss_mask[0]
    assert signal.values[first.id][0] == 0.0 and all(v < 0 for v in signal.values[first.id][-3:])


def test_the_top_k_equal_the_models_own_forward_at_every_sampled_position(tiny: tuple[Any, Any]) -> None:
    """With a top-k each sampled token also gets the k largest entries of the model's own
    log-softmax in its place (ids and logprobs, likeliest first, at the rollout's temperature),
    in shared-prefix passes as in whole rows; other tokens get empty lists, and the values are
    those without a top-k."""
    model, tok = tiny
    requests = [Request(multi_turn(tok, PROMPT), 0.7), *mixed(tok)]
    plain, _ = teacher_signals(model, requests, source="t", model_name="tiny", max_batch_size=64)
    for runner, size in ((model, 64), (WholeRows(model), 3)):
        signals, _ = teacher_signals(runner, requests, source="t", model_name="tiny", max_batch_size=size, top_k=5)
        for request, signal, without in zip(requests, signals, plain, strict=True):
            assert_close(signal.values, without.values)
            assert signal.top_ids.keys() == signal.top_logprobs.keys() == signal.values.keys()
            for branch in branches(request.rollout.nodes):
                ids = join_tokens(branch).token_ids
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([ids])).logits[0].float()
                expected = torch.log_softmax(logits / request.temperature, dim=-1).topk(5, dim=-1)
                start = 0
                for node in branch:
                    assert node.tokens is not None
                    for j, sampled in enumerate(node.tokens.loss_mask):
                        if node.id in signal.top_ids:
                            got_ids, got = signal.top_ids[node.id][j], signal.top_logprobs[node.id][j]
                            if not sampled or start + j == 0:
                                assert got_ids == got == []
                            else:
                                assert got_ids == expected.indices[start + j - 1].tolist()
                                assert max(abs(a - b) for a, b in zip(
                                    got, expected.values[start + j - 1].tolist(), strict=True)) < TOLERANCE
                    start += len(node.tokens.token_ids)
    assert all(not s.top_ids and not s.top_logprobs for s in plain)


OTHER_PROMPT = [events.Message(role="system", content="Reverse the text."),
                events.Message(role="user", content="hgfedcba")]


def group(tok: Any, prompt: list[events.Message], num_samples: int, first_seed: int,
          temperature: float) -> list[Request]:
    """A group's rollouts: answers of different lengths to one prompt."""
    requests = []
    for s in range(num_samples):
        chat = Conversation(tok, seed=first_seed + s)
        chat.call(prompt, num_tokens=3 + s)
        requests.append(Request(chat.rollout(f"ro{first_seed + s}", temperature), temperature))
    return requests


def hand_made(rollout_id: str, token_ids: list[int], loss_mask: list[bool]) -> Request:
    """A rollout of one node whose tokens are sampled from its first or second on (nothing before
    them to share)."""
    span = events.TokenSpan(token_ids=token_ids, logprobs=[-1.0] * len(token_ids), loss_mask=loss_mask)
    node = events.Node(id=rollout_id, message=events.Message(role="assistant"), tokens=span)
    return Request(events.Rollout(id=rollout_id, run="r", env="e", task_id="t", group_id="t", nodes=[node]), 1.0)


def mixed(tok: Any) -> list[Request]:
    """Two groups (8 and 5 samples), a multi-turn rollout of the first group's prompt, and rollouts
    with nothing to share: 17 rows with 4 distinct prefixes (one empty), and a rollout whose
    only sampled token is its first (valued 0.0, no row)."""
    return [*group(tok, PROMPT, 8, 0, 0.7), *group(tok, OTHER_PROMPT, 5, 100, 1.3),
            Request(multi_turn(tok, PROMPT, seed=7, rollout_id="mt"), 1.0),
            hand_made("second", [5, 6, 7, 8], [False, True, True, True]),
            hand_made("first", [9], [True])]


class WholeRows(torch.nn.Module):
    """A causal LM of the user's own: its forward takes no positions, cache or logits_to_keep."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config

    def get_input_embeddings(self) -> torch.nn.Module:
        embeddings: torch.nn.Module = self.inner.get_input_embeddings()
        return embeddings

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        return self.inner(input_ids=input_ids, attention_mask=attention_mask)


def test_rows_of_one_prompt_compute_it_once_with_the_values_of_a_plain_forward(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    requests = mixed(tok)
    assert can_share_prefixes(model)
    shapes: list[tuple[int, ...]] = []
    hook = model.register_forward_pre_hook(lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                           with_kwargs=True)
    try:
        signals, usage = teacher_signals(model, requests, source="t", model_name="tiny", max_batch_size=64)
    finally:
        hook.remove()
    # One pass: the 4 distinct prefixes (left-padded), then the 17 rows from them, none running its
    # prompt again (whole, the longest would be as wide as its branch).
    longest = max(len(join_tokens(b).token_ids) for r in requests for b in branches(r.rollout.nodes))
    assert [shape[0] for shape in shapes] == [4, 17]
    assert shapes[1][1] <= longest - len(models.render_prompt(tok, PROMPT))
    for request, signal in zip(requests, signals, strict=True):
        assert signal.error is None
        assert_close(signal.values, expected_values(model, request.rollout, request.temperature))
    assert signals[-1].values == {"first": [0.0]}
    assert usage.num_sampled_tokens == sum(sum(n.tokens.loss_mask) for r in requests
                                           for n in sampled_nodes(r.rollout) if n.tokens)
    # In passes of 5 rows, a group is split between passes: the values are the same.
    few, few_usage = teacher_signals(model, requests, source="t", model_name="tiny", max_batch_size=5)
    for signal, again in zip(signals, few, strict=True):
        assert_close(again.values, signal.values)
    assert few_usage == usage


def test_a_model_that_takes_whole_rows_only_gets_the_same_values(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    whole = WholeRows(model)
    assert not can_share_prefixes(whole)
    requests = mixed(tok)
    signals, _ = teacher_signals(whole, requests, source="t", model_name="tiny", max_batch_size=4)
    for request, signal in zip(requests, signals, strict=True):
        assert_close(signal.values, expected_values(model, request.rollout, request.temperature))


def test_a_branch_past_the_teachers_positions_gets_an_error_signal_and_the_others_values(
        tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    chat = Conversation(tok)
    chat.call(PROMPT, num_tokens=300)  # the tiny model has 256 positions
    long = chat.rollout("long")
    short = multi_turn(tok, PROMPT)
    (too_long, fine), _ = teacher_signals(model, [Request(long, 1.0), Request(short, 1.0)], source="t",
                                          model_name="tiny", max_batch_size=8)
    assert too_long.values == {} and too_long.error is not None
    assert "longer than teacher 't'" in too_long.error and "max_position_embeddings = 256" in too_long.error
    assert fine.error is None and fine.values


def test_an_inconsistent_token_layer_raises(tiny: tuple[Any, Any]) -> None:
    span = events.TokenSpan(token_ids=[1, 2], logprobs=[-1.0], loss_mask=[True, True])
    node = events.Node(id="n", message=events.Message(role="assistant"), tokens=span)
    bad = events.Rollout(id="bad", run="r", env="e", task_id="t", group_id="t", nodes=[node])
    with pytest.raises(TokenLayerError, match="2 token ids but 1 logprobs"):
        teacher_signals(tiny[0], [Request(bad, 1.0)], source="t", model_name="tiny", max_batch_size=1)


def test_the_privileged_context_replaces_the_first_prompt_and_keeps_the_rest(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    env = load_environment("reverse_text")
    task = {"text": "abcd"}
    prompt = env.prompt_messages(task)
    rollout = multi_turn(tok, prompt)
    context = context_of(tok, env.prompt_messages(task), env.privileged_messages(task, "The answer is {answer}."))
    teacher_prompt = models.render_prompt(tok, [events.Message(role="system", content="The answer is dcba."),
                                                *prompt])
    assert context.teacher == teacher_prompt
    (signal,), _ = teacher_signals(model, [Request(rollout, 0.7, context)], source="t", model_name="tiny",
                                   max_batch_size=4)
    assert signal.error is None
    # Expected: each branch with its first prompt (the nodes before the first answer, and the
    # answer's generation prompt) replaced by the teacher's, through a plain forward.
    expected: dict[str, list[float]] = {}
    for branch in branches(rollout.nodes):
        first = next(i for i, n in enumerate(branch) if n in sampled_nodes(rollout))
        span = branch[first].tokens
        assert span is not None
        k = span.loss_mask.index(True)
        assert join_tokens(branch[:first]).token_ids + span.token_ids[:k] == context.student
        tokens = teacher_prompt + join_tokens(branch[first:]).token_ids[k:]
        logprobs = plain_logprobs(model, tokens, 0.7)
        start = len(teacher_prompt) - k
        for node in branch[first:]:
            assert node.tokens is not None
            if any(node.tokens.loss_mask):
                expected[node.id] = [logprobs[start + j] if m else 0.0 for j, m in enumerate(node.tokens.loss_mask)]
            start += len(node.tokens.token_ids)
    assert_close(signal.values, expected)
    # The context changes what the teacher sees: values differ from the student's context.
    (plain,), _ = teacher_signals(model, [Request(rollout, 0.7)], source="t", model_name="tiny", max_batch_size=4)
    assert any(abs(a - b) > 1e-3 for node_id in expected for a, b in zip(plain.values[node_id],
                                                                          signal.values[node_id], strict=True))


def test_a_rollout_whose_prompt_is_not_the_environments_gets_an_error_signal(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    env = load_environment("reverse_text")
    task = {"text": "abcd"}
    changed = [events.Message(role="system", content="Reverse it, please."), *env.prompt_messages(task)[1:]]
    rollout = multi_turn(tok, changed)
    context = context_of(tok, env.prompt_messages(task), env.privileged_messages(task, "{answer}"))
    (signal,), usage = teacher_signals(model, [Request(rollout, 1.0, context)], source="t", model_name="tiny",
                                       max_batch_size=4)
    assert signal.values == {} and signal.error is not None and "first prompt is not the render" in signal.error
    assert usage.num_tokens == 0


def test_a_signal_larger_than_the_bus_takes_becomes_an_error_that_says_what_to_lower(tiny: tuple[Any, Any]) -> None:
    from flywheel_inference.teacher import fit_payload

    model, tok = tiny
    requests = [Request(multi_turn(tok, PROMPT), 0.7), Request(multi_turn(tok, PROMPT, seed=1, rollout_id="ro2"), 1.0)]
    signals, _ = teacher_signals(model, requests, source="t", model_name="tiny", max_batch_size=64, top_k=8)
    def size_of(signal: events.Signal) -> int:  # the payload (the bus adds its headers)
        return len(events.encode(signal, events.MSGPACK))

    def check(limit: int) -> Callable[[events.Signal], None]:  # as Bus.check_fits, at this limit
        def fits(signal: events.Signal) -> None:
            if size_of(signal) > limit:
                raise PayloadTooLarge(signal.subject(), signal.id, size_of(signal), limit)
        return fits

    sizes = [size_of(s) for s in signals]
    assert fit_payload(signals, check(max(sizes))) == signals  # all fit: unchanged
    fitted = fit_payload(signals, check(min(sizes)))
    big = sizes.index(max(sizes))
    assert fitted[1 - big] == signals[1 - big]
    too_big = fitted[big]
    assert too_big.values == too_big.top_ids == too_big.top_logprobs == {} and too_big.id == signals[big].id
    assert too_big.error is not None and too_big.error.startswith(
        f"rollout {too_big.rollout_id}: its signal is {max(sizes)} bytes, more than the bus takes ({min(sizes)}, "
        "nats-server's max_payload); lower the top_k of the part that reads it (8 now) or raise max_payload")
