"""The trainer's join: readiness by scorer, whole groups, drops that are counted, staleness.

``make_rollout`` and ``make_score`` build events the way inference and the scorers do
(the token layer split over system, user and assistant nodes); the trainer's other tests
import them from here.
"""

from __future__ import annotations

import msgspec
import pytest

from flywheel.contract import events
from flywheel_trainer.join import BadRollout, Joiner, add_errors, sequences_of, tokens_of

SCORERS = {"similarity": 1.0, "exact": 0.5}


def make_rollout(rollout_id: str, group_id: str, *, prompt: list[int] | None = None,
                 completion: list[int] | None = None, logprobs: list[float] | None = None, group_size: int = 2,
                 policy_version: int = 0, run: str = "r", env: str = "reverse_text",
                 status: str = "completed", index: int = 0, sampling: events.Sampling | None = None) -> events.Rollout:
    """A single-turn rollout: the prompt tokens over a system and a user node, the completion on the assistant's."""
    prompt = prompt if prompt is not None else [1, 2, 3, 4]
    completion = completion if completion is not None else [5, 6]
    logprobs = logprobs if logprobs is not None else [-1.0] * len(completion)
    half = len(prompt) // 2
    spans = [
        ("system", events.TokenSpan(token_ids=prompt[:half], logprobs=[0.0] * half, loss_mask=[False] * half)),
        ("user", events.TokenSpan(token_ids=prompt[half:], logprobs=[0.0] * (len(prompt) - half),
                                  loss_mask=[False] * (len(prompt) - half))),
        ("assistant", events.TokenSpan(token_ids=completion, logprobs=logprobs, loss_mask=[True] * len(completion),
                                       policy_version=policy_version)),
    ]
    nodes, parent = [], None
    for role, span in spans:
        message = events.Message(role=role, content=role)  # type: ignore[arg-type]  # spans' roles are Message roles
        node = events.Node(id=events.node_id(parent, message, span), parent_id=parent, message=message, tokens=span)
        nodes.append(node)
        parent = node.id
    return events.Rollout(id=rollout_id, run=run, env=env, task_id=f"task-{group_id}", group_id=group_id,
                          group_size=group_size, policy_version=policy_version, nodes=nodes, index=index,
                          sampling=sampling, status=status)  # type: ignore[arg-type]  # callers pass a Rollout status


def make_score(rollout: events.Rollout, scorer: str, value: float, error: str | None = None) -> events.Score:
    return events.Score(id=f"{rollout.id}.{scorer}", run=rollout.run, env=rollout.env, rollout_id=rollout.id,
                        group_id=rollout.group_id, scorer=scorer, value=value, error=error)


def scored(joiner: Joiner, rollout: events.Rollout, similarity: float = 1.0, exact: float = 0.0) -> None:
    joiner.add_rollout(rollout)
    joiner.add_score(make_score(rollout, "similarity", similarity))
    joiner.add_score(make_score(rollout, "exact", exact))


def test_a_group_is_taken_whole_once_every_scorer_scored_every_rollout() -> None:
    joiner = Joiner(SCORERS, max_off_policy_steps=1)
    a, b = make_rollout("a", "g"), make_rollout("b", "g")
    joiner.add_rollout(a)
    joiner.add_score(make_score(a, "similarity", 0.8))
    joiner.add_score(make_score(a, "exact", 1.0))
    joiner.add_score(make_score(b, "similarity", 0.2))  # before its rollout: kept
    assert joiner.take(1) is None  # b is not here
    joiner.add_rollout(b)
    assert not joiner.is_ready("b") and joiner.take(1) is None  # b lacks "exact"
    joiner.add_score(make_score(b, "unknown-scorer", 5.0))  # not required: ignored
    joiner.add_score(make_score(b, "exact", 0.0))
    take = joiner.take(1)
    assert take is not None and not take.dropped
    [group] = take.groups
    assert [(s.rollout.id, s.reward) for s in group] == [("a", 0.8 + 0.5 * 1.0), ("b", 0.2)]
    assert joiner.num_buffered == 0 and joiner.consumed == {"a", "b"}


def test_take_waits_for_enough_groups_and_hands_out_the_oldest_first() -> None:
    joiner = Joiner(SCORERS, max_off_policy_steps=1)
    for g in ("g1", "g2", "g3"):
        for i in range(2):
            scored(joiner, make_rollout(f"{g}-{i}", g))
    joiner.add_rollout(make_rollout("g4-0", "g4"))  # incomplete group
    first = joiner.take(2)
    assert first is not None
    assert [[s.rollout.id for s in g] for g in first.groups] == [["g1-0", "g1-1"], ["g2-0", "g2-1"]]
    assert joiner.take(2) is None
    second = joiner.take(1)
    assert second is not None and second.trained_ids == ["g3-0", "g3-1"]
    assert joiner.num_buffered == 1


def test_a_take_is_ordered_by_task_seed_and_index_whatever_the_arrival_order() -> None:
    # A seeded run's step sums its groups in one order, so two runs of one seed train alike.
    joiner = Joiner(SCORERS, max_off_policy_steps=1)
    for g, seed in (("g-late", 40), ("g-early", 20), ("g-mid", 30)):
        for i in (1, 0):
            scored(joiner, make_rollout(f"{g}-{i}", g, index=i, sampling=events.Sampling(seed=seed + i)))
    take = joiner.take(3)
    assert take is not None
    assert [[s.rollout.id for s in g] for g in take.groups] == [
        ["g-early-0", "g-early-1"], ["g-mid-0", "g-mid-1"], ["g-late-0", "g-late-1"]]


def test_a_waiting_joiner_names_the_scorers_its_rollouts_wait_for() -> None:
    joiner = Joiner({"similarity": 1.0, "nospace": 0.5}, max_off_policy_steps=1)
    a, b = make_rollout("a", "g"), make_rollout("b", "g")
    joiner.add_rollout(a)
    joiner.add_rollout(b)
    joiner.add_score(make_score(a, "similarity", 1.0))
    assert joiner.awaited_scores() == {"nospace": 2, "similarity": 1}
    joiner.add_score(make_score(b, "similarity", 1.0))
    assert joiner.awaited_scores() == {"nospace": 2}  # what `waits for N done groups` names


def test_a_scorer_error_drops_the_rollout_and_is_counted_never_a_zero() -> None:
    joiner = Joiner(SCORERS, max_off_policy_steps=1)
    a, b = make_rollout("a", "g"), make_rollout("b", "g")
    scored(joiner, a, similarity=0.3)
    joiner.add_rollout(b)
    joiner.add_score(make_score(b, "similarity", 0.0, error="TimeoutError: reward took over 30s"))
    take = joiner.take(1)  # b is done (dropped) without waiting for its other score
    assert take is not None
    assert take.trained_ids == ["a"] and take.dropped == {"b": "scorer_error"}
    assert take.num_dropped("scorer_error") == 1 and take.groups[0][0].reward == pytest.approx(0.3)
    # Its group trained: nothing is made again for b (its group counted in the step).
    assert take.unused == [] and take.errors == {"b": ("scorer similarity", "TimeoutError: reward took over 30s")}


def test_groups_whose_rollouts_were_all_dropped_are_consumed_and_counted_with_the_next_step() -> None:
    joiner = Joiner(SCORERS, max_off_policy_steps=1)
    for i in range(2):
        scored(joiner, make_rollout(f"bad-{i}", "bad", status="error"))
        scored(joiner, make_rollout(f"ok-{i}", "ok"))
    take = joiner.take(1)
    assert take is not None and take.trained_ids == ["ok-0", "ok-1"]
    assert take.dropped == {"bad-0": "rollout_error", "bad-1": "rollout_error"}
    assert sorted(take.unused) == ["bad-0", "bad-1"]  # a group that trained nothing: the run makes another
    assert joiner.num_buffered == 0


def test_errors_group_by_source_and_text_up_to_numbers_and_ids() -> None:
    def step(*errors: tuple[str, str, str]) -> dict[str, tuple[str, str]]:
        return {rollout: (source, text) for rollout, source, text in errors}

    groups = add_errors([], step(("r1", "scorer s", "reward 's' failed: KeyError: 17"),
                                 ("r2", "scorer s", "reward 's' failed: KeyError: 18"),
                                 ("r3", "rollout", "worker 0a1b2c3d4e died")))
    groups = add_errors(groups, step(("r4", "rollout", "worker 99ffee0011 died"),
                                     ("r5", "rollout", "worker 12345678ab died"),
                                     ("r6", "teacher t", "sequence longer than 2048 positions")))
    assert [(g.source, g.error, g.count, g.example) for g in groups] == [
        ("rollout", "worker 0a1b2c3d4e died", 3, "r3"),  # most frequent first, the first one's text and rollout
        ("scorer s", "reward 's' failed: KeyError: 17", 2, "r1"),
        ("teacher t", "sequence longer than 2048 positions", 1, "r6")]
    many = add_errors([], step(*((f"x{i}", "scorer s", f"failed on {chr(97 + i)}") for i in range(20))))
    assert len(many) == events.MAX_ERROR_GROUPS + 1 and sum(g.count for g in many) == 20
    assert many[0].count == 20 - events.MAX_ERROR_GROUPS and many[0].error.startswith("other errors")


def test_stale_rollouts_are_dropped_on_arrival_and_when_the_version_moves_on() -> None:
    joiner = Joiner(SCORERS, max_off_policy_steps=1, version=2)
    scored(joiner, make_rollout("old", "g1", policy_version=0, group_size=1))  # 2 behind: stale at once
    scored(joiner, make_rollout("fresh", "g2", policy_version=1, group_size=1))  # 1 behind: fine
    scored(joiner, make_rollout("newer", "g3", policy_version=2, group_size=1))
    joiner.set_version(3)  # now "fresh" is 2 behind
    take = joiner.take(1)
    assert take is not None
    assert take.trained_ids == ["newer"] and take.groups[0][0].staleness == 1
    assert take.dropped == {"old": "stale", "fresh": "stale"} and take.num_dropped("stale") == 2


def test_redelivered_rollouts_and_late_scores_of_consumed_rollouts_are_ignored() -> None:
    joiner = Joiner(SCORERS, max_off_policy_steps=1, consumed={"done"})
    done = make_rollout("done", "g0", group_size=1)
    assert not joiner.add_rollout(done)
    assert not joiner.add_score(make_score(done, "similarity", 1.0))
    a = make_rollout("a", "g", group_size=1)
    assert joiner.add_rollout(a) and not joiner.add_rollout(a)
    assert joiner.num_buffered == 1 and joiner.num_orphan_scores == 0


def test_buffered_events_are_what_is_held() -> None:
    joiner = Joiner(SCORERS, max_off_policy_steps=1)
    a = make_rollout("a", "g")
    joiner.add_rollout(a)
    joiner.add_score(make_score(a, "exact", 1.0))
    joiner.add_score(make_score(make_rollout("x", "h"), "exact", 1.0))  # its rollout is not here yet
    assert [e.id for e in joiner.buffered_events()] == ["a", "a.exact", "x.exact"]
    assert joiner.num_orphan_scores == 1


def test_rollouts_that_can_never_be_trained_are_refused_with_the_reason() -> None:
    joiner = Joiner(SCORERS, max_off_policy_steps=1)
    r = make_rollout("a", "g", completion=[5, 6], logprobs=[-1.0])
    with pytest.raises(BadRollout, match="2 token ids but 1 logprobs"):
        joiner.check(r)
    joiner.add_rollout(make_rollout("b", "g", group_size=1))
    with pytest.raises(BadRollout, match="group g already has its 1 rollouts"):
        joiner.add_rollout(make_rollout("c", "g", group_size=1))
    with pytest.raises(BadRollout, match="group_size=2, but group g has group_size=1"):
        joiner.add_rollout(make_rollout("d", "g", group_size=2))
    first_token_trained = make_rollout("e", "h", prompt=[])
    with pytest.raises(BadRollout, match="first token"):
        joiner.check(first_token_trained)
    with pytest.raises(ValueError, match="scorers"):
        Joiner({}, max_off_policy_steps=1)


def test_tokens_are_the_spans_in_node_order() -> None:
    tokens = tokens_of(make_rollout("a", "g", prompt=[1, 2, 3], completion=[7, 8], logprobs=[-0.5, -0.25]))
    assert tokens.token_ids == [1, 2, 3, 7, 8]
    assert tokens.logprobs == [0.0, 0.0, 0.0, -0.5, -0.25]
    assert tokens.loss_mask == [False, False, False, True, True]


def branching_rollout() -> events.Rollout:
    """A question, an answer, a tool's result, a second answer; and a retry of the first answer."""
    from flywheel.sdk.tracegraph import TraceGraph

    def span(ids: list[int], sampled: bool) -> events.TokenSpan:
        return events.TokenSpan(token_ids=ids, logprobs=[-0.5 if sampled else 0.0] * len(ids),
                                loss_mask=[sampled] * len(ids), policy_version=0 if sampled else None)

    g = TraceGraph()
    user, _ = g.add(None, events.Message(role="user", content="q"), span([1, 2], False))
    first, _ = g.add(user.id, events.Message(role="assistant", content="a"), span([3, 4], True))
    tool, _ = g.add(first.id, events.Message(role="tool", content="t"), span([5], False))
    g.add(tool.id, events.Message(role="assistant", content="b"), span([6], True))
    g.add(user.id, events.Message(role="assistant", content="retry"), span([7], True))  # a retry: a sibling
    return events.Rollout(run="r", env="e", task_id="t", group_id="t", nodes=g.ordered())


def test_a_branching_rollout_trains_each_branch_and_each_sampled_token_once() -> None:
    seqs = sequences_of(branching_rollout())
    assert [s.token_ids for s in seqs] == [[1, 2, 3, 4, 5, 6], [1, 2, 7]]
    assert [s.loss_mask for s in seqs] == [[False, False, True, True, False, True], [False, False, True]]
    # Echo's tokens: the tool's answer after the first sampled one; the prompt is not the environment's answer.
    assert [s.env_mask for s in seqs] == [[False, False, False, False, True, False], [False, False, False]]


def test_echo_takes_the_environments_turns_after_the_first_answer_each_once() -> None:
    from flywheel.sdk.tracegraph import TraceGraph

    def span(ids: list[int], sampled: bool) -> events.TokenSpan:
        return events.TokenSpan(token_ids=ids, logprobs=[-0.5 if sampled else 0.0] * len(ids),
                                loss_mask=[sampled] * len(ids), policy_version=0 if sampled else None)

    g = TraceGraph()
    system, _ = g.add(None, events.Message(role="system", content="s"), span([1], False))
    user, _ = g.add(system.id, events.Message(role="user", content="q"), span([2, 3], False))
    first, _ = g.add(user.id, events.Message(role="assistant", content="a"), span([4], True))
    tool, _ = g.add(first.id, events.Message(role="tool", content="t"), span([5, 6], False))
    second, _ = g.add(tool.id, events.Message(role="assistant", content="b"), span([7], True))
    g.add(second.id, events.Message(role="user", content="u"), span([8, 9], False))
    g.add(g.nodes[g.last.id].id, events.Message(role="assistant", content="c"), span([10], True))  # type: ignore[union-attr]
    g.add(tool.id, events.Message(role="assistant", content="b2"), span([11], True))  # a second answer to the tool
    seqs = sequences_of(events.Rollout(run="r", env="e", task_id="t", group_id="t", nodes=g.ordered()))
    assert [s.token_ids for s in seqs] == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 11]]
    # The tool's result and the user's next turn; in the second branch the tool's result was
    # learned in the first already, and what the model sampled never is.
    assert [s.env_mask for s in seqs] == [[False] * 4 + [True, True, False, True, True, False], [False] * 7]
    assert not any(e and m for s in seqs for e, m in zip(s.env_mask, s.loss_mask, strict=True))


def test_a_stale_rollout_counts_as_stale_even_when_inference_stopped_it_as_an_error() -> None:
    # Inference stops a rollout that went stale and publishes it as an error saying so: it is
    # a stale drop, not a rollout error.
    joiner = Joiner(SCORERS, max_off_policy_steps=0)
    joiner.set_version(2)
    scored(joiner, make_rollout("a", "g", policy_version=1, status="error"))
    scored(joiner, make_rollout("b", "g", policy_version=2, status="error"))
    for i in range(2):
        scored(joiner, make_rollout(f"ok-{i}", "g2", policy_version=2))
    take = joiner.take(1)
    assert take is not None and take.dropped == {"a": "stale", "b": "rollout_error"}


def test_a_rollout_waits_only_for_its_own_environments_scorers() -> None:
    joiner = Joiner({"x": 1.0, "y": 2.0}, max_off_policy_steps=1, env_scorers={"a": {"x": 1.0}, "b": {"y": 2.0}})
    a1, a2 = make_rollout("a1", "ga", env="a", index=0), make_rollout("a2", "ga", env="a", index=1)
    b1, b2 = make_rollout("b1", "gb", env="b", index=0), make_rollout("b2", "gb", env="b", index=1)
    for rollout in (a1, a2, b1, b2):
        joiner.add_rollout(rollout)
    for rollout, value in ((a1, 0.5), (a2, 1.0)):
        joiner.add_score(make_score(rollout, "x", value))
    joiner.add_score(make_score(b1, "y", 0.25))
    assert joiner.is_ready("a1") and not joiner.is_ready("b2")
    assert joiner.awaited_scores() == {"y": 1}  # b2's y; a's rollouts never wait for y
    take = joiner.take(1)
    assert take is not None and [(s.rollout.id, s.reward, s.scores) for s in take.groups[0]] == [
        ("a1", 0.5, {"x": 0.5}), ("a2", 1.0, {"x": 1.0})]
    joiner.add_score(make_score(b2, "y", 1.0))
    take = joiner.take(1)
    assert take is not None and [s.reward for s in take.groups[0]] == [0.5, 2.0]
    with pytest.raises(ValueError, match=r"env_scorers\['a'\]: at least one scorer"):
        Joiner({"x": 1.0}, max_off_policy_steps=1, env_scorers={"a": {}})


def make_signal(rollout: events.Rollout, source: str = "t", value: float = -0.5,
                error: str | None = None) -> events.Signal:
    """A teacher's signal on ``rollout``: ``value`` on each sampled token of each node that has one."""
    values = {n.id: [value if m else 0.0 for m in n.tokens.loss_mask] for n in rollout.nodes
              if n.tokens is not None and any(n.tokens.loss_mask)} if error is None else {}
    return events.Signal(id=f"{rollout.id}.{source}", run=rollout.run, env=rollout.env, rollout_id=rollout.id,
                         group_id=rollout.group_id, source=source, values=values, error=error)


def test_a_rollout_whose_environment_reads_a_teacher_waits_for_its_signal() -> None:
    joiner = Joiner({"exact": 1.0}, max_off_policy_steps=1, signals=["t"])
    a, b = make_rollout("a", "g"), make_rollout("b", "g", index=1)
    for r in (a, b):
        joiner.add_rollout(r)
        joiner.add_score(make_score(r, "exact", 1.0))
    assert joiner.take(1) is None
    assert joiner.awaited_signals() == {"t": 2} and joiner.awaited_scores() == {}
    assert not joiner.add_signal(make_signal(a, source="other"))  # a source no rollout reads
    assert joiner.add_signal(make_signal(a)) and joiner.add_signal(make_signal(b))
    take = joiner.take(1)
    assert take is not None and [s.signals["t"].id for s in take.groups[0]] == ["a.t", "b.t"]
    assert not joiner.add_signal(make_signal(a))  # consumed: a late copy is ignored


def test_a_teachers_error_or_a_signal_that_does_not_fit_drops_the_rollout() -> None:
    joiner = Joiner({"exact": 1.0}, max_off_policy_steps=1, signals=["t"])
    a, b, c = (make_rollout(x, "g", index=i, group_size=3) for i, x in enumerate("abc"))
    joiner.add_signal(make_signal(a, error="too long for the teacher's context"))  # before its rollout
    misfit = msgspec.structs.replace(make_signal(b), values={b.nodes[-1].id: [0.0]})  # 1 value for 2 tokens
    joiner.add_signal(misfit)
    joiner.add_signal(make_signal(c))
    for r in (a, b, c):
        joiner.add_rollout(r)
        joiner.add_score(make_score(r, "exact", 1.0))
    take = joiner.take(1)
    assert take is not None and take.dropped == {"a": "signal_error", "b": "signal_error"}
    assert [s.rollout.id for s in take.groups[0]] == ["c"]


def test_a_signals_top_k_that_does_not_fit_its_rollout_drops_it() -> None:
    from flywheel_trainer.join import signal_top

    joiner = Joiner({"exact": 1.0}, max_off_policy_steps=1, signals=["t"])
    a, b, c = (make_rollout(x, "g", index=i, group_size=3) for i, x in enumerate("abc"))
    last = a.nodes[-1].id
    fits = msgspec.structs.replace(make_signal(a), top_ids={last: [[1, 2], [3, 4]]},
                                   top_logprobs={last: [[-0.1, -2.0], [-0.5, -1.0]]})
    assert [t.ids[-2:] for t in signal_top(a, fits)] == [[[1, 2], [3, 4]]]
    assert signal_top(a, fits)[0].ids[:4] == [[]] * 4  # the prompt's tokens: none
    short = msgspec.structs.replace(make_signal(b), top_ids={b.nodes[-1].id: [[1]]},
                                    top_logprobs={b.nodes[-1].id: [[-0.1]]})  # 1 token's of 2
    uneven = msgspec.structs.replace(make_signal(c), top_ids={c.nodes[-1].id: [[1, 2], [3]]},
                                     top_logprobs={c.nodes[-1].id: [[-0.1, -2.0], [-0.5, -1.0]]})
    for r, signal in ((a, fits), (b, short), (c, uneven)):
        joiner.add_signal(signal)
        joiner.add_rollout(r)
        joiner.add_score(make_score(r, "exact", 1.0))
    take = joiner.take(1)
    assert take is not None and take.dropped == {"b": "signal_error", "c": "signal_error"}
    assert [s.rollout.id for s in take.groups[0]] == ["a"]


def test_each_environment_waits_for_its_own_teachers_and_signals_are_journaled() -> None:
    joiner = Joiner({"exact": 1.0}, max_off_policy_steps=1, env_scorers={"x": {"exact": 1.0}, "y": {"exact": 1.0}},
                    env_signals={"x": ["t"], "y": []})
    x, y = make_rollout("x1", "gx", env="x", group_size=1), make_rollout("y1", "gy", env="y", group_size=1)
    for r in (x, y):
        joiner.add_rollout(r)
        joiner.add_score(make_score(r, "exact", 0.5))
    take = joiner.take(1)
    assert take is not None and take.groups[0][0].rollout.id == "y1"  # y reads no teacher
    joiner.add_signal(make_signal(x))
    assert [type(e).__name__ for e in joiner.buffered_events()] == ["Rollout", "Score", "Signal"]
    assert joiner.take(1) is not None


def test_signal_values_follow_the_sequences_of_a_branching_rollout() -> None:
    from flywheel_trainer.join import signal_values

    rollout = branching_rollout()
    signal = make_signal(rollout, value=-0.25)
    seqs = sequences_of(rollout)
    laid = signal_values(rollout, signal)
    assert [len(v) for v in laid] == [len(s.token_ids) for s in seqs]
    for seq, values in zip(seqs, laid, strict=True):
        # Every token trained in a sequence has the teacher's value; what is context there has
        # its node's values too (its own branch trains it), and prompts 0.
        assert all(v == -0.25 for v, m in zip(values, seq.loss_mask, strict=True) if m)
