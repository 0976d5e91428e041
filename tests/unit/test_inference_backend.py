"""The transformers backend's sampling loop on the tiny model: shapes, the logprob
definition, seeds, top-p, stop strings, max_tokens and EOS, weight swaps; the registry
agrees with the run config's backend variants, and a user's backend by path is built."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from flywheel.contract import events
from flywheel.contract.config import BY_PATH, BackendPart, InferenceConfig, RunConfig, variants
from flywheel.sdk import models
from flywheel_inference.backends import (
    BACKENDS,
    NUCLEUS_CANDIDATES,
    TransformersBackend,
    _trim_padding,
    build_backend,
    sample_rows,
)
from flywheel_inference.completion import Backend
from tests.backend_checks import (
    PROMPTS,
    check_one_completion_per_prompt,
    check_tokens_are_called_back_as_sampled,
    full_forward_logprobs,
)


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> TransformersBackend:
    return TransformersBackend.build(tiny_model_dir, "float32")


def test_one_completion_per_prompt_with_aligned_logprobs(backend: TransformersBackend) -> None:
    check_one_completion_per_prompt(backend)


def test_tokens_are_called_back_as_they_are_sampled(backend: TransformersBackend) -> None:
    check_tokens_are_called_back_as_sampled(backend)


def test_logprobs_match_an_unpadded_full_forward(backend: TransformersBackend) -> None:
    sampling = events.Sampling(temperature=0.7, top_p=0.8, max_tokens=16, seed=3)
    out = backend.generate(PROMPTS, sampling)
    diffs = torch.cat([
        (full_forward_logprobs(backend.model, p, c.token_ids, 0.7) - torch.tensor(c.logprobs)).abs()
        for p, c in zip(PROMPTS, out, strict=True)])
    assert diffs.mean().item() <= 1e-4, diffs.max()


def test_a_seed_reproduces_a_row_whatever_else_is_in_its_batch(backend: TransformersBackend) -> None:
    sampling = events.Sampling(max_tokens=12, seed=11)
    first = backend.generate(PROMPTS, sampling)
    assert [c.token_ids for c in backend.generate(PROMPTS, sampling)] == [c.token_ids for c in first]
    alone = backend.generate([PROMPTS[1]], sampling, seeds=[12])  # row 1 was seeded 11 + 1
    assert alone[0].token_ids == first[1].token_ids
    other = backend.generate(PROMPTS, events.Sampling(max_tokens=12, seed=99))
    assert [c.token_ids for c in other] != [c.token_ids for c in first]


def test_samples_of_one_prompt_share_its_prefill_and_sample_as_if_alone(backend: TransformersBackend) -> None:
    # A group: four samples of each prompt, interleaved, the way rollouts of several tasks batch.
    prompts = [PROMPTS[i % 3] for i in range(12)]
    sampling = events.Sampling(temperature=0.9, max_tokens=10, seed=21)
    group = backend.generate(prompts, sampling)
    assert len({tuple(c.token_ids) for c in group}) > 3  # the samples of one prompt differ
    for i, (prompt, c) in enumerate(zip(prompts, group, strict=True)):
        (alone,) = backend.generate([prompt], sampling, seeds=[21 + i])
        assert c.token_ids == alone.token_ids
        assert c.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
        expected = full_forward_logprobs(backend.model, prompt, c.token_ids, 0.9)
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4)


def test_rows_that_join_a_running_batch_sample_as_if_alone(backend: TransformersBackend) -> None:
    """Continuous batching: a row that joins after others have sampled some tokens (its prompt
    shorter or longer than theirs, so one side is left-padded), and rows that leave early,
    sample what they would alone, within float rounding, and their logprobs are the full
    forward's."""
    sampling = events.Sampling(temperature=0.9, max_tokens=10, seed=5)
    alone = [backend.generate([p], sampling, seeds=[40 + i])[0] for i, p in enumerate(PROMPTS)]
    session = backend.session(sampling)
    got: dict[int, list[int]] = {}
    session.add(PROMPTS[:1], seeds=[40])
    for _ in range(3):  # the first row runs a few tokens alone
        got.update((i, c.token_ids) for i, c in session.step())
    session.add(PROMPTS[1:], seeds=[40 + i for i in range(1, len(PROMPTS))])
    while session.num_rows:
        for i, c in session.step():
            got[i] = c.token_ids
            assert torch.allclose(full_forward_logprobs(backend.model, PROMPTS[i], c.token_ids, 0.9),
                                  torch.tensor(c.logprobs), atol=1e-4)
    assert [got[i] for i in range(len(PROMPTS))] == [c.token_ids for c in alone]
    assert session.cache is None  # every row left: the batch's cache is dropped


def test_a_batch_keeps_no_padding_its_rows_do_not_need(backend: TransformersBackend) -> None:
    """A short prompt joins a long one (left-padded to its length); once the long row is gone,
    the padding only it needed is cut from the cache."""
    session = backend.session(events.Sampling(max_tokens=8, seed=1))
    long_prompt, short_prompt = list(range(3, 40)), [5, 6, 7]
    session.add([long_prompt])
    session.add([short_prompt])
    assert session.cache is not None and session.mask is not None
    assert session.mask.shape[1] == len(long_prompt)
    short_row = torch.tensor([1])
    session.cache.batch_select_indices(short_row)  # the long row left
    mask = _trim_padding(session.cache, session.mask[short_row])
    assert mask.shape[1] == len(short_prompt) and session.cache.get_seq_length() == len(short_prompt)
    session.close()


def test_top_p_samples_only_from_the_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2])
    logprobs = probs.log().expand(4000, 3)
    uniforms = torch.rand(4000, generator=torch.Generator().manual_seed(0))
    picks = sample_rows(logprobs, 0.6, uniforms)  # 0.5 < 0.6, so the nucleus is {0, 1}
    counts = torch.bincount(picks, minlength=3)
    assert counts[2] == 0
    assert abs(counts[0].item() / 4000 - 0.5 / 0.8) < 0.03
    everything = torch.bincount(sample_rows(logprobs, 1.0, uniforms), minlength=3) / 4000
    assert torch.allclose(everything, probs, atol=0.03)


def test_a_nucleus_wider_than_the_candidates_is_sampled_from_the_whole_vocabulary() -> None:
    vocab = 3 * NUCLEUS_CANDIDATES  # flat: the nucleus of top_p 0.9 holds 90% of the vocabulary
    logprobs = torch.full((4000, vocab), -math.log(vocab))
    uniforms = torch.rand(4000, generator=torch.Generator().manual_seed(1))
    picks = sample_rows(logprobs, 0.9, uniforms)
    assert len(set(picks.tolist())) > 2 * NUCLEUS_CANDIDATES  # not only the first candidates
    peaked = torch.cat([torch.tensor([[0.7, 0.25]]), torch.full((1, vocab - 2), 0.05 / (vocab - 2))], -1).log()
    assert set(sample_rows(peaked.expand(4000, vocab), 0.9, uniforms).tolist()) == {0, 1}


def test_a_tiny_top_p_is_greedy_and_keeps_the_untruncated_logprob(backend: TransformersBackend) -> None:
    (c,) = backend.generate([PROMPTS[0]], events.Sampling(temperature=2.0, top_p=1e-6, max_tokens=8, seed=0))
    with torch.no_grad():
        logits = backend.model(input_ids=torch.tensor([PROMPTS[0] + c.token_ids])).logits[0, len(PROMPTS[0]) - 1:-1]
    assert c.token_ids == logits.argmax(-1).tolist()
    expected = full_forward_logprobs(backend.model, PROMPTS[0], c.token_ids, 2.0)
    assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4)
    assert max(c.logprobs) < -0.01  # not log(1): the logprob is taken before truncation


def test_a_stop_string_ends_the_completion_and_is_cut_from_its_text(backend: TransformersBackend) -> None:
    sampling = events.Sampling(max_tokens=24, seed=5)
    (free,) = backend.generate([PROMPTS[0]], sampling)
    stop = next(ch for ch in free.text[1:] if ch.isascii() and ch.isalnum())
    (stopped,) = backend.generate([PROMPTS[0]], events.Sampling(max_tokens=24, seed=5, stop=["\x00", stop]))
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[:free.text.index(stop)]
    n = len(stopped.token_ids)
    assert stopped.token_ids == free.token_ids[:n] and stopped.logprobs == pytest.approx(free.logprobs[:n])
    assert stop in backend.decode(stopped.token_ids) and stop not in backend.decode(stopped.token_ids[:-1])


def test_max_tokens_and_eos_set_the_finish_reason(backend: TransformersBackend) -> None:
    out = backend.generate(PROMPTS, events.Sampling(max_tokens=3, seed=1))
    assert all(len(c.token_ids) == 3 and c.finish_reason == "length" for c in out
               if not set(c.token_ids) & backend.eos_ids)
    eos_ids = backend.eos_ids
    backend.eos_ids = set(range(len(backend.tokenizer)))  # every token ends a sequence
    try:
        out = backend.generate(PROMPTS, events.Sampling(max_tokens=3, seed=1))
    finally:
        backend.eos_ids = eos_ids
    assert all(len(c.token_ids) == 1 and c.finish_reason == "stop" for c in out)


@pytest.mark.parametrize("field, sampling", [
    ("sampling.temperature", events.Sampling(temperature=0.0)),
    ("sampling.top_p", events.Sampling(top_p=0.0)),
    ("sampling.max_tokens", events.Sampling(max_tokens=0)),
    ("sampling.stop", events.Sampling(stop=[""])),
    ("sampling.max_tokens", events.Sampling(max_tokens=10_000)),
])
def test_bad_sampling_is_refused_naming_the_field(backend: TransformersBackend, field: str,
                                                  sampling: events.Sampling) -> None:
    with pytest.raises(ValueError, match=field):
        backend.generate(PROMPTS, sampling)


def test_swap_loads_new_weights_and_records_the_version(tiny_model_dir: Path) -> None:
    backend = build_backend("transformers", tiny_model_dir, "float32")
    assert backend.version is None
    sampling = events.Sampling(max_tokens=8, seed=2)
    before = backend.generate(PROMPTS, sampling)
    model, _ = models.load_model(tiny_model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    backend.swap(models.save_weights(model), 7)
    after = backend.generate(PROMPTS, sampling)
    assert backend.version == 7
    assert [c.logprobs for c in after] != [c.logprobs for c in before]
    with pytest.raises(ValueError, match=r"inference\.backend='vllm'"):
        build_backend("vllm", tiny_model_dir, "float32")


def test_the_config_variants_and_the_backend_registry_agree() -> None:
    parts = variants(InferenceConfig.model_fields["backend"])
    assert set(parts) - {BY_PATH} == set(BACKENDS)
    for name, variant in parts.items():
        if name != BY_PATH:
            variant.check_call(BACKENDS[name], variant.model_validate({}).kwargs())
    methods = {name for name, value in vars(Backend).items() if callable(value) and not name.startswith("_")}
    assert set(BackendPart.METHODS) == methods


USER_BACKEND = """
from flywheel.sdk import models
from flywheel_inference.backends import TransformersBackend


class LabelledBackend(TransformersBackend):
    def __init__(self, path, dtype, label):
        model, tokenizer = models.load_model(path, dtype=dtype)
        super().__init__(model, tokenizer)
        self.label = label
"""


def test_a_users_backend_by_path_is_built_from_the_run_config(tiny_model_dir: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "user_backend_parts.py").write_text(USER_BACKEND)
    monkeypatch.syspath_prepend(str(tmp_path))
    trusted = ["user_backend_parts"]  # the setting trusted_modules
    cfg = RunConfig.parse({"run": "r", "env": "e", "inference": {
        "backend": {"type": "user_backend_parts:LabelledBackend", "args": {"label": "mine"}}}}, trusted_modules=trusted)
    backend = build_backend(RunConfig.parse(cfg.model_dump(), trusted_modules=trusted).inference.backend,
                            tiny_model_dir, "float32")
    assert type(backend).__name__ == "LabelledBackend"
    assert backend.label == "mine"  # type: ignore[attr-defined]  # LabelledBackend (USER_BACKEND) has one
    check_one_completion_per_prompt(backend)
