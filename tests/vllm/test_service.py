"""The inference service on the vLLM backend: a run whose config says ``backend = "vllm"``
is rolled out by the same worker, against a real nats-server, and a weight update reaches
the live engine."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from flywheel.contract import events, weights
from flywheel.contract.bus import HEADER_CONTENT_TYPE, Bus
from flywheel.contract.config import RunConfig
from flywheel.ops.natsserver import NatsServer
from flywheel.sdk import models
from tests.helpers import until

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed here: "
                                        "scripts/test.sh --vllm runs this tier in .venv-vllm")]


async def rollouts(bus: Bus) -> list[events.Rollout]:
    info = await bus.js.stream_info("ROLLOUTS")
    decoder = events.Decoder(events.Rollout)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages else ():
        msg = await bus.js.get_msg("ROLLOUTS", seq)
        assert msg.data is not None
        out.append(decoder.decode(msg.data, (msg.headers or {}).get(HEADER_CONTENT_TYPE)))
    return out


async def publish_weights(bus: Bus, version: int, data: bytes) -> None:
    uri, sha, size = await weights.put(bus, "v1", version, data)
    await bus.publish(events.WeightUpdate(run="v1", version=version, uri=uri, sha256=sha, size_bytes=size,
                                          trainer_step=version))


async def test_a_vllm_run_is_rolled_out_and_takes_new_weights(nats_server: NatsServer, bus: Bus,
                                                              tiny_model_dir: Path, tmp_path: Path) -> None:
    import torch

    from flywheel.contract.settings import InferenceSettings
    from flywheel_inference.worker import Worker

    cfg = RunConfig.parse({"run": "v1", "env": "reverse_text", "group_size": 4, "model": {"name": str(tiny_model_dir)},
                           "sampling": {"max_tokens": 6, "temperature": 0.7},
                           "inference": {"backend": "vllm"},
                           "trainer": {"batch_size": 8, "max_off_policy_steps": 0}})
    await (await bus.runs_kv()).put("v1", events.encode(events.RunState(id="v1", config=cfg.model_dump())))
    wbus = await Bus.connect(nats_server.url, name="inference")
    worker = Worker.with_backends(wbus, tmp_path / "data", InferenceSettings(backoff_s=(0.5,), max_deliver=50))
    service = worker.service(handle_signals=False)
    running = asyncio.ensure_future(service.run())
    try:
        base, _ = models.load_model(tiny_model_dir)
        await publish_weights(bus, 0, models.save_weights(base))
        seeded = events.Sampling(max_tokens=6, temperature=0.7, seed=3)
        await bus.publish_many([events.Task(id=f"t{i}", run="v1", env="reverse_text", data={"text": "abcd"},
                                            num_rollouts=4, sampling=seeded) for i in range(4)])

        async def count_is(n: int) -> bool:
            return len(await rollouts(bus)) == n

        await until(lambda: count_is(8), timeout_s=180, what="two groups sampled by the vLLM engine")
        with torch.no_grad():
            for p in base.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
        await publish_weights(bus, 1, models.save_weights(base))
        await until(lambda: count_is(16), timeout_s=120, what="the other two groups, after version 1")
        by_version: dict[int, list[events.Rollout]] = {}
        for r in await rollouts(bus):
            answer = r.nodes[-1].tokens
            assert answer is not None
            assert answer.policy_version == r.policy_version and len(answer.logprobs) == len(answer.token_ids)
            # The assistant node: the generation prompt (not trained), then the sampled tokens.
            n = sum(answer.loss_mask)
            assert n >= 1 and answer.loss_mask == [False] * (len(answer.token_ids) - n) + [True] * n
            assert all(lp <= 0.0 for lp in answer.logprobs[-n:])
            by_version.setdefault(r.policy_version, []).append(r)
        assert sorted(by_version) == [0, 1] and len(by_version[0]) == len(by_version[1]) == 8
        # Same prompt, same seeds: what differs between the versions is the weights.
        def sampled(r: events.Rollout) -> tuple[int, ...]:
            span = r.nodes[-1].tokens
            assert span is not None
            return tuple(t for t, m in zip(span.token_ids, span.loss_mask, strict=True) if m)

        tokens = {v: sorted(sampled(r) for r in rs) for v, rs in by_version.items()}
        assert tokens[0] != tokens[1]
    finally:
        service.stop()
        await running
        await worker.close()
