"""Data-parallel trainer ranks: a step on two ranks is the step on one rank with the same
global batch.

Each case runs this file as a script under torch's launcher (``python -m torch.distributed.run
--standalone --nproc-per-node N``), on CPU with gloo, once with one rank and once with two:
three RL steps on the same two groups (three micro-batches a step, so one rank backpropagates
two and the other one, then an idle pass), then rank 0 writes the weights and figures. The
weights must agree within 2e-5 and the step figures (summed over ranks) within float
rounding. The ranks add the micro-batches' gradients in another order, and Adam divides each
gradient by its own running scale, so a rounding difference in a near-zero gradient becomes
a fraction of a step: the learning rate here (1e-3) keeps a step near the tolerance's scale
(at 1e-2 the weights differ by 2e-5; ZeRO 2's bucketed reduction, summing in an order of
its own, gave 1.16e-5 at 1e-3 on one machine and under 1e-5 on another). DeepSpeed ZeRO 0-3
are ``slow``: the first DeepSpeed process group JIT-builds a C++ op (over a minute on a cold
cache).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
ATOL = 2e-5


def launch(engine: str | dict, num_ranks: int, model_dir: Path, out: Path) -> tuple[bytes, list[dict[str, float]]]:
    """Run :func:`main` on ``num_ranks`` ranks; rank 0's weights and step figures."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={num_ranks}",
            __file__, json.dumps(engine), str(model_dir), str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return out.read_bytes(), json.loads(out.with_suffix(".json").read_text())


def compare(engine: str | dict, model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load

    one, one_figures = launch(engine, 1, model_dir, tmp_path / "one.safetensors")
    two, two_figures = launch(engine, 2, model_dir, tmp_path / "two.safetensors")
    a, b = load(one), load(two)
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= ATOL, f"weights differ by up to {worst:.2e} after 3 steps"
    moved = max(float((a[k] - load((tmp_path / "one.safetensors.start").read_bytes())[k]).abs().max()) for k in a)
    assert moved > 50 * ATOL  # the steps changed the weights: equal weights say something
    for e, g in zip(one_figures, two_figures, strict=True):
        for key in ("loss", "grad_norm", "clip_fraction", "logprob_diff_abs_mean", "num_loss_tokens"):
            assert g[key] == pytest.approx(e[key], rel=1e-4, abs=1e-6), key


@pytest.mark.long
def test_two_torch_ranks_step_like_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    compare("torch", tiny_model_dir, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_deepspeed_ranks_step_like_one(stage: int, tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    compare({"type": "deepspeed", "zero_stage": stage}, tiny_model_dir, tmp_path)


def main(engine: str | dict, model_dir: Path, out: Path) -> None:
    """One rank's part: three RL steps on the same global batch, then rank 0 writes the weights."""
    from flywheel.contract.config import RunConfig
    from flywheel.sdk import models
    from flywheel_trainer import ranks
    from flywheel_trainer.engines import build_engine
    from flywheel_trainer.join import Scored
    from flywheel_trainer.learner import rl_step
    from tests.unit.test_trainer_join import make_rollout

    team = ranks.start()
    groups = [[Scored(make_rollout(f"{g}-{i}", f"g{g}", prompt=[1, 2, 3 + g, 4, 5],
                                   completion=[10 + i + g, 20 + 2 * i, 30 + i, 7][:3 + (i + g) % 2],
                                   logprobs=[-5.0, -5.5, -6.0, -4.0][:3 + (i + g) % 2], group_size=4), reward, 0)
               for i, reward in enumerate([1.0, 0.0, 0.5, 0.0 + g / 4])] for g in range(2)]
    cfg = RunConfig(run="t", env="reverse_text", group_size=4, seed=1,
                    trainer={"engine": engine, "batch_size": 8, "lr": 1e-3})
    model, _ = models.load_model(model_dir)
    engine_ = build_engine(model, cfg.trainer, cfg.model.dtype)
    start = engine_.weights()
    figures = [rl_step(engine_, groups, 0, cfg, micro_batch_size=3) for _ in range(3)]
    data = engine_.weights()
    if team.leader:
        out.write_bytes(data)
        Path(f"{out}.start").write_bytes(start)
        out.with_suffix(".json").write_text(json.dumps(figures))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
