"""The scorer without a bus: rewards into Scores, weights, failures, threads, custom scorers.

Hand-written fakes stand in for the bus: weights come from a dict, published Scores land
in a list; environments run in workers in this process (tests/inprocess.py: the worker's own
code, no sandbox). What crosses the bus (consumers, dead letters, the run-state bucket, the
``python -m flywheel_scorer`` process) and real workers are in tests/integration/test_scorer_bus.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from flywheel.contract import events
from flywheel.contract.bus import Delivery, HandBack, Reject
from flywheel.contract.config import RunConfig
from flywheel.contract.settings import ScorerSettings
from flywheel.sdk.environment import Environment, EnvironmentLoadError, GroupReward, Reward, shortest_correct_reward
from flywheel_scorer.__main__ import main
from flywheel_scorer.scorer import (
    CustomReward,
    EnvironmentRewards,
    NotScored,
    RewardSet,
    RunInfo,
    Scorer,
    custom_reward,
    run_config,
)
from tests.helpers import until
from tests.inprocess import InProcessPool, served


def rollout(rid: str = "ro1", text: str = "abc", answer: str = "cba", run: str = "r1",
            env: str = "reverse_text", group: str = "g1", index: int = 0, group_size: int = 1) -> events.Rollout:
    system = events.Node(id="n0", message=events.Message(role="system", content="Reverse the text."))
    user = events.Node(id="n1", parent_id="n0", message=events.Message(role="user", content=text))
    reply = events.Node(id="n2", parent_id="n1", message=events.Message(role="assistant", content=answer))
    return events.Rollout(id=rid, run=run, env=env, task_id="t1", group_id=group, task_data={"text": text},
                          nodes=[system, user, reply], index=index, group_size=group_size)


class Rewards:
    """A reward source of the given functions (per-rollout rewards of weight 1.0) and group rewards,
    an environment of their own served in a worker of ``pool``."""

    durable = "test"
    filter_subject = None

    def __init__(self, *group: Reward | GroupReward, **fns: Callable[..., Any]) -> None:
        self.env = Environment(name="test_rewards", tasks=[{"text": "abc"}],
                               rewards=[*(Reward(fn, name=name) for name, fn in fns.items()), *group])
        self.pool: InProcessPool | None = None
        self.found: RewardSet | None = None

    async def __call__(self, rollout: events.Rollout, run: RunInfo) -> RewardSet:
        assert self.pool is not None
        if self.found is None:
            self.found = RewardSet.of(await served(self.env, self.pool))
        return self.found


@pytest.fixture
async def pool() -> AsyncIterator[InProcessPool]:
    workers = InProcessPool()
    try:
        yield workers
    finally:
        await workers.close()


class Published(list):
    async def __call__(self, scores: Any) -> None:
        self.extend(scores)


def scorer(pool: InProcessPool, rewards: Any = None, configured: dict[str, RunConfig] | None = None,
           published: Any = None, **kwargs: Any) -> Scorer:
    async def configs(run: str) -> RunInfo:
        return RunInfo((configured or {}).get(run), "default")

    rewards = rewards or EnvironmentRewards()
    rewards.pool = pool  # what their start() would set
    return Scorer(rewards, configs, published if published is not None else Published(), ScorerSettings(**kwargs))


def delivery(r: events.Rollout) -> Delivery:
    return Delivery(event=r, subject=r.subject(), stream_seq=0, num_delivered=1, headers={},
                    msg=None)  # type: ignore[arg-type]  # no NATS message: Scorer.handle never reads it


# --- the built-in scorer ------------------------------------------------------------------


async def test_reverse_text_rollouts_get_one_score_per_reward_and_metric(pool: InProcessPool) -> None:
    s = scorer(pool)
    right, partial = await s.score(rollout("ro1", answer="cba")), await s.score(rollout("ro2", answer="cbx"))
    assert [(sc.id, sc.scorer, sc.value, sc.weight) for sc in right] == [
        ("ro1.similarity", "similarity", 1.0, 1.0), ("ro1.exact", "exact", 1.0, 0.0)]
    assert [sc.value for sc in partial] == [pytest.approx(2 / 3), 0.0]
    for sc in right:
        assert (sc.run, sc.env, sc.rollout_id, sc.group_id, sc.error) == ("r1", "reverse_text", "ro1", "g1", None)
        assert sc.subject() == f"scores.r1.reverse_text.{sc.scorer}"


async def test_ids_are_deterministic(pool: InProcessPool) -> None:
    s = scorer(pool)
    first, again = await s.score(rollout("ro1")), await s.score(rollout("ro1", answer="other"))
    assert [sc.id for sc in first] == [sc.id for sc in again] == ["ro1.similarity", "ro1.exact"]
    assert {sc.id for sc in await s.score(rollout("ro2"))} == {"ro2.similarity", "ro2.exact"}


def longer(completion: str) -> float:
    """A swapped-in reward for the overrides test."""
    return float(len(completion))


def parts(completion: str) -> dict[str, float]:
    return {"length": float(len(completion)), "has_c": float("c" in completion)}


async def test_the_run_config_sets_weights_swaps_functions_and_adds_rewards(pool: InProcessPool) -> None:
    cfg = RunConfig.parse({"run": "r1", "env": "reverse_text", "scorers": {"exact": 2.0},
                           "rewards": {"similarity": {"function": f"{__name__}:longer", "weight": 0.5},
                                       "parts": {"function": f"{__name__}:parts"},
                                       "shortest": {"function": f"{__name__}:shortest", "group": True}}})
    published = Published()
    s = scorer(pool, configured={"r1": cfg}, published=published)
    await s.handle(delivery(rollout(run="r1", answer="cbaa")))
    assert [(sc.scorer, sc.value, sc.weight, sc.components) for sc in published] == [
        ("similarity", 4.0, 0.5, {}), ("exact", 0.0, 2.0, {}), ("parts", 5.0, 1.0, {"length": 4.0, "has_c": 1.0}),
        ("shortest", 1.0, 1.0, {})]
    published.clear()
    await s.handle(delivery(rollout(run="r2", answer="cba")))  # no config: the environment as it is
    assert [(sc.scorer, sc.value, sc.weight) for sc in published] == [("similarity", 1.0, 1.0), ("exact", 1.0, 0.0)]
    assert run_config(events.RunState(id="r3")) is None  # a run created without a config
    with pytest.raises(Reject, match=r"run 'r4': config: run: Field required"):
        run_config(events.RunState(id="r4", config={"scorers": {"exact": 2.0}}))


def shortest(completions: list[str]) -> list[float]:
    return [float(len(c) == min(map(len, completions))) for c in completions]


async def test_rollouts_of_eval_runs_are_not_scored_again(pool: InProcessPool) -> None:
    with pytest.raises(NotScored):  # flywheel eval --record publishes them with their scores
        run_config(events.RunState(id="e1", kind="eval", config={"eval": {"env": "reverse_text"}}))

    async def configs(run: str) -> RunInfo:
        raise NotScored(run)

    published = Published()
    await Scorer(EnvironmentRewards(), configs, published, ScorerSettings()).handle(delivery(rollout()))
    assert published == []


async def test_an_unknown_environment_is_rejected_with_the_reason(pool: InProcessPool) -> None:
    with pytest.raises(Reject, match="environment 'no_such_env': no module 'no_such_env'"):
        await scorer(pool).score(rollout(env="no_such_env"))
    cfg = RunConfig.parse({"run": "r1", "env": "reverse_text", "rewards": {"exact": {"function": "nowhere:f"}}})
    rewards = EnvironmentRewards()
    rewards.pool = pool
    with pytest.raises(Reject, match=r"rewards.exact.function='nowhere:f': cannot import 'nowhere'"):
        await rewards(rollout(), RunInfo(cfg))


# --- failures -----------------------------------------------------------------------------


def length(completion: str) -> float:
    return len(completion)


def divides(completion: str) -> float:
    return 1 / 0


async def async_raises(task: dict) -> float:
    raise RuntimeError(f"judge unreachable for {task['text']}")


async def test_failing_rewards_become_score_errors_and_spare_the_others(pool: InProcessPool) -> None:
    rewards = Rewards(good=length, divides=divides, async_raises=async_raises,
                      text=lambda: "0.5", nan=lambda: float("nan"), nothing=lambda: None, boolean=lambda: True,
                      empty=lambda: {}, bad_part=lambda: {"a": 1.0, "b": "x"})
    scores = {sc.scorer: sc for sc in await scorer(pool, rewards).score(rollout(answer="cba"))}
    assert scores.pop("good").value == 3.0 and all(sc.value == 0.0 for sc in scores.values())
    not_a_number = "failed: RewardError: reward '{0}' returned {1}; a reward returns a finite float or a dict of them"
    assert {name: sc.error for name, sc in scores.items()} == {
        "divides": "reward 'divides' failed: ZeroDivisionError: division by zero",
        "async_raises": "reward 'async_raises' failed: RuntimeError: judge unreachable for abc",
        **{name: f"reward '{name}' " + not_a_number.format(shown_name, shown)
           for name, shown_name, shown in (("text", "text", "'0.5'"), ("nan", "nan", "nan"),
                                           ("nothing", "nothing", "None"), ("boolean", "boolean", "True"),
                                           ("bad_part", "bad_part.b", "'x'"))},
        "empty": "reward 'empty' failed: RewardError: reward 'empty' returned an empty dict; return a float or a dict "
                 "of floats",
    }


async def test_sync_rewards_run_in_threads_and_a_slow_one_times_out(pool: InProcessPool) -> None:
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


async def test_an_inline_reward_runs_on_the_loop_and_one_that_holds_it_is_named_once(
        pool: InProcessPool, caplog: pytest.LogCaptureFixture) -> None:
    threads: list[str] = []

    def quick(completion: str) -> float:
        threads.append(threading.current_thread().name)
        return float(completion == "cba")

    def heavy(completion: str) -> float:
        time.sleep(0.03)  # noqa: sleep - a call that holds the event loop past INLINE_WARN_S
        return 1.0

    s = scorer(pool, Rewards(Reward(quick, inline=True), Reward(heavy, inline=True)))
    for rid in ("a", "b"):
        scores = {sc.scorer: sc for sc in await s.score(rollout(rid, text="cba"))}
        assert (scores["quick"].value, scores["heavy"].value) == (1.0, 1.0), scores
    assert threads == [threading.main_thread().name] * 2  # no thread hop
    held = [r.message for r in caplog.records if "held the event loop" in r.message]
    assert len(held) == 1 and "reward 'heavy' is inline=True" in held[0] and "drop inline=True" in held[0], held

    async def judged(completion: str) -> float:
        return 1.0

    with pytest.raises(EnvironmentLoadError, match="reward 'judged': inline=True is for sync functions"):
        Reward(judged, inline=True)


# --- group rewards ------------------------------------------------------------------------


def group_of(n: int, answers: list[str], group: str = "g1", run: str = "r1") -> list[events.Rollout]:
    return [rollout(f"{group}-{i}", answer=a, group=group, index=i, group_size=n, run=run)
            for i, a in enumerate(answers)]


class Calls(list):
    """Each publish call's scores, a list a call."""

    async def __call__(self, scores: Any) -> None:
        self.append(list(scores))


def batch_delivery(r: events.Rollout, msg: object, index: int, size: int) -> Delivery:
    return Delivery(event=r, subject=r.subject(), stream_seq=7, num_delivered=1,
                    headers={events.BATCH_HEADER: str(size)}, msg=msg, batch_index=index)  # type: ignore[arg-type]


async def test_a_batch_messages_rollouts_publish_their_scores_together_in_its_order(pool: InProcessPool) -> None:
    calls = Calls()
    slow = threading.Event()
    scored: list[str] = []  # completions scored so far (from the pool's threads)

    def similar(completion: str) -> float:
        if completion == "slow":
            slow.wait(5)
        scored.append(completion)
        return float(completion == "cba")

    rewards = Rewards(similar=similar)

    class Source:
        pool: InProcessPool | None = None

        async def __call__(self, r: events.Rollout, run: RunInfo) -> RewardSet:
            if r.env == "no_such_env":
                raise Reject(f"environment {r.env!r}: not here")
            rewards.pool = self.pool
            return await rewards(r, run)

    s = scorer(pool, Source(), published=calls, max_in_flight=2)  # fewer slots than rollouts
    members = group_of(3, ["slow", "cba", "x"])
    msg = object()
    handled = [asyncio.ensure_future(s.handle(batch_delivery(r, msg, i, 3))) for i, r in enumerate(members)]
    # The third gets a slot while the first holds one: the second gave its slot back to wait for the batch.
    await until(lambda: sorted(scored) == ["cba", "x"], what="the second and third rollouts scored")
    assert calls == [] and not any(h.done() for h in handled)  # the first is still being scored: nothing goes
    slow.set()
    await asyncio.gather(*handled)
    assert [[sc.id for sc in call] for call in calls] == [["g1-0.similar", "g1-1.similar", "g1-2.similar"]]

    calls.clear()  # one that can never be scored: the rest go without it, it is dead-lettered
    members[1] = rollout("g1-1", env="no_such_env", index=1, group_size=3)
    msg = object()
    outcomes = await asyncio.gather(*(s.handle(batch_delivery(r, msg, i, 3)) for i, r in enumerate(members)),
                                    return_exceptions=True)
    assert [type(o).__name__ for o in outcomes] == ["NoneType", "Reject", "NoneType"]
    assert [[sc.id for sc in call] for call in calls] == [["g1-0.similar", "g1-2.similar"]]


async def test_a_group_reward_waits_for_the_whole_group_then_scores_each_rollout(pool: InProcessPool) -> None:
    published = Published()
    short = shortest_correct_reward(lambda c, t: c.strip() == t["text"][::-1], weight=0.5)
    s = scorer(pool, Rewards(short, similar=lambda completion: float(completion == "cba")), published=published)
    members = group_of(3, ["cba ", "cba", "xyz"])
    first = [asyncio.ensure_future(s.handle(delivery(r))) for r in members[:2]]
    await until(lambda: s.num_held == 2, what="two members held")
    assert not any(f.done() for f in first)  # held: not acked until the group is complete
    assert sorted(sc.id for sc in published) == ["g1-0.similar", "g1-1.similar"]  # their own rewards at once
    await s.handle(delivery(members[2]))
    await asyncio.gather(*first)
    group_scores = {sc.rollout_id: (sc.value, sc.weight, sc.error) for sc in published
                    if sc.scorer == "shortest_correct"}
    assert group_scores == {"g1-0": (0.0, 0.5, None), "g1-1": (1.0, 0.5, None), "g1-2": (0.0, 0.5, None)}
    assert s.num_held == 0
    await s.handle(delivery(members[1]))  # a redelivery of a scored member: nothing new for the group
    assert sum(sc.scorer == "shortest_correct" for sc in published) == 3


async def test_a_group_reward_of_the_wrong_length_or_that_raises_is_an_error_on_each(pool: InProcessPool) -> None:
    published = Published()
    s = scorer(pool, Rewards(GroupReward(lambda completions: [1.0], name="short_list"),
                             GroupReward(lambda tasks: 1 / 0, name="raises"),
                             GroupReward(lambda: ["a", "b"], name="words")), published=published)
    await asyncio.gather(*(s.handle(delivery(r)) for r in group_of(2, ["a", "b"])))
    errors = {(sc.rollout_id, sc.scorer): sc.error for sc in published}
    assert errors[("g1-0", "short_list")] == errors[("g1-1", "short_list")] == (
        "group reward 'short_list' failed: RewardError: group reward 'short_list' returned [1.0]; it returns a list "
        "with one value per rollout (2)")
    assert errors[("g1-1", "raises")] == "group reward 'raises' failed: ZeroDivisionError: division by zero"
    assert errors[("g1-0", "words")].endswith("reward 'words' returned 'a'; a reward returns a finite float or a "
                                              "dict of them")
    assert all(sc.value == 0.0 for sc in published)


async def test_an_incomplete_group_is_scored_after_its_timeout_with_the_missing_named(pool: InProcessPool) -> None:
    published = Published()
    s = scorer(pool, Rewards(GroupReward(shortest)), published=published, group_timeout_s=0.2)
    members = group_of(3, ["cba", "cb", "c"])
    await asyncio.gather(s.handle(delivery(members[0])), s.handle(delivery(members[2])))
    by_id = {sc.rollout_id: sc for sc in published}
    assert sorted(by_id) == ["g1-0", "g1-2"] and by_id["g1-2"].value == 1.0 and by_id["g1-0"].value == 0.0
    assert by_id["g1-0"].error == ("group reward 'shortest': group g1 scored incomplete, missing rollout indices [1] "
                                   "of 3: the rest did not arrive within group_timeout_s=0.2s")
    await s.handle(delivery(members[1]))  # late: told so, not scored as a new group
    assert published[-1].rollout_id == "g1-1" and published[-1].error == (
        "group reward 'shortest': group g1 was scored without this rollout (index 1), which arrived after it")



async def test_a_partition_given_up_hands_back_its_held_members_and_later_arrivals(pool: InProcessPool) -> None:
    """Another replica takes the partition: the members held here stop waiting (HandBack: the
    consumer naks them, for the new owner), nothing is scored incomplete, and a member of that
    partition that joins its group afterwards is handed back too."""
    published = Published()
    owned = set(range(events.ROLLOUT_PARTITIONS))
    s = scorer(pool, Rewards(GroupReward(shortest)), published=published)
    s.owns = lambda group_id: events.partition_of(group_id) in owned
    members = group_of(3, ["cba", "cb", "c"])
    partition = events.partition_of(members[0].group_id)
    held = asyncio.ensure_future(s.handle(delivery(members[0])))
    await until(lambda: s.num_held == 1, what="the first member held for its group")
    owned.discard(partition)
    s.hand_back(partition)
    with pytest.raises(HandBack, match="its partition went to another scorer replica"):
        await held
    with pytest.raises(HandBack):
        await s.handle(delivery(members[1]))
    assert s.num_held == 0 and [sc.scorer for sc in published] == []  # the group reward: never scored here


async def test_held_rollouts_are_bounded_the_oldest_group_goes_first(pool: InProcessPool) -> None:
    published = Published()
    s = scorer(pool, Rewards(GroupReward(shortest)), published=published, max_held=2)
    waiting = [asyncio.ensure_future(s.handle(delivery(group_of(3, ["a"], group=g)[0]))) for g in ("ga", "gb")]
    await until(lambda: s.num_held == 2, what="two groups waiting")
    third = asyncio.ensure_future(s.handle(delivery(group_of(3, ["a"], group="gc")[0])))
    await waiting[0]  # the oldest group was scored to make room
    assert [(sc.rollout_id, sc.error is not None and "max_held=2" in sc.error) for sc in published] == [("ga-0", True)]
    assert not waiting[1].done() and not third.done() and s.num_held == 2
    stopping = asyncio.Event()
    back = asyncio.ensure_future(s.hand_back_on(stopping))
    stopping.set()
    await back
    for task in (waiting[1], third):  # on stop, held deliveries are handed back for a redelivery
        with pytest.raises(asyncio.CancelledError):
            await task


# --- custom scorers -----------------------------------------------------------------------


def answer_length(completion: str) -> float:
    return float(len(completion))


def takes_other_things(completion: str, model: str) -> float:
    return 0.0


async def loaded(custom: CustomReward, pool: InProcessPool) -> CustomReward:
    await custom.load(pool)
    return custom


async def test_a_custom_scorer_scores_its_one_function(pool: InProcessPool) -> None:
    custom = await loaded(custom_reward(f"{__name__}:answer_length", "reverse_text"), pool)
    assert (custom.durable, custom.filter_subject) == ("scorer-answer_length", "rollouts.*.reverse_text")
    (score,) = await scorer(pool, custom).score(rollout(answer="abcd"))
    assert (score.id, score.scorer, score.value, score.weight) == ("ro1.answer_length", "answer_length", 4.0, 1.0)
    named = await loaded(custom_reward(f"{__name__}:answer_length", "reverse-text", name="brevity", weight=0.5), pool)
    published = Published()
    cfg = RunConfig(run="r1", env="reverse_text", scorers={"brevity": 3.0})
    await scorer(pool, named, configured={"r1": cfg}, published=published).handle(delivery(rollout(answer="ab")))
    await scorer(pool, named, configured={"r1": cfg}, published=published).handle(delivery(rollout(run="r2")))
    assert (named.durable, named.filter_subject) == ("scorer-brevity", "rollouts.*.reverse-text")
    assert [(sc.id, sc.scorer, sc.value, sc.weight) for sc in published] == [
        ("ro1.brevity", "brevity", 2.0, 3.0), ("ro1.brevity", "brevity", 3.0, 0.5)]
    group = await loaded(custom_reward(f"{__name__}:shortest", "reverse_text", group=True), pool)
    published.clear()
    await asyncio.gather(*(scorer(pool, group, published=published).handle(delivery(r))
                           for r in group_of(1, ["ab"])))
    assert [(sc.id, sc.value) for sc in published] == [("g1-0.shortest", 1.0)]


@pytest.mark.parametrize(("args", "message"), [
    (("nocolon", "reverse_text"), "--function 'nocolon': write it as 'package.module:name'"),
    ((f"{__name__}:answer_length", "reverse_text", "a.b"), "--name 'a.b': use 1 to 128 letters"),
    ((f"{__name__}:answer_length", "rev*"), "--env 'rev\\*': use the environment's name"),
    ((f"{__name__}:answer_length", "reverse_text", None, -1.0), "--weight -1.0: a weight is a finite number"),
    ((f"{__name__}:answer_length", "reverse_text", None, 1.0, False, ["r1"], True), "--run and --backfill: choose one"),
    ((f"{__name__}:answer_length", "reverse_text", None, 1.0, False, ["r 1"]), "--run 'r 1': a run id is"),
])
def test_custom_scorer_option_mistakes_name_the_option(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        custom_reward(*args)


@pytest.mark.parametrize(("args", "message"), [
    (("no_such_module:f", "reverse_text"), "--function 'no_such_module:f': .*cannot import 'no_such_module'"),
    ((f"{__name__}:missing", "reverse_text"), f"'{__name__}' has no 'missing'"),
    ((f"{__name__}:answer_length", "reverse_text", "similarity"),
     "--name 'similarity': environment 'reverse_text' has a reward of that name already"),
    ((f"{__name__}:answer_length", "no_such_env"), "--env 'no_such_env': environment 'no_such_env': no module"),
    ((f"{__name__}:takes_other_things", "reverse_text"), r"reward 'takes_other_things' .* takes \['model'\]"),
    ((f"{__name__}:answer_length", "reverse_text", "g", 1.0, True), r"group reward 'g' .* takes \['completion'\]"),
])
async def test_custom_scorer_code_mistakes_name_the_option_when_it_loads(args: tuple[Any, ...], message: str,
                                                                         pool: InProcessPool) -> None:
    with pytest.raises(ValueError, match=message):
        await custom_reward(*args).load(pool)


def test_entry_point_refuses_bad_combinations(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in ((["--name", "x", "--weight", "2"], "--name, --weight: only for a custom scorer"),
                          (["--function", f"{__name__}:answer_length"], "--function needs --env ENV"),
                          (["--threads", "0"], "argument --threads: must be at least 1, got 0"),
                          (["--group"], "--group: only for a custom scorer"),
                          (["--run", "r1", "--backfill"], "--run, --backfill: only for a custom scorer"),
                          (["--function", "x", "--env", "reverse_text"], "--function 'x': write it as")):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2 and message in capsys.readouterr().err


def test_entry_point_imports_nothing_heavy_before_parsing() -> None:
    code = "import sys, flywheel_scorer.__main__; print(sorted({'nats', 'flywheel.contract.bus'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
