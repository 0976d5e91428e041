"""The one scoring core (:mod:`flywheel.sdk.scoring`): rewards on a group by the error rules,
and what a rollout's reward is. The scorer service's use of it is tested in
tests/unit/test_scorer_rewards.py, eval's in tests/unit/test_eval.py, the store's SQL
against :func:`rollout_reward` in tests/unit/test_store.py."""

from __future__ import annotations

import asyncio

import pytest

from flywheel.contract import events
from flywheel.contract.config import RunConfig
from flywheel.sdk.environment import Environment, GroupReward, Metric, Reward, load_environment
from flywheel.sdk.scoring import Scoring, describe_reward, required_scorers, rollout_reward
from tests.scripted_openai import make_rollout


def score(scorer: str, value: float, weight: float = 1.0, error: str | None = None) -> events.Score:
    return events.Score(run="r", env="e", rollout_id="ro", group_id="g", scorer=scorer, value=value, weight=weight,
                        error=error)


def test_a_rollouts_reward_is_its_required_scorers_weighted() -> None:
    required = {"exact": 0.5, "length": 0.0}
    full = [score("exact", 1.0, weight=9.0), score("length", 7.0), score("custom", 3.0)]
    assert rollout_reward("completed", full, required) == 0.5  # weights are the run's; custom counts for nothing
    assert rollout_reward("truncated", full, required) == 0.5
    assert rollout_reward("error", full, required) is None  # an errored rollout has no reward
    assert rollout_reward("completed", full[:1], required) is None  # "length" has not scored it yet
    assert rollout_reward("completed", [*full[1:], score("exact", 0.0, error="boom")], required) is None
    assert rollout_reward("completed", [*full, score("judge", 0.0, error="boom")], required) == 0.5  # not required
    # A run whose scorers are not known: every score, at its own weight; None before the first or after a failure.
    assert rollout_reward("completed", full, None) == 9.0 + 7.0 + 3.0
    assert rollout_reward("completed", [], {}) is None
    assert rollout_reward("completed", [*full, score("judge", 0.0, error="boom")], None) is None


def test_the_required_scorers_are_the_environments_with_the_runs_scorers_added() -> None:
    env = load_environment("reverse_text")
    cfg = RunConfig(run="r", env="reverse_text")
    assert required_scorers(cfg, env) == {"similarity": 1.0, "exact": 0.0} == required_scorers(None, env)
    # A custom scorer named in the config joins the environment's reward; it does not push it out
    # (it did: every step then trained on the custom scorer alone, reward std 0).
    added = RunConfig(run="r", env="reverse_text", scorers={"nospace": 0.5})
    assert required_scorers(added, env) == {"similarity": 1.0, "exact": 0.0, "nospace": 0.5}
    reweighted = RunConfig(run="r", env="reverse_text", scorers={"exact": 2.0})
    assert required_scorers(reweighted, env) == {"similarity": 1.0, "exact": 2.0}
    # Unless the config says the scorers replace them.
    only = RunConfig(run="r", env="reverse_text", scorers={"nospace": 1.0}, replace_rewards=True)
    assert required_scorers(only, env) == {"nospace": 1.0}
    with pytest.raises(ValueError, match="replace_rewards = true needs scorers"):
        RunConfig(run="r", env="reverse_text", replace_rewards=True)


def test_the_runs_reward_is_described_as_it_is_computed() -> None:
    env = load_environment("reverse_text")
    cfg = RunConfig(run="r", env="reverse_text", scorers={"nospace": 0.5})
    assert describe_reward(required_scorers(cfg, env), env) == (
        "reward = 1 x similarity + 0.5 x nospace; metrics (weight 0): exact; not reverse_text's own, so a custom "
        "scorer must score them: nospace (flywheel scorer MODULE:FUNCTION --env ENV, named by --name or the "
        "function's name)")
    assert describe_reward(required_scorers(None, env), env) == "reward = 1 x similarity; metrics (weight 0): exact"


def length(completion: str) -> float:
    return len(completion)


async def slow(completion: str) -> float:
    await asyncio.Event().wait()
    return 1.0


async def test_a_group_is_scored_by_the_error_rules_each_reward_on_its_own() -> None:
    env = Environment(name="rules", tasks=[{"prompt": "x"}], rewards=[
        Reward(length, name="length"), Reward(lambda: 1 / 0, name="raises"),
        Reward(lambda: "high", name="words"), Reward(slow), Metric(lambda: {"a": 1.0, "b": 2.0}, name="parts"),
        GroupReward(lambda completions: [1.0], name="short_list"),
        GroupReward(lambda completions: [float(c == "cba") for c in completions], name="right", weight=0.5)])
    rollouts = [make_rollout("rules", {"prompt": "x"}, [{"role": "user", "content": "x"},
                                                        {"role": "assistant", "content": answer}], index=i)
                for i, answer in enumerate(["cba", "ab"])]
    scored = await Scoring(timeout_s=0.2).score_group(
        env.rewards, rollouts, {"length": 2.0})  # type: ignore[arg-type]  # Environment made each a Reward
    first = {s.scorer: s for s in scored[0]}
    assert [s.scorer for s in scored[1]] == list(first)  # one score per reward, in the rewards' order
    assert (first["length"].value, first["length"].weight) == (3.0, 2.0) and first["right"].weight == 0.5
    assert first["parts"].value == 3.0 and first["parts"].components == {"a": 1.0, "b": 2.0}
    assert [s.value for s in (first["right"], {s.scorer: s for s in scored[1]}["right"])] == [1.0, 0.0]
    assert {name: s.error for name, s in first.items() if s.error} == {
        "raises": "reward 'raises' failed: ZeroDivisionError: division by zero",
        "words": "reward 'words' failed: RewardError: reward 'words' returned 'high'; a reward returns a finite "
                 "float or a dict of them",
        "slow": "reward 'slow' timed out after 0.2s",
        "short_list": "group reward 'short_list' failed: RewardError: group reward 'short_list' returned [1.0]; it "
                      "returns a list with one value per rollout (2)",
    }
    assert all(s.value == 0.0 for s in first.values() if s.error)  # never a silent value, a recorded error
    assert {s.id for s in scored[1]} == {f"{rollouts[1].id}.{name}" for name in first}
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        Scoring(timeout_s=0)


async def test_a_run_with_several_environments_has_a_reward_for_each() -> None:
    from flywheel.runtime.runs import load_for_run, load_run_environments
    from flywheel.sdk.scoring import reward_definition
    from tests.inprocess import InProcessPool

    pool = InProcessPool()
    cfg = RunConfig.parse({"run": "r", "scorers": {"brevity": 0.5}, "envs": [
        {"id": "reverse_text", "rewards": {"exact": {"weight": 2}}}, {"id": "arithmetic"}]})
    environments = await load_run_environments(pool, cfg)
    assert list(environments) == ["reverse_text", "arithmetic"]
    assert environments["reverse_text"].env.weights["exact"] == 2.0  # its own overrides
    scorers, by_env = reward_definition(cfg, environments)
    assert by_env == {"reverse_text": {"similarity": 1.0, "exact": 2.0, "brevity": 0.5},
                      "arithmetic": {"correct": 1.0, "shortest_correct": 0.1, "formatted": 0.0, "chars": 0.0,
                                     "closeness": 0.0, "brevity": 0.5}}
    assert scorers == by_env["reverse_text"] | by_env["arithmetic"]
    assert (await load_for_run(pool, cfg, "arithmetic")).name == "arithmetic"
    with pytest.raises(ValueError, match=r"has no environment named 'wordle'; its environments are "
                                         r"reverse_text \+ arithmetic"):
        await load_for_run(pool, cfg, "wordle")
    with pytest.raises(ValueError, match=r"has 2 environments \(reverse_text \+ arithmetic\); name one"):
        await load_for_run(pool, cfg)
    one = RunConfig.parse({"run": "r", "env": "reverse_text"})
    assert reward_definition(one, await load_run_environments(pool, one)) == ({"similarity": 1.0, "exact": 0.0}, {})
    assert (await load_for_run(pool, one, "published-by-hand")).name == "reverse_text"  # a run with one: its own
    await pool.close()
