"""A hostile environment inside a training run cannot get out of its environment workers.

tests/envs/escape_env.py's program harness (run for its rollout in a sandbox of its own) and its
reward (in the scorer's worker) each try to read a credential from their environment or from the
data dir, to connect to nats-server and another service on 127.0.0.1 and [::1], to find another
rollout's files, to write outside their workdir. Real processes: a nats-server, the inference
worker and a scorer in this process, their environment workers in bubblewrap. Every attempt is
refused, the rollouts and their scores still come (the environment's own results), and the
services go on serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sysconfig
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from flywheel.contract import events
from flywheel.contract.bus import Bus
from flywheel.contract.settings import ScorerSettings, WorkersSettings
from flywheel.runtime.environments import WorkerPool
from flywheel.runtime.natsserver import NatsServer
from flywheel.sdk import models
from flywheel_scorer import scorer
from flywheel_scorer.scorer import EnvironmentRewards
from tests.helpers import until
from tests.integration.conftest import ENVS
from tests.integration.services import Workers
from tests.integration.test_inference_worker import count_is, create_run, publish_weights, stored


@contextlib.asynccontextmanager
async def listening(host: str) -> AsyncIterator[int]:
    """A service on ``host`` that answers whoever connects (the port)."""
    server = await asyncio.start_server(lambda r, w: w.close(), host, 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


def has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


async def test_a_hostile_harness_and_reward_stay_inside_their_workers(
        bus: Bus, nats_server: NatsServer, tiny_model_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ENVS))
    # What a service holds: its NATS login in its environment, the stack's passwords in the data dir.
    monkeypatch.setenv("FLYWHEEL_NATS_PASSWORD", "hunter2")
    monkeypatch.setenv("NATS_OPERATOR_PASSWORD", "hunter3")
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    users = data_dir / "nats-users.json"
    users.write_text('{"operator": "hunter3"}')
    nats_port = int(nats_server.url.rsplit(":", 1)[1])
    async with contextlib.AsyncExitStack() as stack:
        other = await stack.enter_async_context(listening("127.0.0.1"))
        listeners = [["127.0.0.1", nats_port], ["127.0.0.1", other]]
        if has_ipv6():
            listeners.append(["::1", await stack.enter_async_context(listening("::1"))])
        task = {"text": "t", "secret_files": [str(users)], "listeners": listeners,
                "writable_elsewhere": [str(ENVS), sysconfig.get_path("purelib"), str(data_dir)]}

        await create_run(bus, tiny_model_dir, env="escape_env", group_size=2, sampling={"max_tokens": 2})
        start_inference = Workers(nats_server.url, data_dir)
        inference = await start_inference()
        try:
            await publish_weights(bus, "r1", 0, models.load_model(tiny_model_dir)[0])
            pool = WorkerPool(WorkersSettings(), data_dir, name="scorer")
            rewards = EnvironmentRewards()
            await rewards.start(bus, pool)
            partitions, _ = scorer.build(bus, rewards, ScorerSettings(max_in_flight=8))
            scoring = asyncio.ensure_future(partitions.run())
            try:
                await bus.publish(events.Task(id="hostile", run="r1", env="escape_env", data=task, num_rollouts=2))
                await until(lambda: count_is(bus, "ROLLOUTS", 2), timeout_s=120, what="the hostile group's rollouts")
                await until(lambda: count_is(bus, "SCORES", 2), timeout_s=60, what="their scores")
                # The services go on: another group of the same run comes as the first did.
                await bus.publish(events.Task(id="after", run="r1", env="escape_env", data=task | {"text": "u"},
                                              num_rollouts=2))
                await until(lambda: count_is(bus, "ROLLOUTS", 4), timeout_s=120, what="the next group's rollouts")
            finally:
                partitions.stop()
                await scoring
                await pool.close()
        finally:
            await start_inference.stop(inference)

    rollouts: list[events.Rollout] = await stored(bus, "ROLLOUTS", events.Rollout)
    assert len(rollouts) == 4
    for r in rollouts:
        assert r.status in ("completed", "truncated"), (r.error, r.state.get("stdout"))  # 2 tokens: cut
        assert r.state["called"] is True  # its one way out, its model endpoint, works
        escaped = {name: outcome for name, outcome in r.state["probes"].items() if not outcome.startswith("blocked")}
        assert not escaped, escaped
        assert len(r.state["probes"]) >= 10, r.state["probes"]
    scores: list[events.Score] = await stored(bus, "SCORES", events.Score)
    assert {s.rollout_id for s in scores} >= {r.id for r in rollouts[:2]}
    for s in scores:
        assert s.error is None and s.value == 0.0, (s.error, s.components)
        assert len(s.components) >= 9 and not any(s.components.values()), s.components
    assert users.read_text() == '{"operator": "hunter3"}' and not list(data_dir.glob("escaped-*"))
    assert not list(ENVS.glob("escaped-*")) and not list(Path(sysconfig.get_path("purelib")).glob("escaped-*"))
