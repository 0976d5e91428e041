"""Inference under faults and bad input, against a real nats-server with the tiny model.

- What is published on a weights subject and is not that run's weight update (garbage,
  another event type, another run's update) is skipped and dead-lettered once, by every
  replica and restart; a replica that starts after it still finds the run's last real update.
- A run state that does not decode, a run that is not registered or has no config: its
  tasks are dead-lettered at once, with the reason, and the service goes on.
- A weight update whose blob does not verify leaves the run on the weights it has, and a
  later real update (a lower version than the bogus one) still loads.
- Admission counts the rollouts that reached the bus: a task delivered again (published
  again past deduplication, to the same process, to a new process, or while the first
  delivery is still in flight) is rolled out at most once per process and never counted twice.
- A replica killed while it holds tasks hands them to the next one within the ack wait.
- A run that ends (finished, failed, stopped, or abandoned when its owner's lease expires)
  releases its waiting tasks; its tasks published after the end are dead-lettered.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import nats.js.errors
import pytest

from flywheel.contract import events, weights
from flywheel.contract.bus import HEADER_CONTENT_TYPE, HEADER_MSG_ID, Bus
from flywheel.contract.service import read_heartbeats
from flywheel.contract.settings import InferenceSettings
from flywheel.runtime.natsserver import NatsServer, free_port
from flywheel.sdk import models
from flywheel_inference.intake import LEASE_CHECK_S
from flywheel_inference.worker import Worker
from tests.helpers import until
from tests.integration.services import Workers
from tests.integration.test_inference_worker import count, count_is, create_run, publish_weights, stored


def task(i: int | str, run: str = "r1", **fields: Any) -> events.Task:
    return events.Task(id=f"{run}-t{i}", run=run, env="reverse_text", data={"text": "abcd"}, num_rollouts=4,
                       **fields)


async def publish_again(bus: Bus, t: events.Task) -> None:
    """The same task as a new message (another Nats-Msg-Id): the bus does not deduplicate it."""
    await bus.publish_raw(t.subject(), events.encode(t), {HEADER_MSG_ID: events.new_id(),
                                                          HEADER_CONTENT_TYPE: events.JSON})


async def dead_letters(bus: Bus, consumer: str | None = None) -> list[events.DeadLetter]:
    letters: list[events.DeadLetter] = await stored(bus, "DEAD", events.DeadLetter)
    return [d for d in letters if consumer is None or d.consumer == consumer]


async def nothing_held(bus: Bus) -> bool:
    """No task queued or held by inference's consumers: its screen's and each run's."""
    infos = await bus.js.consumers_info("TASKS")
    return all(info.num_ack_pending == 0 and info.num_pending == 0 for info in infos)


async def serving(bus: Bus) -> bool:
    """An inference service beats (its heartbeat is removed when the service stops or dies)."""
    return any(b.service == "inference" for b in await read_heartbeats(bus))


def run_info(worker: Worker, run: str = "r1") -> dict[str, Any]:
    return worker.info["runs"].get(run, {})


# --- weights ------------------------------------------------------------------------------


async def test_payloads_on_a_weights_subject_that_are_not_its_updates_are_skipped_and_dead_lettered_once(
        bus: Bus, tiny_model_dir: Path, start_worker: Workers) -> None:
    await create_run(bus, tiny_model_dir, trainer={"batch_size": 16, "max_off_policy_steps": 0})
    base, _ = models.load_model(tiny_model_dir)
    await publish_weights(bus, "r1", 0, base)
    worker = await start_worker()
    await bus.publish(task(0))
    await until(lambda: count_is(bus, "ROLLOUTS", 4), timeout_s=30, what="the first group")

    json_headers = {HEADER_CONTENT_TYPE: events.JSON}
    other_run = events.WeightUpdate(run="r2", version=5, uri="nats-os://flywheel-weights/r2/x", sha256="0" * 64,
                                    size_bytes=1)
    await bus.publish_raw("weights.r1", b"\xff not an event", json_headers | {HEADER_MSG_ID: "garbage"})
    await bus.publish_raw("weights.r1", events.encode(task(9)), json_headers | {HEADER_MSG_ID: "a-task"})
    await bus.publish_raw("weights.r1", events.encode(other_run), json_headers | {HEADER_MSG_ID: "r2-update"})

    async def three_letters() -> bool:
        return len(await dead_letters(bus, "inference-weights")) == 3

    await until(three_letters, what="one dead letter per payload")
    reasons = " | ".join(d.reason for d in await dead_letters(bus, "inference-weights"))
    assert "does not decode" in reasons and "weights.r2" in reasons, reasons
    await bus.publish(task(1))
    await until(lambda: count_is(bus, "ROLLOUTS", 8), timeout_s=30, what="the next group, on version 0")
    assert await serving(bus)

    # A replica that starts now begins at the last message of weights.r1, which is not an update:
    # it dead-letters it under the same id (kept once) and still finds version 0.
    await start_worker.stop(worker)
    worker = await start_worker()
    await bus.publish(task(2))
    await until(lambda: count_is(bus, "ROLLOUTS", 12), timeout_s=30, what="a group from the new replica")
    assert run_info(worker)["policy_version"] == 0
    assert len(await dead_letters(bus, "inference-weights")) == 3
    assert await serving(bus)


async def test_a_bogus_update_leaves_the_run_on_its_weights_and_a_later_real_one_loads(
        bus: Bus, tiny_model_dir: Path, start_worker: Workers) -> None:
    await create_run(bus, tiny_model_dir, trainer={"batch_size": 8, "max_off_policy_steps": 1})  # 16 on version 0
    base, _ = models.load_model(tiny_model_dir)
    await publish_weights(bus, "r1", 0, base)
    worker = await start_worker()
    await bus.publish_many([task(0), task(1)])
    await until(lambda: count_is(bus, "ROLLOUTS", 8), timeout_s=30, what="two groups on version 0")

    bogus = events.WeightUpdate(run="r1", version=10**9, uri="nats-os://flywheel-weights/r1/99999999.safetensors",
                                sha256="0" * 64, size_bytes=123)
    await bus.publish(bogus)
    await until(lambda: "1000000000" in str(run_info(worker).get("weights_error")), what="the failed load reported")
    await bus.publish_many([task(2), task(3)])
    await until(lambda: count_is(bus, "ROLLOUTS", 16), timeout_s=30, what="sampling goes on, on version 0")
    assert run_info(worker)["policy_version"] == 0

    await publish_weights(bus, "r1", 1, base)  # below the bogus version, above the loaded one
    await until(lambda: run_info(worker)["policy_version"] == 1, timeout_s=30, what="version 1 loaded")
    await bus.publish_many([task(4), task(5)])
    await until(lambda: count_is(bus, "ROLLOUTS", 24), timeout_s=30, what="two groups on version 1")
    versions = sorted(r.policy_version for r in await stored(bus, "ROLLOUTS", events.Rollout))
    assert versions == [0] * 16 + [1] * 8
    assert run_info(worker)["weights_error"] is None
    assert await dead_letters(bus) == []


# --- runs that cannot take tasks ------------------------------------------------------------


async def test_tasks_of_a_run_that_is_unknown_has_no_config_or_a_bad_state_are_dead_lettered_at_once(
        bus: Bus, start_worker: Workers) -> None:
    kv = await bus.runs_kv()
    await kv.put("noconf", events.encode(events.RunState(id="noconf")))
    await kv.put("bad", b"{\"id\": 3, \"not\": \"a run state\"}")
    await start_worker()
    await bus.publish_many([task(0, run="ghost"), task(0, run="noconf"), task(0, run="bad")])

    async def three_letters() -> bool:
        return len(await dead_letters(bus, "inference")) == 3

    await until(three_letters, what="the three tasks dead-lettered")
    letters = {d.original_subject.split(".")[1]: d for d in await dead_letters(bus, "inference")}
    assert all(d.num_delivered == 1 and d.reason.startswith("rejected:") for d in letters.values()), letters
    assert "not in the runs bucket" in letters["ghost"].reason
    assert "no config" in letters["noconf"].reason
    assert "not a run state" in letters["bad"].reason
    await until(lambda: nothing_held(bus), what="nothing held")
    assert await serving(bus)


async def test_a_payload_on_a_run_s_task_subject_that_is_no_task_is_dead_lettered_once(
        bus: Bus, tiny_model_dir: Path, start_worker: Workers) -> None:
    # Both the screen and the run's own consumer read it: the screen's letter is the one.
    await create_run(bus, tiny_model_dir)
    worker = await start_worker()
    await until(lambda: "r1" in worker.tasks.runs(), what="the run's task consumer")
    await bus.publish_raw("tasks.r1.reverse_text", b"\xff not a task",
                          {HEADER_CONTENT_TYPE: events.JSON, HEADER_MSG_ID: "garbage"})

    async def both_done() -> bool:  # the screen's durable may be made after the run's on a loaded machine
        infos = await bus.js.consumers_info("TASKS")
        return ({"inference", "inference-r1"} <= {i.name for i in infos}
                and all(i.num_ack_pending == 0 and i.num_pending == 0 for i in infos))

    async def lettered() -> bool:
        return bool(await dead_letters(bus))

    await until(both_done, what="the payload done with by both consumers")
    await until(lettered, what="the screen's dead letter")
    (letter,) = await dead_letters(bus)
    assert letter.consumer == "inference" and "does not decode" in letter.reason, letter


async def test_tasks_of_an_ended_run_are_skipped_when_left_over_and_dead_lettered_when_published_after(
        bus: Bus, tiny_model_dir: Path, start_worker: Workers) -> None:
    cfg = await create_run(bus, tiny_model_dir)
    ended_at = events.utc_now()
    stopped = events.RunState(id="r1", status="stopped", config=cfg.model_dump(), ended_at=ended_at,
                              reason="stopped by the user")
    await (await bus.runs_kv()).put("r1", events.encode(stopped))
    worker = await start_worker()
    left_over = task("old", created_at=ended_at - timedelta(minutes=5))
    late = task("late", created_at=ended_at + timedelta(seconds=1))
    await bus.publish_many([left_over, late])

    async def one_letter() -> bool:
        return len(await dead_letters(bus, "inference")) == 1

    await until(one_letter, what="the late task dead-lettered")
    (letter,) = await dead_letters(bus, "inference")
    assert msgspec.json.decode(letter.payload)["id"] == late.id
    assert "stopped by the user" in letter.reason and "register a new run" in letter.reason, letter.reason
    await until(lambda: nothing_held(bus), what="the left-over task acked")
    assert run_info(worker)["num_skipped"] == 4
    assert await count(bus, "ROLLOUTS") == 0


async def test_waiting_tasks_are_released_when_the_owner_s_lease_expires_and_the_next_run_gets_inference(
        bus: Bus, tiny_model_dir: Path, start_worker: Workers) -> None:
    cfg = await create_run(bus, tiny_model_dir)  # 8 rollouts per version
    await create_run(bus, tiny_model_dir, run="r2")
    base, _ = models.load_model(tiny_model_dir)
    await publish_weights(bus, "r1", 0, base)
    await publish_weights(bus, "r2", 0, base)
    worker = await start_worker(InferenceSettings(max_tasks_in_flight=2, backoff_s=(0.2,), max_deliver=50,
                                                     live_trace_after_s=0.0))
    await bus.publish_many([task(i) for i in range(4)])
    await until(lambda: run_info(worker).get("num_waiting") == 8 and count_is(bus, "ROLLOUTS", 8), timeout_s=30,
                what="two groups published, two waiting (every slot of the consumer)")
    await bus.publish(task(0, run="r2"))

    # The owner renews its lease one last time, then dies: nothing writes the state again.
    renewed = events.RunState(id="r1", status="running", config=cfg.model_dump(), owner="flywheel-run pid 1",
                              lease_expires_at=events.utc_now() + timedelta(seconds=1))
    await (await bus.runs_kv()).put("r1", events.encode(renewed))
    await until(lambda: run_info(worker).get("num_skipped") == 8, what="the waiting groups released")
    await until(lambda: count_is(bus, "ROLLOUTS", 12), timeout_s=30, what="the next run's group")
    await until(lambda: nothing_held(bus), what="nothing held")
    assert await dead_letters(bus) == []  # published before the run was abandoned: skipped, not dead

    # `flywheel run --resume` takes the run over: it takes tasks again.
    resumed = msgspec.structs.replace(renewed, owner="flywheel-run pid 2", updated_at=events.utc_now(),
                                      lease_expires_at=events.utc_now() + timedelta(minutes=5))
    await (await bus.runs_kv()).put("r1", events.encode(resumed))
    await publish_weights(bus, "r1", 1, base)
    await bus.publish(task("resumed"))
    await until(lambda: count_is(bus, "ROLLOUTS", 16), timeout_s=30, what="a group of the resumed run")
    assert run_info(worker)["ended"] is None


async def test_a_process_that_resumes_after_a_pause_re_reads_a_lapsed_lease_before_it_releases_anything(
        bus: Bus, tiny_model_dir: Path, start_worker: Workers) -> None:
    """What a paused inference (SIGSTOP, a VM pause) finds when it resumes: a kept state whose lease
    lapsed on the clock while its owner went on renewing it in the bucket, and a watcher that has
    not caught up. A fresh read decides, so the waiting tasks are kept."""
    cfg = await create_run(bus, tiny_model_dir)  # 8 rollouts per version
    base, _ = models.load_model(tiny_model_dir)
    await publish_weights(bus, "r1", 0, base)
    worker = await start_worker(InferenceSettings(max_tasks_in_flight=2, backoff_s=(0.2,), max_deliver=50))
    await bus.publish_many([task(i) for i in range(4)])
    await until(lambda: run_info(worker).get("num_waiting") == 8, timeout_s=30, what="two groups waiting")
    live = events.RunState(id="r1", status="running", config=cfg.model_dump(), owner="flywheel-run pid 1",
                           lease_expires_at=events.utc_now() + timedelta(minutes=5))
    await (await bus.runs_kv()).put("r1", events.encode(live))
    await until(lambda: worker.states.by_run["r1"].owner == "flywheel-run pid 1", what="the watcher's copy")
    # As the process finds it after the pause: its copy is a minute old, the lease in it lapsed.
    worker.states.by_run["r1"] = msgspec.structs.replace(live, updated_at=live.updated_at - timedelta(minutes=1),
                                                         lease_expires_at=events.utc_now() - timedelta(seconds=30))
    # The lease check reads the bucket again (the live state) instead of releasing anything.
    await until(lambda: worker.states.by_run["r1"].lease_expires_at == live.lease_expires_at,
                timeout_s=10 * LEASE_CHECK_S, what="the kept state read again from the bucket")
    # What was waiting still waits (the groups in flight meanwhile end), nothing released.
    await until(lambda: run_info(worker).get("num_waiting") == 8, timeout_s=30, what="two groups waiting still")
    info = run_info(worker)
    assert info["num_skipped"] == 0 and info["num_waiting"] == 8 and info["ended"] is None, str(info)
    # A lease that did lapse in the bucket too still ends the run: its waiting tasks go.
    lapsed = msgspec.structs.replace(live, updated_at=events.utc_now(),
                                     lease_expires_at=events.utc_now() + timedelta(seconds=1))
    await (await bus.runs_kv()).put("r1", events.encode(lapsed))
    await until(lambda: run_info(worker).get("num_skipped") == 8, what="the waiting groups released")


async def test_a_task_whose_rollouts_the_bus_cannot_take_gives_rollouts_that_say_so(
        bus: Bus, tiny_model_dir: Path, start_worker: Workers) -> None:
    """A task just under the max payload is taken; each of its rollouts (which carry the task's row)
    is over it: published as an error naming the size and the limit, so its group is done."""
    await create_run(bus, tiny_model_dir)
    base, _ = models.load_model(tiny_model_dir)
    await publish_weights(bus, "r1", 0, base)
    worker = await start_worker(InferenceSettings(backoff_s=(0.2,), max_deliver=3))
    padding = "x" * (bus.nc.max_payload - 600)  # a field the prompt does not read: the row still fits
    await bus.publish(events.Task(id="r1-big", run="r1", env="reverse_text", data={"text": "abcd", "padding": padding},
                                  num_rollouts=4))
    await until(lambda: count_is(bus, "ROLLOUTS", 4), timeout_s=60, what="the task's rollouts, as errors")
    rollouts = await stored(bus, "ROLLOUTS", events.Rollout)
    assert {r.status for r in rollouts} == {"error"} and all(r.nodes == [] and r.task_data == {} for r in rollouts)
    assert all(f"more than the bus takes ({bus.nc.max_payload} bytes" in (r.error or "") for r in rollouts)
    await until(lambda: nothing_held(bus), what="the task acked")
    assert await dead_letters(bus) == [] and run_info(worker)["num_issued"] == 4


# --- admission counts what reached the bus --------------------------------------------------


async def test_a_task_published_again_to_the_same_process_is_acked_not_rolled_out_again(
        bus: Bus, tiny_model_dir: Path, start_worker: Workers) -> None:
    await create_run(bus, tiny_model_dir)  # 8 rollouts on version 0
    base, _ = models.load_model(tiny_model_dir)
    await publish_weights(bus, "r1", 0, base)
    worker = await start_worker()
    await bus.publish(task(0))
    await until(lambda: count_is(bus, "ROLLOUTS", 4), timeout_s=30, what="the group")
    await until(lambda: nothing_held(bus), what="the task acked")
    num_traces = await count(bus, "TRACES")

    await publish_again(bus, task(0))
    await until(lambda: nothing_held(bus), what="the second copy acked")
    assert await count(bus, "TRACES") == num_traces  # not rolled out again
    assert run_info(worker)["num_issued"] == 4

    await bus.publish(task(1))  # the run keeps going: room for one more group before version 1
    await until(lambda: count_is(bus, "ROLLOUTS", 8), timeout_s=30, what="the next group")
    assert run_info(worker)["num_issued"] == 8


async def test_a_new_process_that_rolls_out_a_published_task_again_counts_only_what_the_bus_stored(
        bus: Bus, tiny_model_dir: Path, start_worker: Workers) -> None:
    await create_run(bus, tiny_model_dir)  # 8 rollouts on version 0
    base, _ = models.load_model(tiny_model_dir)
    await publish_weights(bus, "r1", 0, base)
    first = await start_worker()
    await bus.publish(task(0))
    await until(lambda: count_is(bus, "ROLLOUTS", 4), timeout_s=30, what="the group")
    await until(lambda: nothing_held(bus), what="the task acked")
    await start_worker.stop(first)

    # As after a server restart that lost the ack: the task comes again, to a process that
    # has no record of it. Its rollouts have the same ids, so the bus keeps the first copies.
    second = await start_worker()
    await publish_again(bus, task(0))
    await until(lambda: nothing_held(bus), timeout_s=30, what="the task rolled out again and acked")
    assert await count(bus, "ROLLOUTS") == 4
    assert run_info(second)["num_issued"] == 4

    await bus.publish(task(1))
    await until(lambda: count_is(bus, "ROLLOUTS", 8), timeout_s=30, what="the next group: the run keeps going")
    assert run_info(second)["num_issued"] == 8


async def test_a_second_delivery_of_a_task_in_flight_waits_for_the_first(
        bus: Bus, tiny_model_dir: Path, start_worker: Workers) -> None:
    await create_run(bus, tiny_model_dir)
    worker = await start_worker()
    await bus.publish(task(0))
    await publish_again(bus, task(0))

    async def both_held() -> bool:
        return (await bus.js.consumer_info("TASKS", "inference-r1")).num_ack_pending == 2

    await until(both_held, what="both copies delivered")
    await until(lambda: run_info(worker).get("num_waiting") == 4, what="one copy waiting for weights")
    base, _ = models.load_model(tiny_model_dir)
    await publish_weights(bus, "r1", 0, base)
    await until(lambda: nothing_held(bus), timeout_s=30, what="both copies acked")
    assert await count(bus, "ROLLOUTS") == 4
    assert run_info(worker)["num_issued"] == 4
    assert await count(bus, "TRACES") == 12  # rolled out once: 3 nodes per rollout


async def test_a_server_restart_mid_run_leaves_the_count_equal_to_the_rollouts_on_the_bus(
        nats_server: NatsServer, bus: Bus, tiny_model_dir: Path, start_worker: Workers) -> None:
    await create_run(bus, tiny_model_dir, trainer={"batch_size": 24, "max_off_policy_steps": 0})
    base, _ = models.load_model(tiny_model_dir)
    await publish_weights(bus, "r1", 0, base)
    worker = await start_worker()
    await bus.publish_many([task(i) for i in range(6)])
    await until(lambda: run_info(worker).get("num_issued", 0) >= 4, timeout_s=30, what="rolling out")
    await asyncio.to_thread(nats_server.restart)
    await until(lambda: nothing_held(bus), timeout_s=60, what="every task done after the restart")
    assert await count(bus, "ROLLOUTS") == 24
    assert run_info(worker)["num_issued"] == 24


# --- a replica killed while it holds tasks ---------------------------------------------------


@pytest.mark.long
async def test_a_killed_replica_s_tasks_reach_the_next_one_within_seconds(
        nats_server: NatsServer, bus: Bus, tiny_model_dir: Path, start_worker: Workers, tmp_path: Path) -> None:
    await create_run(bus, tiny_model_dir, trainer={"batch_size": 16, "max_off_policy_steps": 0})
    env = os.environ | {"FLYWHEEL_NATS_URL": nats_server.url, "FLYWHEEL_DATA_DIR": str(tmp_path / "data"),
                        "FLYWHEEL_INFERENCE_PORT": str(free_port())}
    log_path = tmp_path / "inference.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "flywheel_inference", env=env, stdout=log,
                                                    stderr=asyncio.subprocess.STDOUT)
    try:
        await bus.publish_many([task(i) for i in range(4)])

        async def held() -> bool:  # no weights yet: the process holds every task, waiting
            assert proc.returncode is None, log_path.read_text()[-3000:]
            try:
                return (await bus.js.consumer_info("TASKS", "inference-r1")).num_ack_pending == 4
            except nats.js.errors.NotFoundError:  # the process has not made the run's consumer yet
                return False

        await until(held, timeout_s=60, what="the process to hold the four tasks")
        os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()
        killed = time.monotonic()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

    base, _ = models.load_model(tiny_model_dir)
    await publish_weights(bus, "r1", 0, base)
    await start_worker()
    await until(lambda: count_is(bus, "ROLLOUTS", 16), timeout_s=15, what="the killed replica's tasks, rolled out")
    assert time.monotonic() - killed < 15


async def test_a_weights_fetch_while_the_server_is_down_is_tried_again(
        nats_server: NatsServer, bus: Bus, tiny_model_dir: Path, start_worker: Workers) -> None:
    await create_run(bus, tiny_model_dir)
    base, _ = models.load_model(tiny_model_dir)
    await publish_weights(bus, "r1", 0, base)
    worker = await start_worker()
    await bus.publish(task(0))
    await until(lambda: count_is(bus, "ROLLOUTS", 4), timeout_s=30, what="version 0 in use")
    uri, sha, size = await weights.put(bus, "r1", 1, models.save_weights(base))
    await asyncio.to_thread(nats_server.stop)
    update = events.WeightUpdate(run="r1", version=1, uri=uri, sha256=sha, size_bytes=size)
    await worker.hosting.on_weight_update(update)
    # The fetch fails while the server is away (the bus layer and the policy both try again).
    await until(lambda: not worker.bus.nc.is_connected, what="the worker to see the server gone")
    await asyncio.sleep(1.0)  # noqa: sleep - the server stays away past the first tries
    await asyncio.to_thread(nats_server.start)
    await until(lambda: run_info(worker)["policy_version"] == 1, timeout_s=30,
                what="version 1, once the server is back")
    assert run_info(worker)["weights_error"] is None
