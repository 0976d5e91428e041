"""Engines: a checkpoint restores the exact training state; DeepSpeed ZeRO steps like plain torch;
a user's own engine, advantage and loss, named by path in the run config, drive a step.

DeepSpeed runs on CPU in this process with gloo, as a world of one (the rank variables set
here); skipped where the ``deepspeed`` extra is not installed. Its first process group
JIT-builds a shared-memory op (over a minute on a cold cache, seconds after), so the
ZeRO test is marked ``slow``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

from flywheel.contract.config import RunConfig
from flywheel.sdk import models
from flywheel_trainer.engines import DeepSpeedEngine, Engine, TorchEngine, build_engine, with_adapter
from flywheel_trainer.join import Scored
from flywheel_trainer.learner import rl_step
from tests.unit.test_trainer_join import make_rollout

GROUP = [Scored(make_rollout(f"r{i}", "g", prompt=[1, 2, 3, 4, 5], completion=[10 + i, 20 + 2 * i, 30 + i],
                             logprobs=[-5.0, -5.5, -6.0], group_size=4), reward, 0)
         for i, reward in enumerate([1.0, 0.0, 0.5, 0.0])]


def config(engine: str | dict, **trainer: object) -> RunConfig:
    return RunConfig(run="t", env="reverse_text", group_size=4,
                     trainer={"engine": engine, "batch_size": 4, "lr": 1e-2, **trainer})


def build(cfg: RunConfig, model_dir: Path) -> Engine:
    model, _ = models.load_model(model_dir)
    return build_engine(model, cfg.trainer, cfg.model.dtype)


def steps(engine: Engine, cfg: RunConfig, n: int) -> list[dict[str, float]]:
    return [rl_step(engine, [GROUP], 0, cfg, micro_batch_size=3) for _ in range(n)]  # two micro-batches a step


def same_weights(a: bytes, b: bytes, atol: float) -> bool:
    x, y = load(a), load(b)
    return x.keys() == y.keys() and all(torch.allclose(x[k], y[k], atol=atol) for k in x)


def test_torch_engine_resumes_from_its_checkpoint_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = config("torch")
    engine = build(cfg, tiny_model_dir)
    steps(engine, cfg, 2)
    engine.save(tmp_path / "engine")
    steps(engine, cfg, 1)  # Adam moments matter: a fresh optimizer would step differently
    resumed = build(cfg, tiny_model_dir)
    resumed.load(tmp_path / "engine")
    steps(resumed, cfg, 1)
    assert resumed.weights() == engine.weights()


def test_a_lora_engine_trains_the_adapter_alone_and_resumes_from_its_checkpoint_exactly(tiny_model_dir: Path,
                                                                                        tmp_path: Path) -> None:
    cfg = config("torch", adapter={"rank": 4, "alpha": 8})

    def lora() -> Engine:
        model, _ = models.load_model(tiny_model_dir)
        return build_engine(with_adapter(model, cfg.trainer), cfg.trainer, cfg.model.dtype)

    engine = lora()
    before = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    steps(engine, cfg, 2)
    moved = {name for name, p in engine.module.named_parameters() if not torch.equal(p, before[name])}
    assert moved and all(".lora_" in name for name in moved)  # the base stays as it was
    assert models.is_adapter(engine.weights())
    engine.save(tmp_path / "engine")
    steps(engine, cfg, 1)
    resumed = lora()
    resumed.load(tmp_path / "engine")
    steps(resumed, cfg, 1)
    assert resumed.weights() == engine.weights()


@pytest.fixture
def world_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("deepspeed")
    from flywheel.runtime.natsserver import free_port

    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(free_port()))):
        monkeypatch.setenv(name, value)


@pytest.mark.slow  # the first DeepSpeed process group builds a C++ op: over a minute on a cold cache
@pytest.mark.parametrize("stage", [0, 3])
def test_deepspeed_zero_steps_like_torch_and_resumes_from_its_checkpoint(
        world_of_one: None, stage: int, tiny_model_dir: Path, tmp_path: Path) -> None:
    reference_cfg, cfg = config("torch"), config({"type": "deepspeed", "zero_stage": stage})
    reference = build(reference_cfg, tiny_model_dir)
    engine = build(cfg, tiny_model_dir)
    # ZeRO 3 runs the whole head: so does the reference here (the two ways differ by float
    # rounding, which Adam makes a weight difference past this test's bound).
    assert isinstance(reference, TorchEngine) and isinstance(engine, DeepSpeedEngine)
    reference.head_at_loss_positions = engine.head_at_loss_positions
    expected = steps(reference, reference_cfg, 2)
    got = steps(engine, cfg, 2)
    for e, g in zip(expected, got, strict=True):
        assert g["loss"] == pytest.approx(e["loss"], abs=1e-5)
        assert g["grad_norm"] == pytest.approx(e["grad_norm"], rel=1e-4)
    # ZeRO-3 gathers the full weights. Its reductions add in another order, and Adam turns a
    # rounding difference in a near-zero gradient into up to ~1% of a step (lr 1e-2).
    assert same_weights(engine.weights(), reference.weights(), atol=1e-4)

    engine.save(tmp_path / "engine")
    steps(engine, cfg, 1)
    resumed = build(cfg, tiny_model_dir)
    resumed.load(tmp_path / "engine")
    steps(resumed, cfg, 1)
    assert same_weights(resumed.weights(), engine.weights(), atol=1e-6)


USER_PARTS = """
import torch

from flywheel_trainer.engines import TorchEngine
from flywheel_trainer.losses import clipped

CALLS = []

def half_mean(rewards, scale):
    CALLS.append(("advantage", scale))
    mean = sum(rewards) / len(rewards)
    return [scale * (r - mean) for r in rewards]

def tight_clipped(logprobs, old_logprobs, advantages, eps):
    CALLS.append(("loss", eps))
    return clipped(logprobs, old_logprobs, advantages, eps)

class CountingEngine(TorchEngine):
    def __init__(self, model, trainer, dtype, label):
        super().__init__(model, trainer, dtype)
        self.label = label
        self.num_steps = 0

    def step(self):
        self.num_steps += 1
        return super().step()
"""


def test_a_users_advantage_loss_and_engine_by_path_drive_a_step(tiny_model_dir: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "user_trainer_parts.py").write_text(USER_PARTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    trusted = ["user_trainer_parts"]  # the setting trusted_modules: the operator trusts the module
    cfg = RunConfig.parse(config("torch").model_dump() | {"trainer": config("torch").trainer.model_dump() | {
        "engine": {"type": "user_trainer_parts:CountingEngine", "args": {"label": "mine"}},
        "advantage": {"type": "user_trainer_parts:half_mean", "args": {"scale": 0.5}},
        "loss": {"type": "user_trainer_parts:tight_clipped", "args": {"eps": 0.1}}}}, trusted_modules=trusted)
    cfg = RunConfig.parse(cfg.model_dump(), trusted_modules=trusted)  # as a service reads it from the run state
    engine = build(cfg, tiny_model_dir)
    assert isinstance(engine, TorchEngine)
    assert (engine.label, engine.num_steps) == ("mine", 0)  # type: ignore[attr-defined]  # the user's engine's own
    figures = steps(engine, cfg, 1)[0]
    user_trainer_parts = importlib.import_module("user_trainer_parts")  # the module this test wrote
    assert engine.num_steps == 1  # type: ignore[attr-defined]  # the user's engine's own
    assert ("advantage", 0.5) in user_trainer_parts.CALLS and ("loss", 0.1) in user_trainer_parts.CALLS
    assert figures["advantage_abs_mean"] == pytest.approx(0.5 * 0.375)  # half of |r - 0.375| averaged
