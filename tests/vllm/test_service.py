"""The inference service on the vLLM backend: a run whose config says ``backend = "vllm"``
is rolled out by the same worker, against a real nats-server, and a weight update reaches
the live engine."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from flywheel.contract import events, weights
from flywheel.contract.bus import Bus, read_stream
from flywheel.contract.config import RunConfig
from flywheel.runtime.natsserver import NatsServer
from flywheel.sdk import models
from tests.helpers import until

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed here: "
                                        "scripts/test.sh --vllm runs this tier in .venv-vllm")]


async def rollouts(bus: Bus) -> list[events.Rollout]:
    return await read_stream(bus, "ROLLOUTS", events.Rollout)  # a group's rollouts are one batch message


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


async def test_two_lora_runs_share_one_vllm_engine_each_with_its_own_adapter(nats_server: NatsServer, bus: Bus,
                                                                             tiny_model_dir: Path,
                                                                             tmp_path: Path) -> None:
    """Two runs that train adapters over the same base, backend vLLM: one engine, both adapters
    in it; every rollout's logprobs are its own run's adapted model's, not the other's; a new
    adapter version of one run leaves the other's alone."""
    import torch

    from flywheel.contract.settings import InferenceSettings
    from flywheel_inference.worker import Worker
    from tests.backend_checks import full_forward_logprobs
    from tests.helpers import random_adapter

    targets = ["q_proj", "v_proj", "up_proj"]
    cfgs = {run: RunConfig.parse({"run": run, "env": "reverse_text", "group_size": 4,
                                  "model": {"name": str(tiny_model_dir)},
                                  "sampling": {"max_tokens": 8, "temperature": 1.0},
                                  "inference": {"backend": "vllm"},
                                  "trainer": {"batch_size": 8, "max_off_policy_steps": 4,
                                              "adapter": {"rank": 4, "alpha": 8, "target_modules": targets}}})
            for run in ("la", "lb")}
    for run, cfg in cfgs.items():
        await (await bus.runs_kv()).put(run, events.encode(events.RunState(id=run, config=cfg.model_dump())))
    adapted = {seed: random_adapter(tiny_model_dir, 4, targets, seed) for seed in (1, 2, 3)}

    async def publish(run: str, version: int, model: torch.nn.Module) -> None:
        uri, sha, size = await weights.put(bus, run, version, models.save_weights(model))
        await bus.publish(events.WeightUpdate(run=run, version=version, uri=uri, sha256=sha, size_bytes=size,
                                              trainer_step=version))

    def logprob_gap(rollout: events.Rollout, model: torch.nn.Module) -> float:
        span = rollout.nodes[-1].tokens
        assert span is not None
        prompt = [t for t, m in zip(span.token_ids, span.loss_mask, strict=True) if not m]
        head = [t for n in rollout.nodes[:-1] if n.tokens is not None for t in n.tokens.token_ids]
        expected = full_forward_logprobs(model, head + prompt, span.token_ids[len(prompt):], 1.0)
        return float((expected - torch.tensor(span.logprobs[len(prompt):])).abs().mean())

    def tasks(tag: str) -> list[events.Task]:
        return [events.Task(id=f"{run}-{tag}{i}", run=run, env="reverse_text", data={"text": "abcdef"[: 2 + i]},
                            num_rollouts=4) for i in range(2) for run in cfgs]

    await publish("la", 0, adapted[1])
    await publish("lb", 0, adapted[2])
    wbus = await Bus.connect(nats_server.url, name="inference")
    worker = Worker.with_backends(wbus, tmp_path / "data", InferenceSettings(backoff_s=(0.5,), max_deliver=50))
    service = worker.service(handle_signals=False)
    running = asyncio.ensure_future(service.run())
    try:
        await bus.publish_many(tasks("v0-"))

        async def count_is(n: int) -> bool:
            return len(await rollouts(bus)) == n

        await until(lambda: count_is(16), timeout_s=240, what="16 rollouts of the two LoRA runs on vLLM")
        (base,) = worker.info["shared_bases"]
        assert base["adapters"] == ["la", "lb"] and base["adapter_bytes"] > 0
        for r in await rollouts(bus):
            own, other = (adapted[1], adapted[2]) if r.run == "la" else (adapted[2], adapted[1])
            assert r.status != "error" and r.policy_version == 0, r
            assert logprob_gap(r, own) <= 1e-3 < 1e-2 <= logprob_gap(r, other), (r.run, r.id)

        await publish("la", 1, adapted[3])
        await until(lambda: worker.info["runs"]["la"]["policy_version"] == 1, what="la's version 1 loaded")
        await bus.publish_many(tasks("v1-"))
        await until(lambda: count_is(32), timeout_s=240, what="16 more rollouts")
        for r in [r for r in await rollouts(bus) if "v1-" in r.task_id]:
            own = adapted[3] if r.run == "la" else adapted[2]
            assert r.policy_version == (1 if r.run == "la" else 0)
            assert logprob_gap(r, own) <= 1e-3, (r.run, r.id)
    finally:
        service.stop()
        await running
        await worker.close()
