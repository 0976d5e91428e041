"""Teachers against a real nats-server: the inference process's teacher host values the
rollouts of runs that name teachers and publishes one Signal per rollout on SIGNALS.

The host runs in this process (as the inference composition root adds it to its Service) on
the tiny model; the rollouts are built as the interception endpoint builds them (the real
tokenizer, multi-turn, retries), and their values are checked against the model's own
forward. The last test runs ``python -m flywheel_inference`` and SIGKILLs it mid-way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import nats.js.errors
import pytest
import torch

from flywheel.contract import events, weights
from flywheel.contract.bus import Bus
from flywheel.contract.config import RunConfig
from flywheel.contract.runs import LET_GO_S, register_run, update_run
from flywheel.contract.settings import InferenceSettings
from flywheel.runtime.natsserver import NatsServer, free_port
from flywheel.sdk import models
from flywheel_inference.teacher import TeacherHost
from tests.helpers import until, worker_pool
from tests.integration.test_inference_worker import count, stored
from tests.unit.test_teacher import PROMPT, assert_close, expected_values, multi_turn

REPO = Path(__file__).resolve().parents[2]


@asynccontextmanager
async def hosting(nats_url: str, data_dir: Path, **settings: Any) -> AsyncIterator[TeacherHost]:
    """A teacher host on its own connection, as the inference process runs it; stopped after."""
    host_bus = await Bus.connect(nats_url, name="inference")
    async with worker_pool("inference") as workers:
        host = TeacherHost(host_bus, data_dir, InferenceSettings(**{"backoff_s": (0.2,), **settings}), info={},
                           pool=workers)
        stopping = asyncio.Event()
        running = asyncio.ensure_future(host.run(stopping))
        try:
            yield host
        finally:
            stopping.set()
            try:
                await running
            finally:
                await host_bus.close()


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[Any, Any]:
    return models.load_model(tiny_model_dir)


def data_dir_of(tiny_model_dir: Path) -> Path:
    """The data folder whose models/tiny is the session's tiny model (model "tiny" resolves there)."""
    return tiny_model_dir.parents[1]


async def test_one_signal_per_rollout_equal_to_a_direct_forward_a_malformed_one_dead_lettered(
        bus: Bus, nats_server: NatsServer, tiny_model_dir: Path, tiny: tuple[Any, Any],
        caplog: pytest.LogCaptureFixture) -> None:
    model, tok = tiny
    # An eval run (its config an eval's, not a run config) has no teachers: passed over, unsaid.
    await register_run(bus, "tr-eval", config={"eval": "held_out", "env": "reverse_text"}, kind="eval")
    cfg = RunConfig(run="tr", env="reverse_text", trainer={"advantage": {"type": "opd", "teacher": "t"}},
                    teachers={"t": {"model": "tiny", "max_batch_size": 4}})
    await register_run(bus, "tr", config=cfg.model_dump())
    rollouts = [multi_turn(tok, PROMPT, seed=i, rollout_id=f"ro{i}", temperature=0.5 + 0.25 * i, run="tr")
                for i in range(5)]
    rollouts.append(msgspec.structs.replace(rollouts[0], id="unset", sampling=None))  # the run's: 1.0
    errored = msgspec.structs.replace(rollouts[1], id="errored", status="error", error="boom")
    span = events.TokenSpan(token_ids=[5, 6], logprobs=[-1.0], loss_mask=[True, True])
    malformed = msgspec.structs.replace(rollouts[2], id="malformed", nodes=[
        events.Node(id="n", message=events.Message(role="assistant", content="x"), tokens=span)])
    async with hosting(nats_server.url, data_dir_of(tiny_model_dir), teacher_batch_size=4) as host:
        await bus.publish_many([*rollouts[:3], malformed, errored, *rollouts[3:]], events.MSGPACK)
        await until(lambda: _is(bus, "SIGNALS", len(rollouts)), timeout_s=60, what="a signal for each good rollout")
        await until(lambda: _is(bus, "DEAD", 1), what="the malformed rollout's dead letter")
        info = await bus.js.consumer_info("ROLLOUTS", "teacher-tr-t")
        assert info.num_ack_pending == 0 and info.num_pending == 0
        assert info.config.filter_subject == "rollouts.tr.reverse_text.*" and info.config.inactive_threshold == 3600
        counters = host.info["teachers"]["tr"]["t"]
        assert (counters["model"], counters["num_signals"], counters["num_errors"]) == ("tiny", len(rollouts), 0)
        assert counters["num_tokens"] > counters["num_sampled_tokens"] > 0 and counters["busy_s"] > 0
        assert host.runs() == ["tr"]
        await update_run(bus, "tr", status="finished")
        await until(lambda: host.runs() == [], what="the finished run's teachers to stop")
        # Its durable goes LET_GO_S after the host stopped pulling it (the server deletes it).
        await until(lambda: _expires(bus, "teacher-tr-t"), what="the ended run's durable let go")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR and "tr-eval" in r.getMessage()]

    signals = {s.id: s for s in await stored(bus, "SIGNALS", events.Signal)}
    assert set(signals) == {f"{r.id}.t" for r in rollouts}  # none for the errored or the malformed rollout
    for r in rollouts:
        temperature = r.sampling.temperature if r.sampling else 1.0
        s = signals[f"{r.id}.t"]
        assert (s.run, s.env, s.rollout_id, s.source, s.model, s.temperature, s.error) == (
            "tr", "reverse_text", r.id, "t", "tiny", temperature, None)
        assert_close(s.values, expected_values(model, r, temperature))
    (letter,) = await stored(bus, "DEAD", events.DeadLetter)
    assert letter.consumer == "teacher-tr-t" and letter.original_subject.startswith("rollouts.tr.reverse_text.")
    assert "rollout malformed: its token layer is inconsistent" in letter.reason and "2 token ids" in letter.reason


async def test_a_signal_over_the_servers_max_payload_becomes_an_error_signal_and_the_host_goes_on(
        tmp_path: Path, tiny_model_dir: Path, tiny: tuple[Any, Any]) -> None:
    """A teacher's top 256 over a multi-turn rollout is larger than this server takes: publishing
    it would cost the host its connection. Its signal says so instead, naming top_k; the next
    run's signal (no top-k) still arrives whole on the same connection."""
    _, tok = tiny
    big = [multi_turn(tok, PROMPT, seed=i, rollout_id=f"big{i}", run="big") for i in range(2)]
    small = multi_turn(tok, PROMPT, seed=2, rollout_id="small", run="small")
    max_payload = 16 * 1024
    sampled = sum(sum(n.tokens.loss_mask) for n in big[0].nodes if n.tokens is not None)
    assert len(msgspec.msgpack.encode(big[0])) < max_payload < sampled * 256 * 4  # 4 bytes a top logprob at least
    server = NatsServer(tmp_path / "nats", max_payload=max_payload).start()
    bus = await Bus.connect(server.url, name="test")
    try:
        assert bus.nc.max_payload == max_payload
        top = {"type": "opd", "teacher": "t", "estimate": "forward_top_k", "top_k": 256}
        for run, advantage in (("big", top), ("small", {"type": "opd", "teacher": "t"})):
            cfg = RunConfig(run=run, env="reverse_text", trainer={"advantage": advantage},
                            teachers={"t": {"model": "tiny"}})
            await register_run(bus, run, config=cfg.model_dump())
        async with hosting(server.url, data_dir_of(tiny_model_dir)) as host:
            await bus.publish_many(big, events.MSGPACK)
            await until(lambda: _is(bus, "SIGNALS", 2), timeout_s=60, what="the big run's error signals")
            await bus.publish(small, events.MSGPACK)
            await until(lambda: _is(bus, "SIGNALS", 3), timeout_s=60, what="the small run's signal")
            assert host.info["teachers"]["big"]["t"]["num_errors"] == 2
        signals = {s.rollout_id: s for s in await stored(bus, "SIGNALS", events.Signal)}
        for r in big:
            error = signals[r.id].error
            assert error is not None and f"more than the bus takes ({max_payload}, nats-server's max_payload)" in error
            assert "lower the top_k of the part that reads it (256 now)" in error and not signals[r.id].values
        assert signals["small"].error is None and signals["small"].values
        assert await count(bus, "DEAD") == 0
    finally:
        await bus.close()
        server.stop()


async def _is(bus: Bus, stream: str, n: int) -> bool:
    return await count(bus, stream) == n


def perturbed(model_dir: Path, seed: int) -> tuple[Any, bytes]:
    """The tiny model with its weights moved at random (the policy after some training), and its blob."""
    model, _ = models.load_model(model_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return model, models.save_weights(model)


async def publish_weights(bus: Bus, run: str, version: int, data: bytes) -> None:
    uri, sha256, size_bytes = await weights.put(bus, run, version, data)
    await bus.publish(events.WeightUpdate(run=run, version=version, uri=uri, sha256=sha256, size_bytes=size_bytes))


async def test_policy_teachers_wait_for_their_version_then_pin_it_or_follow_the_newest(
        bus: Bus, nats_server: NatsServer, tiny_model_dir: Path, tiny: tuple[Any, Any],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="flywheel_inference.teacher")
    _, tok = tiny
    cfg = RunConfig(run="pol", env="reverse_text", trainer={"advantage": {"type": "opd", "teacher": "live"},
                                                            "kl": {"teacher": "ref"}},
                    teachers={"ref": {"model": "policy", "version": 0}, "live": {"model": "policy"}})
    await register_run(bus, "pol", config=cfg.model_dump())
    first = [multi_turn(tok, PROMPT, seed=i, rollout_id=f"a{i}", run="pol") for i in range(2)]
    v0, v0_blob = perturbed(tiny_model_dir, 0)
    v1, v1_blob = perturbed(tiny_model_dir, 1)
    async with hosting(nats_server.url, data_dir_of(tiny_model_dir)) as host:
        await bus.publish_many(first, events.MSGPACK)
        await until(lambda: "waits for weights version 0 of run 'pol', not published yet" in caplog.text
                    and "waits for the first weights of run 'pol'" in caplog.text, what="both teachers to say so")
        assert await count(bus, "SIGNALS") == 0
        await publish_weights(bus, "pol", 0, v0_blob)
        await until(lambda: _is(bus, "SIGNALS", 4), timeout_s=30, what="both teachers' signals of version 0")
        await publish_weights(bus, "pol", 1, v1_blob)
        await until(lambda: _seen(host, "pol", 1), what="version 1 to be seen")
        second = [multi_turn(tok, PROMPT, seed=10 + i, rollout_id=f"b{i}", run="pol") for i in range(2)]
        await bus.publish_many(second, events.MSGPACK)
        await until(lambda: _is(bus, "SIGNALS", 8), timeout_s=30, what="both teachers' signals of the second two")

    signals = {s.id: s for s in await stored(bus, "SIGNALS", events.Signal)}
    for r in first:
        assert signals[f"{r.id}.ref"].model == signals[f"{r.id}.live"].model == "pol@v0"
        assert_close(signals[f"{r.id}.ref"].values, expected_values(v0, r, 0.7))
        assert_close(signals[f"{r.id}.live"].values, expected_values(v0, r, 0.7))
    for r in second:  # the pinned teacher stays on version 0; the other follows the run to version 1
        assert (signals[f"{r.id}.ref"].model, signals[f"{r.id}.live"].model) == ("pol@v0", "pol@v1")
        assert_close(signals[f"{r.id}.ref"].values, expected_values(v0, r, 0.7))
        assert_close(signals[f"{r.id}.live"].values, expected_values(v1, r, 0.7))


async def _expires(bus: Bus, durable: str) -> bool:
    """Whether ``durable`` on ROLLOUTS is set to go LET_GO_S after its last pull, or gone."""
    try:
        info = await bus.js.consumer_info("ROLLOUTS", durable)
    except nats.js.errors.NotFoundError:
        return True
    return info.config.inactive_threshold == LET_GO_S


def _seen(host: TeacherHost, run: str, version: int) -> bool:
    """Whether the host's watch of the run's weights has seen ``version``."""
    hosted = host._hosted[run]  # the one way to know the watch caught up, without a sleep
    return any(t.weights is not None and version in t.weights.updates for t in hosted.teachers)


async def test_a_pinned_version_gone_from_the_bucket_gives_error_signals_naming_it(
        bus: Bus, nats_server: NatsServer, tiny_model_dir: Path, tiny: tuple[Any, Any]) -> None:
    _, tok = tiny
    cfg = RunConfig(run="gone", env="reverse_text", trainer={"kl": {"teacher": "ref"}},
                    teachers={"ref": {"model": "policy", "version": 0}})
    await register_run(bus, "gone", config=cfg.model_dump())
    _, blob = perturbed(tiny_model_dir, 0)
    await publish_weights(bus, "gone", 0, blob)
    await publish_weights(bus, "gone", 1, blob)
    assert await weights.delete(bus, "gone", 0)  # the trainer keeps only its newest versions
    async with hosting(nats_server.url, data_dir_of(tiny_model_dir)):
        await bus.publish(multi_turn(tok, PROMPT, rollout_id="late", run="gone"), events.MSGPACK)
        await until(lambda: _is(bus, "SIGNALS", 1), timeout_s=30, what="the rollout's signal")
    (s,) = await stored(bus, "SIGNALS", events.Signal)
    assert s.values == {} and s.error is not None and s.model == "gone@v0"
    assert "weights version 0 of run 'gone' cannot be loaded" in s.error


class Inference:
    """``python -m flywheel_inference`` on the test's nats-server, its output in a log file."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.env = env
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        with self.log_path.open("w") as out:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "flywheel_inference", cwd=REPO, stdout=out, stderr=asyncio.subprocess.STDOUT,
                env=self.env | {"FLYWHEEL_INFERENCE_PORT": str(free_port())})

    def alive(self) -> bool:
        assert self.proc is not None and self.proc.returncode is None, self.log_path.read_text()[-3000:]
        return True

    async def stop(self, sig: int) -> None:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
        await asyncio.wait_for(self.proc.wait(), 30)


@pytest.mark.long
async def test_every_rollout_gets_exactly_one_signal_across_a_sigkill_of_the_inference_process(
        bus: Bus, nats_server: NatsServer, tiny_model_dir: Path, tiny: tuple[Any, Any], tmp_path: Path) -> None:
    _, tok = tiny
    num_rollouts = 200
    cfg = RunConfig(run="kill", env="reverse_text", trainer={"advantage": {"type": "opd", "teacher": "t"}},
                    teachers={"t": {"model": "tiny", "max_batch_size": 2}})
    await register_run(bus, "kill", config=cfg.model_dump())
    rollouts = [multi_turn(tok, PROMPT, seed=i, rollout_id=f"k{i}", run="kill") for i in range(num_rollouts)]
    await bus.publish_many(rollouts, events.MSGPACK)
    # Two rollouts a batch, so the kill comes between batches; what the killed process held is
    # delivered again after the ack wait (1 s).
    env = os.environ | {"FLYWHEEL_NATS_URL": nats_server.url, "FLYWHEEL_DATA_DIR": str(data_dir_of(tiny_model_dir)),
                        "FLYWHEEL_INFERENCE__TEACHER_BATCH_SIZE": "2", "FLYWHEEL_INFERENCE__ACK_WAIT_S": "1"}
    first, second = Inference(env, tmp_path / "first.log"), Inference(env, tmp_path / "second.log")
    try:
        await first.start()

        async def a_quarter() -> bool:
            return first.alive() and await count(bus, "SIGNALS") >= num_rollouts // 4

        await until(a_quarter, timeout_s=60, what="a quarter of the signals")
        await first.stop(signal.SIGKILL)
        assert await count(bus, "SIGNALS") < num_rollouts, "all were valued before the kill: queue more rollouts"

        await second.start()

        async def all_acked() -> bool:
            info = await bus.js.consumer_info("ROLLOUTS", "teacher-kill-t")
            return second.alive() and info.num_pending == 0 and info.num_ack_pending == 0

        await until(all_acked, timeout_s=120, what="every rollout valued and acked")
        await second.stop(signal.SIGTERM)
    finally:
        for inference in (first, second):
            if inference.proc is not None and inference.proc.returncode is None:
                inference.proc.kill()
                await inference.proc.wait()
    signals = await stored(bus, "SIGNALS", events.Signal)
    ids = [s.id for s in signals]
    assert len(ids) == len(set(ids)) == num_rollouts, second.log_path.read_text()[-3000:]
    assert {s.rollout_id for s in signals} == {r.id for r in rollouts}
    assert all(s.error is None and s.values for s in signals)
