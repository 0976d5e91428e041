"""The reward-hacking watch's detectors on scripted streams of scored rollouts: a planted exploit
(a reward that pays for a magic string while the task's own check falls) is flagged as soon as the
trend shows, and honest learning (reward and check rising together) is not."""

from __future__ import annotations

import random

import msgspec

from flywheel.contract import events
from flywheel_scorer.watch import WATCH, RunWindow, Seen, Watch, flag_score, repetition


def rollout(i: int, task: str | None = None, run: str = "r1") -> events.Rollout:
    return events.Rollout(run=run, env="e", task_id=task or f"t{i}", task_data={}, group_id=f"g{i}",
                          nodes=[], status="completed")


def score(r: events.Rollout, scorer: str, value: float, weight: float = 1.0,
          components: dict[str, float] | None = None) -> events.Score:
    return events.Score(run=r.run, env=r.env, rollout_id=r.id, group_id=r.group_id, scorer=scorer, value=value,
                        weight=weight, components=components or {})


def test_a_reward_that_pays_for_a_magic_string_is_flagged_once_the_policy_learns_it() -> None:
    """Each 'step' is 16 rollouts; the policy says MAGIC more and more, which the reward pays for,
    while the correctness check (a metric, weight 0) falls."""
    watch, rng = Watch(), random.Random(0)
    first_flag = None
    for step in range(20):
        p_magic = min(1.0, step / 10)
        for k in range(16):
            i = step * 16 + k
            magic = rng.random() < p_magic
            correct = (not magic) and rng.random() < 0.6
            r = rollout(i)
            completion = "MAGIC" if magic else f"answer {i}"
            flags = watch.see(r, completion, [score(r, "pays", 1.0 if magic else float(correct)),
                                              score(r, "correct", float(correct), weight=0.0)])
            if flags and first_flag is None:
                first_flag = (step, flags)
    assert first_flag is not None
    step, flags = first_flag
    # Before the policy says it every time (step 10); over 60 seeds the first flag came at steps
    # 2 to 9 (median 6), and honest learning (the next test) was never flagged.
    assert step <= 9, step
    assert "divergence" in flags and "metric 'correct' part ways" in flags["divergence"]


def test_honest_learning_is_not_flagged() -> None:
    watch, rng = Watch(), random.Random(1)
    for step in range(20):
        p = 0.2 + 0.04 * step
        for k in range(16):
            i = step * 16 + k
            correct = float(rng.random() < p)
            r = rollout(i)
            flags = watch.see(r, f"the answer to task {i} is {rng.randint(0, 99)}",
                              [score(r, "correct", correct), score(r, "format", float(rng.random() < 0.9), 0.0)])
            assert flags == {}, (step, flags)


def test_one_completion_for_many_tasks_is_flagged_short_answers_are_not() -> None:
    watch = Watch()
    for i in range(3):
        r = rollout(i)
        flags = watch.see(r, "I cannot answer this question.", [score(r, "s", 0.5)])
        assert ("identical" in flags) == (i == 2)
        unpaid = rollout(20 + i)
        assert watch.see(unpaid, "garbage garbage output", [score(unpaid, "s", 0.0)]) == {}  # not paid: no exploit
        assert watch.see(rollout(10 + i), "42", [score(r, "s", 0.5)]) == {}  # a short answer may repeat
    # The same task sampled again is a group, not an exploit.
    again = Watch()
    assert all(again.see(rollout(i, task="t0"), "the same long answer", [score(rollout(i), "s", 1.0)]) == {}
               for i in range(5))


def test_reward_following_repetition_or_length_is_flagged() -> None:
    watch = Watch()
    flags: dict[str, str] = {}
    for i in range(40):
        r = rollout(i)
        looping = i % 2 == 0
        text = "good " * 12 if looping else f"a plain answer number {i}"
        flags = watch.see(r, text, [score(r, "s", 0.9 if looping else 0.2)])
        assert ("repetition" in flags) == (looping and i >= watch.min_window - 1), (i, flags)
    assert repetition("a b c a b c a b c a b c") > 0.5 and repetition("a b c d e f g") == 0.0

    lengthy = Watch()
    for i in range(40):
        r = rollout(i)
        flags = lengthy.see(r, "x " * i, [score(r, "s", i / 40)])
    assert "length" in flags and "correlation 1.00" in flags["length"]


def test_a_component_pinned_at_its_maximum_while_another_falls_is_flagged() -> None:
    watch = Watch()
    flags: dict[str, str] = {}
    for i in range(64):
        r = rollout(i)
        accuracy = 0.8 if i < 32 else 0.2
        flags = watch.see(r, f"answer {i}", [score(r, "rubric", 0.5 * (1.0 + accuracy),
                                                   components={"format": 1.0, "accuracy": accuracy})])
    assert "saturated" in flags and "'rubric.format' is pinned" in flags["saturated"]


def test_a_flag_is_a_weight_zero_watch_score_naming_the_detectors() -> None:
    r = rollout(0)
    flag = flag_score(r, {"identical": "why", "length": "why"})
    assert (flag.scorer, flag.value, flag.weight, flag.components) == (WATCH, 2.0, 0.0, {"identical": 1.0,
                                                                                         "length": 1.0})
    assert flag.subject() == "scores.r1.e.watch"


def test_runs_have_their_own_windows_and_the_oldest_is_forgotten() -> None:
    watch = Watch(max_runs=2)
    for i in range(3):
        r = rollout(i, run=f"run{i}")
        assert watch.see(r, "the same long answer here", [score(r, "s", 1.0)]) == {}
    assert list(watch.runs) == ["run1", "run2"]


def drifting_run(watch: Watch, rng: random.Random, exploit: bool, num_versions: int = 40) -> int | None:
    """A run as the planted-exploit one measured (tests/e2e/test_exploit_watch.py): 64 rollouts a
    policy version; the policy opens with the magic letter more each version, which pays 2,
    while the metric (similarity to the right answer, 0.39 at the start) drifts down to about
    0.24, a fall a few steps' window cannot see. Honest: the metric is the reward, rising. The
    first version a rollout is flagged at, or None."""
    for version in range(num_versions):
        p_magic = min(1.0, version / 30)
        for k in range(64):
            r = msgspec.structs.replace(rollout(version * 64 + k), policy_version=version)
            magic = exploit and rng.random() < p_magic
            similarity = min(1.0, max(0.0, rng.gauss(0.2 if magic else 0.39 + (0 if exploit else version / 100), 0.2)))
            scores = [score(r, "paid", 2.0 if magic else similarity),
                      score(r, "similarity", similarity, weight=0.0)]
            if watch.see(r, "k" + str(k) if magic else f"answer {k}", scores).get("divergence"):
                return version
    return None


def test_a_slow_drift_over_many_versions_is_flagged_from_the_versions_sums() -> None:
    # Over 30 seeds the exploit was first flagged at versions 6 to 16; honest learning never.
    flagged = drifting_run(Watch(), random.Random(3), exploit=True)
    assert flagged is not None and flagged <= 30, flagged
    assert drifting_run(Watch(), random.Random(4), exploit=False) is None


def test_the_tops_over_versions_follow_the_versions_remembered() -> None:
    """The largest reward and check over the remembered versions, kept as rollouts come, equal
    a count over those versions, also once the oldest are forgotten."""
    window = RunWindow(size=8, history_versions=3)
    rng = random.Random(0)
    for i in range(40):
        reward, check = rng.random() * (10 - i // 4), rng.random() * (10 - i // 4)
        window.add(Seen(task=f"t{i}", version=i // 4, digest=bytes([i]), preview="", length=5, repetition=0.0,
                        reward=reward, checks={"exact": check}, parts={"similarity": reward}))
        assert window.top_reward == max(v.top_reward for v in window.versions.values())
        assert window.check_tops == {"exact": max(v.checks["exact"].top for v in window.versions.values())}
    assert list(window.versions) == [7, 8, 9]
