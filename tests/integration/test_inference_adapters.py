"""LoRA runs on one base model in one inference worker, against a real nats-server: they share
one loaded copy of the base, every rollout is sampled with its own run's adapter (checked
token by token against each run's peft model), a new adapter version of one run leaves the
other's alone, and an ended run's adapter is evicted while the other run goes on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from flywheel.contract import events
from flywheel.contract.bus import Bus
from flywheel_inference import hosting
from tests.backend_checks import full_forward_logprobs
from tests.helpers import random_adapter, until
from tests.integration.services import Workers
from tests.integration.test_inference_worker import count_is, create_run, publish_weights, stored

TARGETS = ["q_proj", "v_proj", "up_proj"]
ADAPTER = {"rank": 4, "alpha": 8, "target_modules": TARGETS}


def adapted(model_dir: Path, seed: int) -> torch.nn.Module:
    return random_adapter(model_dir, 4, TARGETS, seed)


def sampled_with(rollout: events.Rollout, model: torch.nn.Module, temperature: float) -> bool:
    """Whether ``model`` gives the logprobs recorded for the rollout's sampled tokens."""
    span = rollout.nodes[-1].tokens
    assert span is not None
    prompt = [t for t, m in zip(span.token_ids, span.loss_mask, strict=True) if not m]
    head = [t for n in rollout.nodes[:-1] if n.tokens is not None for t in n.tokens.token_ids]
    completion = span.token_ids[len(prompt):]
    recorded = torch.tensor(span.logprobs[len(prompt):])
    expected = full_forward_logprobs(model, head + prompt, completion, temperature)
    return bool(torch.allclose(expected, recorded, atol=1e-4))


def tasks(run: str, n: int, tag: str = "") -> list[events.Task]:
    return [events.Task(id=f"{run}-{tag}{i}", run=run, env="reverse_text", data={"text": "abcdef"[: 2 + i % 4]},
                        num_rollouts=4) for i in range(n)]


async def test_two_lora_runs_share_one_base_and_each_samples_with_its_own_adapter(
        bus: Bus, tiny_model_dir: Path, start_worker: Workers, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hosting, "EVICT_IDLE_S", 0.0)
    overrides: dict[str, Any] = {"trainer": {"batch_size": 8, "max_off_policy_steps": 4, "adapter": ADAPTER},
                                 "sampling": {"max_tokens": 8, "temperature": 1.0}}
    cfg_a = await create_run(bus, tiny_model_dir, "ra", **overrides)
    await create_run(bus, tiny_model_dir, "rb", **overrides)
    model_a, model_b, model_a1 = adapted(tiny_model_dir, 1), adapted(tiny_model_dir, 2), adapted(tiny_model_dir, 3)
    await publish_weights(bus, "ra", 0, model_a)
    await publish_weights(bus, "rb", 0, model_b)
    worker = await start_worker()
    await bus.publish_many([t for pair in zip(tasks("ra", 2), tasks("rb", 2), strict=True) for t in pair])
    await until(lambda: count_is(bus, "ROLLOUTS", 16), timeout_s=60, what="16 rollouts of the two runs")

    (base,) = worker.info["shared_bases"]
    assert base["model"] == str(tiny_model_dir) and base["adapters"] == ["ra", "rb"] and base["adapter_bytes"] > 0
    assert worker.hosting.runs["ra"].policy.backend.base is worker.hosting.runs["rb"].policy.backend.base  # type: ignore[attr-defined]
    rollouts: list[events.Rollout] = await stored(bus, "ROLLOUTS", events.Rollout)
    for r in rollouts:
        own, other = (model_a, model_b) if r.run == "ra" else (model_b, model_a)
        assert r.status != "error" and r.policy_version == 0, r
        assert sampled_with(r, own, 1.0) and not sampled_with(r, other, 1.0), (r.run, r.id)

    # A new adapter for ra: its next rollouts use it; rb's stay on its own version 0.
    await publish_weights(bus, "ra", 1, model_a1)
    await until(lambda: worker.info["runs"]["ra"]["policy_version"] == 1, what="ra's version 1 loaded")
    await bus.publish_many([t for pair in zip(tasks("ra", 2, "v1-"), tasks("rb", 2, "v1-"), strict=True)
                            for t in pair])
    await until(lambda: count_is(bus, "ROLLOUTS", 32), timeout_s=60, what="16 more rollouts")
    later = [r for r in await stored(bus, "ROLLOUTS", events.Rollout) if "v1-" in r.task_id]
    for r in later:
        own = model_a1 if r.run == "ra" else model_b
        assert r.policy_version == (1 if r.run == "ra" else 0)
        assert sampled_with(r, own, 1.0), (r.run, r.id)

    # ra ends: its adapter leaves the base; rb goes on with its own.
    finished = events.RunState(id="ra", status="finished", config=cfg_a.model_dump())
    await (await bus.runs_kv()).put("ra", events.encode(finished))
    await until(lambda: [b["adapters"] for b in worker.info["shared_bases"]] == [["rb"]], timeout_s=15,
                what="ra's adapter evicted")
    await bus.publish_many(tasks("rb", 1, "after-"))
    await until(lambda: count_is(bus, "ROLLOUTS", 36), timeout_s=60, what="rb's rollouts after ra ended")
    after = [r for r in await stored(bus, "ROLLOUTS", events.Rollout) if "after-" in r.task_id]
    assert all(sampled_with(r, model_b, 1.0) and r.status != "error" for r in after)
