"""What `flywheel run` says while its run waits: against a real nats-server, the orchestrator,
scorers, replicas and weights it lacks, and each of its messages a service gave up on, with the
reason."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import pytest

from flywheel.contract import events
from flywheel.contract.bus import Bus, dead_letter, publish_dead_letter
from flywheel.contract.config import RunConfig
from flywheel.contract.runs import update_run
from flywheel.contract.settings import Settings
from flywheel.ops.run import MainJob
from flywheel.runtime.natsserver import NatsServer
from flywheel.runtime.runs import load_run_environments
from flywheel.sdk.scoring import required_scorers
from tests.helpers import until
from tests.inprocess import InProcessPool


async def job_on(bus: Bus, nats_server: NatsServer, tmp_path: Path, **config: object
                 ) -> tuple[MainJob, io.StringIO]:
    """A run's follower as `flywheel run` builds it, connected, its environment loaded (in workers
    in this process), its screen a buffer."""
    cfg = RunConfig.parse({"run": "waits", "env": "reverse_text", **config})
    out = io.StringIO()
    job = MainJob(cfg, Settings(nats_url=nats_server.url, data_dir=tmp_path), out=out)
    job._bus = bus
    pool = InProcessPool()
    job.environments = await load_run_environments(pool, cfg)
    await pool.close()
    job.required = required_scorers(cfg, job.environments["reverse_text"].env)
    return job, out


async def beat(bus: Bus, service: str, instance: int = 1, info: dict | None = None) -> None:
    """A live process of ``service``, as its heartbeat says."""
    heartbeat = events.ServiceHeartbeat(service=service, instance=f"{service}-{instance}", pid=instance, host="h",
                                        started_at=events.utc_now(), info=info or {})
    await (await bus.services_kv()).put(f"{service}-{instance}", events.encode(heartbeat))


async def test_in_flight_is_what_the_replicas_are_generating_for_the_run(bus: Bus, nats_server: NatsServer,
                                                                        tmp_path: Path) -> None:
    job, _ = await job_on(bus, nats_server, tmp_path)
    assert await job._in_flight() is None  # no replica reports the run
    await beat(bus, "inference", 1, {"runs": {"waits": {"num_in_flight": 24, "num_waiting": 40}, "other": {
        "num_in_flight": 7}}})
    await beat(bus, "inference", 2, {"runs": {"waits": {"num_in_flight": 8}}})
    await beat(bus, "scorer", 1, {"runs": {"waits": {"num_in_flight": 100}}})
    assert await job._in_flight() == 32  # being generated, on both replicas; not waiting, not another run's


async def test_a_quiet_run_says_what_inference_holds_back_and_the_bound(bus: Bus, nats_server: NatsServer,
                                                                         tmp_path: Path) -> None:
    job, out = await job_on(bus, nats_server, tmp_path)
    job.seen_weights = True
    for service in ("orchestrator", "scorer"):
        await beat(bus, service)
    await beat(bus, "inference", 1, {"runs": {"waits": {"num_in_flight": 0, "num_waiting": 0, "max_issued": 96,
                                                        "policy_version": 2}}})
    await job._say_waiting(31.0)
    assert out.getvalue() == ("run waits: no new step for 31s; rollouts in flight in inference: 0; its owner's last "
                              "note: (none)\n")
    # Two replicas hold rollouts back at the shared bound: the screen says so, and what moves it.
    await beat(bus, "inference", 1, {"runs": {"waits": {"num_in_flight": 0, "num_waiting": 16, "max_issued": 96,
                                                        "policy_version": 2}}})
    await beat(bus, "inference", 2, {"runs": {"waits": {"num_in_flight": 0, "num_waiting": 8, "max_issued": 96,
                                                        "policy_version": 2}}})
    await job._say_waiting(32.0)
    assert out.getvalue().splitlines()[-1] == (
        "run waits: no new step for 32s; rollouts in flight in inference: 0; 24 waiting there for admission or a "
        "place (the staleness bound: 96 rollouts issued since the run began, over every replica, until the trainer's "
        "next step); its owner's last note: (none)")
    # The tenant's other runs take its quota of one replica: the screen names the quota.
    await beat(bus, "inference", 2, {"runs": {"waits": {"num_in_flight": 0, "num_waiting": 0, "max_issued": 96,
                                                        "tenant": "alice", "num_waiting_tenant": 5,
                                                        "tenant_in_flight": 256, "tenant_max_in_flight": 256}}})
    await job._say_waiting(33.0)
    assert out.getvalue().splitlines()[-1] == (
        "run waits: no new step for 33s; rollouts in flight in inference: 0; 16 waiting there for admission or a "
        "place (the staleness bound: 96 rollouts issued since the run began, over every replica, until the trainer's "
        "next step); 5 waiting there for a place under tenant alice's quota (its runs roll out 256 at once in a "
        "replica, inference.tenant_max_rollouts_in_flight = 256); its owner's last note: (none)")


async def test_a_waiting_run_names_the_scorer_replica_and_weights_it_lacks(bus: Bus, nats_server: NatsServer,
                                                                          tmp_path: Path) -> None:
    job, _ = await job_on(bus, nats_server, tmp_path, scorers={"nospace": 0.5})
    missing = await job._missing()
    assert missing[0] == "an orchestrator to own the run (none is running: is `flywheel up` running?)"
    assert missing[1].startswith("the built-in scorer (no process scores reverse_text's rewards")
    assert missing[2].startswith("scorer 'nospace': no process runs it (start it with `flywheel scorer "
                                 "MODULE:FUNCTION --env reverse_text --name nospace`)")
    assert missing[3:] == ["an inference replica (none is running)",
                           "weights version 0 (the trainer has not published its first weights)"]
    for service in ("orchestrator", "scorer", "scorer-nospace"):
        await beat(bus, service)
    job.seen_weights = True
    # Published weights that no replica hosting the run has loaded yet (a large model's take a while).
    await beat(bus, "inference", 1, {"runs": {"waits": {"policy_version": None, "weights_error": None}}})
    assert (await job._missing()) == [("an inference replica with the run's weights (published; none has loaded "
                                       "them yet: a large model's take a while; the inference log says how far it "
                                       "is)")]
    await beat(bus, "inference", 1, {"runs": {"waits": {"policy_version": None, "weights_error": "sha256 mismatch"}}})
    assert "none has loaded them yet: sha256 mismatch" in (await job._missing())[0]
    await beat(bus, "inference", 1, {"runs": {"waits": {"policy_version": 0}}})
    assert await job._missing() == []


async def test_the_runs_dead_letters_are_said_with_their_reason(bus: Bus, nats_server: NatsServer,
                                                               tmp_path: Path) -> None:
    job, out = await job_on(bus, nats_server, tmp_path)
    watching = asyncio.ensure_future(job._watch_dead_letters())
    try:
        for seq, subject in enumerate(["tasks.other.reverse_text", "tasks.waits.reverse_text"], 1):
            await publish_dead_letter(bus, dead_letter(
                stream="TASKS", stream_seq=seq, subject=subject, consumer="inference", num_delivered=1,
                reason="rejected: environment 'reverse_text' failed to load: ModuleNotFoundError: No module named 'x'",
                payload=b"{}", headers=None))
        await until(lambda: "gave up on" in out.getvalue(), what="the run's dead letter said")
        await asyncio.sleep(0.5)  # noqa: sleep - the other run's letter, were it said, would be by now
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
    assert out.getvalue() == ("run waits: inference gave up on tasks.waits.reverse_text (dead-lettered): rejected: "
                              "environment 'reverse_text' failed to load: ModuleNotFoundError: No module named 'x'\n")
    assert job.num_dead_letters == 1
    assert (await job._missing())[-1] == ("rollouts that will not come: 1 of the run's messages were dead-lettered "
                                          "(reasons above)")


async def test_a_waiting_run_names_what_is_wrong_on_the_bus(bus: Bus, nats_server: NatsServer, tmp_path: Path) -> None:
    """Its tasks purged from TASKS, inference's durable of them deleted: said by name, not only
    "no new step"; a JetStream that refuses requests too."""
    from flywheel.contract.bus import Consumer, Delivery
    from flywheel.contract.runs import register_run, task_durable, update_run

    job, _ = await job_on(bus, nats_server, tmp_path)
    await register_run(bus, "waits")
    assert await job._bus_trouble() == []  # nothing published yet: nothing to miss
    await bus.publish(events.Task(run="waits", env="reverse_text", data={"text": "abc"}))
    await update_run(bus, "waits", num_tasks_published=1)
    async def ignore(delivery: Delivery) -> None:
        pass

    consumer = Consumer(bus, stream="TASKS", durable=task_durable("waits"), filter_subject="tasks.waits.>",
                        handler=ignore, event_type=events.Task)
    await consumer.ensure()
    assert await job._bus_trouble() == []
    await bus.js.purge_stream("TASKS")
    await bus.js.delete_consumer("TASKS", task_durable("waits"))
    trouble = await job._bus_trouble()
    purged = ("the run's tasks: the TASKS stream holds none of the 1 its orchestrator published (purged or "
              "deleted?); the run's owner publishes what the run still needs within seconds (a note says so)")
    gone = ("inference's consumer of the run's tasks (inference-waits on TASKS) is gone (deleted?): a live inference "
            "makes it again at its next pull")
    assert trouble == [purged, gone]
    nats_server.stop()
    try:
        (said,) = await job._bus_trouble()
        assert said.startswith("the bus's JetStream, which refuses requests") and "full disk" in said
    finally:
        nats_server.start()


async def test_a_run_that_warms_up_first_says_so_while_it_waits_for_its_first_weights(
        bus: Bus, nats_server: NatsServer, tmp_path: Path) -> None:
    job, _ = await job_on(bus, nats_server, tmp_path, sft={"steps": 10})
    assert (await job._missing())[-1] == (
        "weights version 0 (the trainer has not published its first weights; it first warms the model up with "
        "sft.steps = 10 supervised steps, which its log counts)")


async def test_after_the_last_step_the_run_waits_for_an_owner_that_renews_its_lease_and_says_so(
        bus: Bus, nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A real model's last evals take minutes: while its owner holds a live lease, the run waits.
    from datetime import timedelta

    from flywheel.ops import run as run_module

    monkeypatch.setattr(run_module, "RELEASE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(run_module, "QUIET_STEP_S", 0.5)
    job, out = await job_on(bus, nats_server, tmp_path)
    kv = await bus.runs_kv()
    await kv.put("waits", events.encode(events.RunState(
        id="waits", status="finished", owner="orchestrator o1",
        lease_expires_at=events.utc_now() + timedelta(seconds=60))))
    waiting = asyncio.ensure_future(job._await_end())
    await asyncio.sleep(2.0)  # noqa: sleep - four times the bound an owner without a lease gets
    assert not waiting.done()
    assert "waiting for its owner (orchestrator o1) to end the run and write its summary" in out.getvalue()
    await update_run(bus, "waits", owner=None, lease_expires_at=None)
    await asyncio.wait_for(waiting, 5)
    # An owner whose lease lapsed gets RELEASE_TIMEOUT_S from its last note, then the run goes on.
    await update_run(bus, "waits", owner="orchestrator o2", lease_expires_at=events.utc_now() - timedelta(seconds=1))
    await asyncio.wait_for(job._await_end(), 5)
