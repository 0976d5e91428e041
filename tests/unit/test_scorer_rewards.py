"""The scorer without a bus: rewards into Scores, weights, failures, threads, custom scorers.

Hand-written fakes stand in for the bus: weights come from a dict, published Scores land
in a list. What crosses the bus (consumers, dead letters, the run-state bucket, the
``python -m flywheel_scorer`` process) is in tests/integration/test_scorer_bus.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from flywheel import events
from flywheel.bus import Reject
from flywheel.config import RunConfig
from flywheel.environment import Reward, make_reward
from flywheel_scorer.__main__ import main
from flywheel_scorer.scorer import EnvironmentRewards, Scorer, configured_weights, custom_reward, load_function


def rollout(rid: str = "ro1", text: str = "abc", answer: str = "cba", run: str = "r1",
            env: str = "reverse_text") -> events.Rollout:
    system = events.Node(id="n0", message=events.Message(role="system", content="Reverse the text."))
    user = events.Node(id="n1", parent_id="n0", message=events.Message(role="user", content=text))
    reply = events.Node(id="n2", parent_id="n1", message=events.Message(role="assistant", content=answer))
    return events.Rollout(id=rid, run=run, env=env, task_id="t1", group_id="g1", task_data={"text": text},
                          nodes=[system, user, reply])


class Rewards:
    """A reward source of the given functions, all with default weight 1.0."""

    durable = "test"
    filter_subject = None

    def __init__(self, **fns: Callable[..., Any]) -> None:
        self.rewards = {name: make_reward(name, fn, 1.0) for name, fn in fns.items()}

    def __call__(self, rollout: events.Rollout) -> dict[str, Reward]:
        return self.rewards


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as p:
        yield p


def scorer(pool: ThreadPoolExecutor, rewards: Any = None, configured: dict[str, dict[str, float]] | None = None,
           **kwargs: Any) -> Scorer:
    async def weights(run: str) -> dict[str, float]:
        return (configured or {}).get(run, {})

    async def publish(scores: Any) -> None:
        raise AssertionError("score() does not publish")

    return Scorer(rewards or EnvironmentRewards(), weights, publish, pool, **kwargs)


# --- the built-in scorer ------------------------------------------------------------------


async def test_reverse_text_rollouts_get_one_score_per_reward(pool: ThreadPoolExecutor) -> None:
    s = scorer(pool)
    right, partial = await s.score(rollout("ro1", answer="cba")), await s.score(rollout("ro2", answer="cbx"))
    assert [(sc.id, sc.scorer, sc.value, sc.weight) for sc in right] == [
        ("ro1.similarity", "similarity", 1.0, 1.0), ("ro1.exact", "exact", 1.0, 0.0)]
    assert [sc.value for sc in partial] == [pytest.approx(2 / 3), 0.0]
    for sc in right:
        assert (sc.run, sc.env, sc.rollout_id, sc.group_id, sc.error) == ("r1", "reverse_text", "ro1", "g1", None)
        assert sc.subject() == f"scores.r1.reverse_text.{sc.scorer}"


async def test_ids_are_deterministic(pool: ThreadPoolExecutor) -> None:
    s = scorer(pool)
    first, again = await s.score(rollout("ro1")), await s.score(rollout("ro1", answer="other"))
    assert [sc.id for sc in first] == [sc.id for sc in again] == ["ro1.similarity", "ro1.exact"]
    assert {sc.id for sc in await s.score(rollout("ro2"))} == {"ro2.similarity", "ro2.exact"}


async def test_weights_come_from_the_run_config_else_the_rewards_defaults(pool: ThreadPoolExecutor) -> None:
    config = RunConfig(run="r1", env="reverse_text", scorers={"exact": 2.0, "not_a_reward": 3.0}).model_dump()
    configured = {"r1": configured_weights(events.RunState(id="r1", config=config))}
    s = scorer(pool, configured=configured)
    assert [(sc.scorer, sc.weight) for sc in await s.score(rollout(run="r1"))] == [("similarity", 1.0), ("exact", 2.0)]
    assert [(sc.scorer, sc.weight) for sc in await s.score(rollout(run="r2"))] == [("similarity", 1.0), ("exact", 0.0)]
    assert configured_weights(events.RunState(id="r3")) == {}  # a run created without a config
    with pytest.raises(Reject, match=r"run 'r4': config.scorers must map scorer names to weights \(Expected `float`"):
        configured_weights(events.RunState(id="r4", config={"scorers": {"exact": "high"}}))


async def test_an_unknown_environment_is_rejected_with_the_reason(pool: ThreadPoolExecutor) -> None:
    with pytest.raises(Reject, match="environment 'no_such_env': no module 'no_such_env'"):
        await scorer(pool).score(rollout(env="no_such_env"))


# --- failures -----------------------------------------------------------------------------


def divides(completion: str) -> float:
    return 1 / 0


async def async_raises(task: dict) -> float:
    raise RuntimeError(f"judge unreachable for {task['text']}")


async def test_failing_rewards_become_score_errors_and_spare_the_others(pool: ThreadPoolExecutor) -> None:
    rewards = Rewards(good=lambda completion: len(completion), divides=divides, async_raises=async_raises,
                      text=lambda: "0.5", nan=lambda: float("nan"), nothing=lambda: None, boolean=lambda: True)
    scores = {sc.scorer: sc for sc in await scorer(pool, rewards).score(rollout(answer="cba"))}
    assert scores.pop("good").value == 3.0 and all(sc.value == 0.0 for sc in scores.values())
    not_a_number = "failed: TypeError: reward '{0}' returned {1}; a reward returns a finite float"
    assert {name: sc.error for name, sc in scores.items()} == {
        "divides": "reward 'divides' failed: ZeroDivisionError: division by zero",
        "async_raises": "reward 'async_raises' failed: RuntimeError: judge unreachable for abc",
        **{name: f"reward '{name}' " + not_a_number.format(name, shown)
           for name, shown in (("text", "'0.5'"), ("nan", "nan"), ("nothing", "None"), ("boolean", "True"))},
    }


async def test_sync_rewards_run_in_threads_and_a_slow_one_times_out(pool: ThreadPoolExecutor) -> None:
    threads: dict[str, str] = {}

    def sync_reward() -> float:
        threads["sync"] = threading.current_thread().name
        return 1.0

    async def async_reward() -> float:
        threads["async"] = threading.current_thread().name
        return 1.0

    def slow() -> float:
        time.sleep(0.5)  # noqa: sleep - a slow reward, longer than its timeout
        return 1.0

    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)  # noqa: sleep - counts event-loop turns while a reward blocks its thread
            ticks += 1

    s = scorer(pool, Rewards(sync_reward=sync_reward, async_reward=async_reward, slow=slow), reward_timeout_s=0.2)
    ticking = asyncio.ensure_future(ticker())
    started = time.monotonic()
    scores = {sc.scorer: sc for sc in await s.score(rollout())}
    ticking.cancel()
    assert time.monotonic() - started < 0.45  # the slow reward's thread is not waited for
    assert ticks >= 5  # the loop ran while the slow reward slept
    assert threads["sync"] != threading.main_thread().name and threads["async"] == threading.main_thread().name
    assert scores["slow"].error == "reward 'slow' timed out after 0.2s" and scores["slow"].value == 0.0
    assert scores["sync_reward"].error is None and scores["async_reward"].error is None


# --- custom scorers -----------------------------------------------------------------------


def answer_length(completion: str) -> float:
    return float(len(completion))


def takes_other_things(completion: str, model: str) -> float:
    return 0.0


async def test_a_custom_scorer_scores_its_one_function(pool: ThreadPoolExecutor) -> None:
    custom = custom_reward(f"{__name__}:answer_length", "reverse_text")
    assert (custom.durable, custom.filter_subject) == ("scorer-answer_length", "rollouts.*.reverse_text")
    (score,) = await scorer(pool, custom).score(rollout(answer="abcd"))
    assert (score.id, score.scorer, score.value, score.weight) == ("ro1.answer_length", "answer_length", 4.0, 1.0)
    named = custom_reward(f"{__name__}:answer_length", "reverse-text", name="brevity", weight=0.5)
    (score,) = await scorer(pool, named, configured={"r2": {"brevity": 3.0}}).score(rollout(answer="ab"))
    assert (named.durable, named.filter_subject) == ("scorer-brevity", "rollouts.*.reverse-text")
    assert (score.id, score.scorer, score.weight) == ("ro1.brevity", "brevity", 0.5)
    (score,) = await scorer(pool, named, configured={"r1": {"brevity": 3.0}}).score(rollout(answer="ab"))
    assert score.weight == 3.0


@pytest.mark.parametrize(("args", "message"), [
    (("nocolon", "reverse_text"), "--function 'nocolon': write MODULE:FUNCTION"),
    (("no_such_module:f", "reverse_text"), "--function 'no_such_module:f': cannot import 'no_such_module'"),
    ((f"{__name__}:missing", "reverse_text"), f"module '{__name__}' .* has no function 'missing'"),
    ((f"{__name__}:answer_length", "reverse_text", "a.b"), "--name 'a.b': use 1 to 128 letters"),
    ((f"{__name__}:answer_length", "reverse_text", "similarity"),
     "--name 'similarity': environment 'reverse_text' has a reward of that name already"),
    ((f"{__name__}:answer_length", "rev*"), "--env 'rev\\*': use the environment's name"),
    ((f"{__name__}:answer_length", "no_such_env"), "--env 'no_such_env': environment 'no_such_env': no module"),
    ((f"{__name__}:answer_length", "reverse_text", None, -1.0), "--weight -1.0: a weight is a finite number"),
    ((f"{__name__}:takes_other_things", "reverse_text"), r"reward 'takes_other_things' .* takes \['model'\]"),
])
def test_custom_scorer_mistakes_name_the_option(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        custom_reward(*args)


def test_load_function() -> None:
    assert load_function(f"{__name__}:answer_length") is answer_length


def test_entry_point_refuses_bad_combinations(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in ((["--name", "x", "--weight", "2"], "--name, --weight: only for a custom scorer"),
                          (["--function", f"{__name__}:answer_length"], "--function needs --env ENV"),
                          (["--threads", "0"], "argument --threads: must be at least 1, got 0"),
                          (["--function", "x", "--env", "reverse_text"], "--function 'x': write MODULE:FUNCTION")):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2 and message in capsys.readouterr().err


def test_entry_point_imports_nothing_heavy_before_parsing() -> None:
    code = "import sys, flywheel_scorer.__main__; print(sorted({'nats', 'flywheel.bus'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
