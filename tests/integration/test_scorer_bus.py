"""The scorer against a real nats-server: built-in and custom scorers, weights, group rewards
held across interleaved groups, dead letters.

The built-in scorer runs in this process (its consumer, as the composition root builds it);
the custom scorer runs as its own process (``python -m flywheel_scorer --function ...``),
scoring with :func:`answer_length` below, and is stopped by SIGTERM like a deployed one.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from flywheel.contract import events
from flywheel.contract.bus import Bus, read_stream
from flywheel.contract.config import RunConfig
from flywheel.contract.service import read_heartbeats
from flywheel.contract.settings import ScorerSettings
from flywheel.runtime.natsserver import NatsServer
from flywheel_scorer import scorer
from flywheel_scorer.partitions import Partitions
from flywheel_scorer.scorer import EnvironmentRewards
from tests.helpers import until, worker_pool
from tests.integration.conftest import ENVS
from tests.unit.test_scorer_rewards import group_of, rollout

REPO = Path(__file__).resolve().parents[2]


def answer_length(completion: str) -> float:
    """The custom scorer's function."""
    return float(len(completion))


@asynccontextmanager
async def builtin_scorer(bus: Bus, **bounds: Any) -> AsyncIterator[Partitions]:
    async with worker_pool("scorer") as workers:
        rewards = EnvironmentRewards()
        await rewards.start(bus, workers)
        partitions, _ = scorer.build(bus, rewards, ScorerSettings(**{"max_in_flight": 8, **bounds}))
        running = asyncio.ensure_future(partitions.run())
        try:
            await until(lambda: len(partitions.owned) == events.ROLLOUT_PARTITIONS, what="every partition claimed")
            yield partitions
        finally:
            partitions.stop()
            await running


async def pending(bus: Bus, durable: str = "scorer") -> tuple[int, int]:
    """Redelivered and ack-pending rollouts over the partition consumers of ``durable``."""
    infos = [await bus.js.consumer_info("ROLLOUTS", f"{durable}-p{k}") for k in range(events.ROLLOUT_PARTITIONS)]
    return sum(i.num_redelivered or 0 for i in infos), sum(i.num_ack_pending or 0 for i in infos)


async def stored(bus: Bus, stream: str, type_: Any) -> list[Any]:
    """The events ``stream`` holds (a scorer's scores of one turn travel as one batch message)."""
    return await read_stream(bus, stream, type_)


async def num_events(bus: Bus, stream: str) -> int:
    return len(await read_stream(bus, stream))


async def put_run(bus: Bus, run: str, config: dict[str, Any]) -> None:
    await (await bus.runs_kv()).put(run, events.encode(events.RunState(id=run, config=config)))


@pytest.mark.long
async def test_builtin_and_custom_scorers_both_score_every_rollout(bus: Bus, nats_server: NatsServer,
                                                                   tmp_path: Path) -> None:
    await put_run(bus, "r1", RunConfig(run="r1", env="reverse_text", scorers={"exact": 0.5, "answer_length": 2.0})
                  .model_dump())
    log_path = tmp_path / "custom-scorer.log"
    with log_path.open("w") as log:
        custom = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "flywheel_scorer", "--function", f"{__name__}:answer_length", "--env", "reverse_text",
            cwd=REPO, env={**os.environ, "FLYWHEEL_NATS_URL": nats_server.url}, stdout=log,
            stderr=asyncio.subprocess.STDOUT)
    try:
        async def custom_is_up() -> bool:
            assert custom.returncode is None, log_path.read_text()
            return any(b.service == "scorer-answer_length" for b in await read_heartbeats(bus))

        await until(custom_is_up, what="the custom scorer's heartbeat")
        answers = {"ro1": "cba", "ro2": "cb", "ro3": "xyz"}
        async with builtin_scorer(bus):
            await bus.publish_many([rollout(rid, answer=answer) for rid, answer in answers.items()]
                                   + [rollout("ro4", answer="cba", run="r2")])

            async def all_scored() -> bool:
                return await num_events(bus, "SCORES") == 4 * 3

            await until(all_scored, what="three scores for each of four rollouts")
    finally:
        custom.send_signal(signal.SIGTERM)
        returncode = await asyncio.wait_for(custom.wait(), 30)
    assert returncode == 0, log_path.read_text()

    scores = {sc.id: sc for sc in await stored(bus, "SCORES", events.Score)}
    assert {rid: (scores[f"{rid}.similarity"].value, scores[f"{rid}.exact"].value, scores[f"{rid}.answer_length"].value)
            for rid in answers} == {"ro1": (1.0, 1.0, 3.0), "ro2": (0.8, 0.0, 2.0), "ro3": (0.0, 0.0, 3.0)}
    # r1's config sets exact and answer_length; r2 has no config: the defaults (1.0, 0.0 and --weight 1.0).
    assert {sc.scorer: sc.weight for sc in scores.values() if sc.run == "r1"} == {
        "similarity": 1.0, "exact": 0.5, "answer_length": 2.0}
    assert {sc.scorer: sc.weight for sc in scores.values() if sc.run == "r2"} == {
        "similarity": 1.0, "exact": 0.0, "answer_length": 1.0}
    assert all(sc.error is None and sc.group_id == "g1" for sc in scores.values())
    assert scores["ro4.answer_length"].subject() == "scores.r2.reverse_text.answer_length"
    for durable in ("scorer", "scorer-answer_length"):
        for k in range(events.ROLLOUT_PARTITIONS):
            info = await bus.js.consumer_info("ROLLOUTS", f"{durable}-p{k}")
            assert info.num_ack_pending == 0 and info.num_pending == 0, (durable, k)


async def shortest_scores(bus: Bus) -> list[events.Score]:
    return [sc for sc in await stored(bus, "SCORES", events.Score) if sc.scorer == "shortest"]


async def test_interleaved_groups_are_held_until_complete_and_never_deadlock(bus: Bus) -> None:
    """Four groups of three, their members interleaved on the stream, through a consumer that
    scores two rollouts at once and holds at most eight: every group is scored whole."""
    await put_run(bus, "r1", RunConfig(run="r1", env="reverse_text", rewards={
        "shortest": {"function": "tests.unit.test_scorer_rewards:shortest", "group": True}}).model_dump())
    groups = [group_of(3, ["cba", "cb" * (g + 1), "c"], group=f"g{g}") for g in range(4)]
    interleaved = [groups[g][i] for i in range(3) for g in range(4)]
    async with builtin_scorer(bus, max_in_flight=2, max_held=8) as consumer:
        await bus.publish_many(interleaved)
        await until(lambda: consumer.stats.acked == 12, what="every rollout scored and acked")

        async def all_scored() -> bool:
            return len(await shortest_scores(bus)) == 12

        # A group's scores go out as one batch, which can land on the stream a moment after the acks.
        await until(all_scored, what="the 12 group scores on SCORES")
    scores = await shortest_scores(bus)
    assert len(scores) == 12 and all(sc.error is None for sc in scores)
    assert {sc.rollout_id for sc in scores if sc.value == 1.0} == {f"g{g}-2" for g in range(4)}
    assert await pending(bus) == (0, 0)


async def test_a_held_member_is_kept_alive_past_ack_wait_not_redelivered(bus: Bus) -> None:
    await put_run(bus, "r1", RunConfig(run="r1", env="reverse_text", rewards={
        "shortest": {"function": "tests.unit.test_scorer_rewards:shortest", "group": True}}).model_dump())
    first, second = group_of(2, ["cba", "cb"])
    async with builtin_scorer(bus, ack_wait_s=1.0) as consumer:
        await bus.publish(first)

        async def scored() -> bool:
            return await num_events(bus, "SCORES") > 0

        await until(scored, what="the first member's own scores")

        held_since = time.monotonic()

        async def held_past_ack_wait() -> bool:  # two and a half ack waits: in_progress keeps it ours
            assert (*await pending(bus), consumer.stats.acked) == (0, 1, 0)
            return time.monotonic() - held_since > 2.5

        await until(held_past_ack_wait, what="the first member held for two ack waits")
        await bus.publish(second)
        await until(lambda: consumer.stats.acked == 2, what="both members acked")
    scores = {sc.id: sc for sc in await stored(bus, "SCORES", events.Score) if sc.scorer == "shortest"}
    assert {k: (v.value, v.error) for k, v in scores.items()} == {"g1-0.shortest": (0.0, None),
                                                                  "g1-1.shortest": (1.0, None)}
    assert (await pending(bus))[0] == 0


async def test_what_can_never_be_scored_is_dead_lettered_and_scoring_goes_on(bus: Bus) -> None:
    await put_run(bus, "broken", {"scorers": ["exact"]})
    async with builtin_scorer(bus) as consumer:
        await bus.publish_many([rollout("lost", env="no_such_env"), rollout("odd", run="broken"), rollout("ro1")])
        await until(lambda: consumer.stats.dead_lettered == 2 and consumer.stats.acked == 1,
                    what="two dead letters and one scored rollout")
    letters = {letter.original_subject: letter for letter in await stored(bus, "DEAD", events.DeadLetter)}
    assert letters[rollout("lost", env="no_such_env").subject()].reason.startswith(
        "rejected: environment 'no_such_env': no module 'no_such_env'")
    assert letters[rollout("odd", run="broken").subject()].reason.startswith(
        "rejected: run 'broken': config: run: Field required")
    assert {letter.consumer.rsplit("-p", 1)[0] for letter in letters.values()} == {"scorer"}
    assert sorted(sc.id for sc in await stored(bus, "SCORES", events.Score)) == ["ro1.exact", "ro1.similarity"]


async def test_a_rollout_scored_again_publishes_nothing_new(bus: Bus) -> None:
    await bus.publish_many([rollout("ro1"), rollout("ro2", answer="c")])  # a message each
    group = group_of(6, ["cba", "c", "cb", "x", "cba", "abc"], group="g2")
    await bus.publish_many(group, events.MSGPACK, together=True)  # one message, as inference publishes a group
    for _ in range(2):  # the second time as after a crash before the acks: every rollout again
        async with builtin_scorer(bus, max_in_flight=2) as consumer:  # fewer slots than the group has rollouts
            await until(lambda: consumer.stats.acked == 3, what="the three messages scored")
        for k in range(events.ROLLOUT_PARTITIONS):
            await bus.js.delete_consumer("ROLLOUTS", f"scorer-p{k}")
    assert await num_events(bus, "SCORES") == 2 * 8  # similarity and exact, each rollout
    # Two messages a rollout alone, two for the group's (a subject a scorer): the same again were kept once.
    assert (await bus.js.stream_info("SCORES")).state.messages == 2 * 2 + 2


@asynccontextmanager
async def custom_scorer(bus: Bus, name: str, **options: Any) -> AsyncIterator[tuple[Partitions, str]]:
    """A custom scorer of answer_length (named ``name``) started as its composition root starts
    it: where a new durable begins, then the line it says at start."""
    custom = scorer.custom_reward(f"{__name__}:answer_length", "reverse_text", name=name, **options)
    async with worker_pool("scorer-custom") as workers:
        start = await custom.start(bus, workers)
        partitions, _ = scorer.build(bus, custom, ScorerSettings(max_in_flight=8), start)
        running = asyncio.ensure_future(partitions.run())
        try:
            await until(lambda: len(partitions.owned) == events.ROLLOUT_PARTITIONS, what="every partition claimed")
            said = custom.joined(partitions.owned[0].consumer.created, start)
            yield partitions, said
        finally:
            partitions.stop()
            await running


@pytest.mark.long
async def test_a_new_custom_scorer_joins_from_now_and_the_runs_that_need_it_not_the_whole_history(
        bus: Bus) -> None:
    kv = await bus.runs_kv()
    old = events.RunState(id="old", status="finished", scorers={"similarity": 1.0, "late": 1.0})
    needs_it = events.RunState(id="needs", status="running", scorers={"similarity": 1.0, "late": 1.0})
    for state in (old, needs_it):
        await kv.put(state.id, events.encode(state))
    # Stored before any custom scorer started: a finished run's history, and the earlier rollouts
    # of a run still going whose reward names the scorer.
    await bus.publish_many([rollout("h1", run="old"), rollout("h2", run="old"), rollout("n1", run="needs")])

    async with custom_scorer(bus, "late") as (consumer, said):
        assert "rollouts from " in said and "--backfill scores the stored history" in said
        await bus.publish(rollout("new1", run="other"))
        # From the needing run's start: the old run's rollouts come too, and are passed over.
        await until(lambda: consumer.stats.acked == 4, what="the stored rollouts since that run began, and the new one")
    late = sorted(sc.rollout_id for sc in await stored(bus, "SCORES", events.Score) if sc.scorer == "late")
    assert late == ["n1", "new1"]  # not h1, h2: the finished run's history is not scored again

    async with custom_scorer(bus, "late") as (consumer, said):  # restarted: on where it stopped
        assert "its durable exists, so it goes on where it stopped" in said
        await bus.publish(rollout("new2", run="other"))
        await until(lambda: consumer.stats.acked == 1, what="the rollout published since")

    async with custom_scorer(bus, "filler", backfill=True) as (consumer, said):
        assert "every stored rollout of reverse_text (--backfill)" in said
        await until(lambda: consumer.stats.acked == 5, what="all five stored rollouts")
    async with custom_scorer(bus, "one_run", runs=["old"]) as (consumer, said):
        assert "every rollout of run(s) old" in said
        await until(lambda: consumer.stats.acked == 2, what="the old run's two rollouts")
    by_scorer: dict[str, list[str]] = {}
    for sc in await stored(bus, "SCORES", events.Score):
        by_scorer.setdefault(sc.scorer, []).append(sc.rollout_id)
    assert sorted(by_scorer["late"]) == ["n1", "new1", "new2"]
    assert sorted(by_scorer["filler"]) == ["h1", "h2", "n1", "new1", "new2"]
    assert sorted(by_scorer["one_run"]) == ["h1", "h2"]


async def test_the_watch_flags_a_planted_exploit_as_the_policy_learns_it(bus: Bus, caplog: Any,
                                                                          monkeypatch: Any) -> None:
    """The built-in scorer on a real bus: rollouts of an environment whose reward pays for MAGIC
    (tests/envs/magic_env.py) say it more and more, step after step; the watch publishes a
    ``watch`` score (weight 0) on the flagged ones and logs its first flag with the reason."""
    monkeypatch.syspath_prepend(str(ENVS))
    await put_run(bus, "r1", RunConfig(run="r1", env="magic_env").model_dump())
    texts = ["abc", "hello", "wheel", "token"]
    published = []
    for step in range(10):
        for k in range(16):
            i = step * 16 + k
            text = texts[i % 4]
            magic = (i * 7919) % 10 < step  # the share that says MAGIC grows a tenth a step
            answer = "MAGIC" if magic else (text[::-1] if i % 3 else "no idea")
            published.append(rollout(f"ro{i}", text=text, answer=answer, env="magic_env", group=f"g{i}"))
    async with builtin_scorer(bus, max_in_flight=1):  # in order, as steps come
        await bus.publish_many(published)

        async def all_scored() -> bool:
            scores: list[events.Score] = await stored(bus, "SCORES", events.Score)
            return len({s.rollout_id for s in scores if s.scorer == "pays"}) == len(published)

        await until(all_scored, timeout_s=60, what="every rollout scored")
    scores = await stored(bus, "SCORES", events.Score)
    flags = [s for s in scores if s.scorer == events.WATCH_SCORER]
    assert flags and all(s.weight == 0.0 and "divergence" in s.components for s in flags)
    first = min(int(s.rollout_id.removeprefix("ro")) for s in flags)
    assert first < 9 * 16, first  # before the policy says it every time
    said = [r.getMessage() for r in caplog.records if "reward-hacking watch" in r.getMessage()]
    assert len(said) == 1 and "metric 'correct' part ways" in said[0] and "?flagged=true" in said[0]
