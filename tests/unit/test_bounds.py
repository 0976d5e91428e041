"""Every number that crosses the bus is bounded where it is read (flywheel.contract.events.checked,
applied by the bus layer's decoding): a score, rollout or signal out of bounds arrives failed and
is dropped with the reason; any other event out of bounds is undecodable (dead-lettered)."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from flywheel.contract import events
from flywheel.contract.bus import HEADER_CONTENT_TYPE, Undecodable, decode_events
from flywheel_trainer.join import Joiner
from tests.unit.test_trainer_join import make_rollout, make_score

SCORERS = {"similarity": 1.0}


def delivered(event: events.Event, content_type: str = events.MSGPACK) -> Any:
    """A message as the bus delivers it: msgpack carries NaN and inf, plain JSON carries 1e300."""
    return SimpleNamespace(data=events.encode(event, content_type), subject=event.subject(),
                           headers={HEADER_CONTENT_TYPE: content_type})


@pytest.mark.parametrize("value", [1e300, -1e7, math.nan, math.inf])
def test_a_score_out_of_bounds_arrives_failed_and_its_rollout_is_dropped_never_trained(value: float) -> None:
    rollout, other = make_rollout("a", "g"), make_rollout("b", "g", index=1)
    content_type = events.JSON if math.isfinite(value) else events.MSGPACK
    (score,) = decode_events(events.Decoder(), delivered(make_score(rollout, "similarity", value), content_type))
    assert score.value == 0.0 and score.error is not None
    assert "out of bounds" in score.error and "value=" in score.error
    joiner = Joiner(SCORERS, max_off_policy_steps=1)
    for r, s in ((rollout, score), (other, make_score(other, "similarity", 0.5))):
        joiner.add_rollout(r)
        joiner.add_score(s)
    take = joiner.take(1)
    assert take is not None and take.trained_ids == ["b"] and take.dropped == {"a": "scorer_error"}


def test_scores_within_bounds_pass_untouched() -> None:
    score = make_score(make_rollout("a", "g"), "similarity", -1e6)
    score = msgspec.structs.replace(score, components={"x": 0.5})
    assert events.checked(score) is score
    bad = msgspec.structs.replace(score, components={"x": math.nan})
    assert events.checked(bad).error is not None and events.checked(bad).components == {}


def test_a_rollout_with_a_logprob_that_is_not_finite_arrives_as_an_error_every_reader_can_show() -> None:
    rollout = make_rollout("a", "g", logprobs=[-0.5, math.nan])
    (got,) = decode_events(events.Decoder(), delivered(rollout))
    assert got.status == "error" and "logprobs" in (got.error or "")
    assert all(math.isfinite(lp) for n in got.nodes if n.tokens for lp in n.tokens.logprobs)
    assert msgspec.json.encode(got)  # encodable as plain JSON (the trace API's answer)
    joiner = Joiner(SCORERS, max_off_policy_steps=1)
    other = make_rollout("b", "g", index=1)
    joiner.add_rollout(got)
    joiner.add_rollout(other)
    joiner.add_score(make_score(other, "similarity", 0.5))
    take = joiner.take(1)
    assert take is not None and take.trained_ids == ["b"] and take.dropped == {"a": "rollout_error"}
    # A logprob far below anything sampled, or above 0, is out of bounds too; -1e4 is not.
    assert events.checked(make_rollout("b", "g", logprobs=[-2e4])).status == "error"
    assert events.checked(make_rollout("b", "g", logprobs=[0.5])).status == "error"
    fine = make_rollout("b", "g", logprobs=[-1e4, 0.0])
    assert events.checked(fine) is fine
    greedy = msgspec.structs.replace(fine, sampling=events.Sampling(temperature=0.0))  # a greedy eval's, recorded
    assert events.checked(greedy) is greedy


def test_a_rollout_whose_group_cannot_be_is_undecodable() -> None:
    for changes in ({"group_size": 0}, {"group_size": 10**6}, {"index": 3, "group_size": 2},
                    {"policy_version": -1}):
        rollout = msgspec.structs.replace(make_rollout("a", "g"), **changes)
        with pytest.raises(Undecodable, match=next(iter(changes))):
            decode_events(events.Decoder(), delivered(rollout))


def test_a_weight_update_with_counts_past_their_bounds_is_undecodable() -> None:
    update = events.WeightUpdate(run="r", version=3, uri="file:///w", sha256="0" * 64, size_bytes=10)
    assert decode_events(events.Decoder(), delivered(update)) == [update]
    for changes, field in (({"num_dropped_total": 2**60}, "num_dropped_total"), ({"version": 2**40}, "version"),
                           ({"version": -1}, "version"), ({"metrics": {"loss": math.nan}}, "metrics")):
        bad = msgspec.structs.replace(update, **changes)
        with pytest.raises(Undecodable, match=field):
            decode_events(events.Decoder(), delivered(bad))


def test_tasks_signals_and_usage_are_bounded_too() -> None:
    task = events.Task(run="r", env="e", data={}, num_rollouts=10**6)
    with pytest.raises(events.OutOfBounds, match="num_rollouts"):
        events.checked(task)
    with pytest.raises(events.OutOfBounds, match="temperature"):
        events.checked(msgspec.structs.replace(task, num_rollouts=4, sampling=events.Sampling(temperature=math.nan)))
    usage = events.Usage(run="r", source="trainer", trained_tokens=-5)
    with pytest.raises(events.OutOfBounds, match="trained_tokens"):
        events.checked(usage)
    signal = events.Signal(run="r", env="e", rollout_id="a", group_id="g", source="t", values={"n": [-0.1, math.inf]})
    failed = events.checked(signal)
    assert failed.error is not None and failed.values == {}
    node = events.Node(id="n", message=events.Message(role="assistant"),
                       tokens=events.TokenSpan(token_ids=[1], logprobs=[math.nan], loss_mask=[True]))
    with pytest.raises(events.OutOfBounds, match="logprobs"):
        events.checked(events.TraceNode(run="r", rollout_id="a", node=node))


def test_a_batch_message_carries_its_checked_events() -> None:
    good = make_score(make_rollout("a", "g"), "similarity", 0.5)
    bad = make_score(make_rollout("b", "g"), "similarity", 1e300)
    msg: Any = SimpleNamespace(data=events.encode_many([good, bad], events.JSON), subject=good.subject(),
                               headers={HEADER_CONTENT_TYPE: events.JSON, events.BATCH_HEADER: "2"})
    first, second = decode_events(events.Decoder(), msg)
    assert first == good and second.error is not None and second.value == 0.0
