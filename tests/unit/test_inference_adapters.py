"""Many LoRA adapters over one base in the transformers backend: each row of a batch is
sampled with its own adapter, exactly as the adapted model alone (the trainer's peft model)
would sample it; evicting one leaves the others; a blob that does not fit is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flywheel.contract import events
from flywheel.sdk import models
from flywheel_inference.adapters import AdapterView
from flywheel_inference.backends import TransformersBackend
from tests.backend_checks import PROMPTS, full_forward_logprobs
from tests.helpers import random_adapter

TARGETS = ["q_proj", "v_proj", "down_proj"]
Blobs = dict[str, tuple[bytes, torch.nn.Module]]  # name -> (adapter blob, the peft model it came from)


def adapter_blob(model_dir: Path, seed: int, targets: list[str] = TARGETS,
                 rank: int = 4) -> tuple[bytes, torch.nn.Module]:
    """A random adapter over the tiny model and the peft model it came from."""
    model = random_adapter(model_dir, rank, targets, seed)
    return models.save_weights(model), model


@pytest.fixture(scope="module")
def blobs(tiny_model_dir: Path) -> Blobs:
    return {"a": adapter_blob(tiny_model_dir, 1), "b": adapter_blob(tiny_model_dir, 2, ["o_proj", "up_proj"], 8)}


@pytest.mark.parametrize("interleaved", [False, True], ids=["rows-by-adapter", "rows-interleaved"])
def test_each_row_samples_with_its_own_adapter_as_the_adapted_model_alone(tiny_model_dir: Path, blobs: Blobs,
                                                                          interleaved: bool) -> None:
    shared = TransformersBackend.build(tiny_model_dir, "float32")
    for name, (blob, _) in blobs.items():
        shared.adapters.load(name, blob)
    sampling = events.Sampling(temperature=0.8, max_tokens=10, seed=5)
    # Every prompt under every adapter and the base, in one batch: each adapter's rows one
    # after another (a slice of the batch each) or interleaved (an index each).
    prompts = [PROMPTS[(i // 3 if interleaved else i) % 3] for i in range(9)]
    names: list[str | None] = [["a", "b", None][i % 3 if interleaved else i // 3] for i in range(9)]
    mixed = shared.generate(prompts, sampling, adapters=names)
    for kept in ("a", "b", None):
        rows = [i for i, n in enumerate(names) if n == kept]
        alone = TransformersBackend.build(tiny_model_dir, "float32")
        if kept is not None:
            alone.swap(blobs[kept][0], 1)  # merged into the weights
        out = alone.generate([prompts[i] for i in rows], sampling, seeds=[5 + i for i in rows])
        assert [c.token_ids for c in out] == [mixed[i].token_ids for i in rows], kept
    # The logprobs are the peft model's (the trainer's) for every row.
    for i, row_adapter in enumerate(names):
        model = blobs[row_adapter][1] if row_adapter is not None else shared.model
        expected = full_forward_logprobs(model, prompts[i], mixed[i].token_ids, 0.8)
        assert torch.allclose(expected, torch.tensor(mixed[i].logprobs), atol=1e-4), (i, row_adapter)


def test_a_view_swaps_its_adapter_alone_and_evicting_it_leaves_the_others(tiny_model_dir: Path,
                                                                          blobs: Blobs) -> None:
    shared = TransformersBackend.build(tiny_model_dir, "float32")
    run_a, run_b = AdapterView(shared, "run-a"), AdapterView(shared, "run-b")
    sampling = events.Sampling(max_tokens=8, seed=3)
    base = [c.token_ids for c in shared.generate(PROMPTS, sampling)]
    run_a.swap(blobs["a"][0], 0)
    run_b.swap(blobs["b"][0], 4)
    assert (run_a.version, run_b.version) == (0, 4)
    with_a = [c.token_ids for c in run_a.generate(PROMPTS, sampling)]
    with_b = [c.token_ids for c in run_b.generate(PROMPTS, sampling)]
    assert with_a != base and with_b != base and with_a != with_b
    run_a.close()
    assert [c.token_ids for c in run_b.generate(PROMPTS, sampling)] == with_b
    assert [c.token_ids for c in shared.generate(PROMPTS, sampling)] == base  # the base is untouched
    with pytest.raises(KeyError, match="adapter 'run-a' is not loaded"):
        run_a.generate(PROMPTS, sampling)
    # A blob of full weights, or of another shape, is refused naming what is wrong; b stays.
    with pytest.raises(ValueError, match="full model weights, not a LoRA adapter"):
        run_b.swap(models.save_weights(shared.model), 5)
    with pytest.raises(ValueError, match=r"does not fit the base model: model\.layers\.\d\.self_attn\.o_proj"):
        shared.adapters.load("wrong", _narrow_adapter(models.load_model(tiny_model_dir)[0]))
    assert run_b.version == 4
    assert [c.token_ids for c in run_b.generate(PROMPTS, sampling)] == with_b



def test_a_new_version_of_an_adapter_replaces_the_old_one_in_place_or_not(tiny_model_dir: Path, blobs: Blobs) -> None:
    """A new version of the same shapes is written into the old one's tensors; one that adapts
    other layers (or another rank) replaces them: either way rows sample as the new version alone."""
    shared = TransformersBackend.build(tiny_model_dir, "float32")
    view = AdapterView(shared, "run")
    sampling = events.Sampling(temperature=0.8, max_tokens=8, seed=2)
    newer = adapter_blob(tiny_model_dir, 7)  # a's layers and rank, other values
    view.swap(blobs["a"][0], 0)
    before = shared.adapters.adapters["run"].layers
    for version, (blob, model) in enumerate([newer, blobs["b"], blobs["a"]], start=1):
        view.swap(blob, version)
        if version == 1:  # same layers and shapes: the same tensors, new values
            after = shared.adapters.adapters["run"].layers
            assert all(after[p][0] is before[p][0] and after[p][1] is before[p][1] for p in before)
        mixed = view.generate(PROMPTS, sampling)
        alone = TransformersBackend.build(tiny_model_dir, "float32")
        alone.swap(blob, 1)
        assert [c.token_ids for c in alone.generate(PROMPTS, sampling)] == [c.token_ids for c in mixed], version
        for prompt, c in zip(PROMPTS, mixed, strict=True):
            expected = full_forward_logprobs(model, prompt, c.token_ids, 0.8)
            assert torch.allclose(expected, torch.tensor(c.logprobs), atol=1e-4), version

def _narrow_adapter(model: torch.nn.Module) -> bytes:
    """An adapter blob whose o_proj layers have the wrong input width."""
    from safetensors.torch import load, save

    blob = models.save_weights(models.add_adapter(model, 4, 8, ["o_proj"]))
    state = {name: (t[:, :-1].contiguous() if name.endswith("lora_A.weight") else t) for name, t in load(blob).items()}
    return save(state, metadata={models.ADAPTER_FORMAT: '{"alpha": 8, "rank": 4, "target_modules": ["o_proj"]}'})
