"""The tiny model and the one loading path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flywheel.contract import events
from flywheel.sdk import models


def test_tiny_model_is_a_normal_hf_folder_with_a_chat_template(tiny_model_dir: Path) -> None:
    model, tok = models.load_model(tiny_model_dir)
    assert (tiny_model_dir / "config.json").exists() and tok.chat_template
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 5_000_000
    msgs = [events.Message(role="system", content="Reverse the text."), events.Message(role="user", content="abc")]
    prompt = models.render_prompt(tok, msgs)
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n")
    assert prompt[: len(models.render_messages(tok, msgs[:1]))] == models.render_messages(tok, msgs[:1])
    # Task letters stay one token each, so reversing text is reversing tokens.
    assert [tok.decode([t]) for t in tok.encode("abcdefghijkl", add_special_tokens=False)] == list("abcdefghijkl")


def test_building_twice_gives_the_same_weights(tmp_path: Path) -> None:
    a, _ = models.load_model(models.build_tiny(tmp_path / "a"))
    b, _ = models.load_model(models.build_tiny(tmp_path / "b"))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_weights_round_trip_through_bytes(tiny_model_dir: Path) -> None:
    model, _ = models.load_model(tiny_model_dir)
    other, _ = models.load_model(tiny_model_dir)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    models.load_weights(other, models.save_weights(model))
    assert all(torch.equal(x, y) for x, y in zip(model.state_dict().values(), other.state_dict().values(), strict=True))


def test_bad_model_names_say_what_to_give(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"config\.json"):
        models.resolve_model(str(tmp_path / "empty"), tmp_path)
    assert models.resolve_model("org/some-hub-model", tmp_path) == "org/some-hub-model"
    with pytest.raises(ValueError, match="dtype"):
        models.load_model(tmp_path, dtype="float8")


def test_tied_weights_are_written_once_and_a_wrong_blob_is_refused(tiny_model_dir: Path) -> None:
    from safetensors.torch import load, save

    model, _ = models.load_model(tiny_model_dir)
    blob = load(models.save_weights(model))
    assert "lm_head.weight" not in blob and "model.embed_tokens.weight" in blob
    with pytest.raises(ValueError, match="missing"):
        models.load_weights(model, save({k: v for k, v in blob.items() if "layers.0." not in k}))


def randomize_adapter(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)


def test_an_adapter_travels_alone_and_merges_into_the_base_without_accumulating(tiny_model_dir: Path) -> None:
    """A LoRA model's weights are its adapter (a small blob); loaded into a plain model of the
    same base it gives the adapted model's logits, each version from the base, never on top of
    the one before; full weights after it become the base again."""
    adapted = models.add_adapter(models.load_model(tiny_model_dir)[0], 4, 8, ["q_proj", "v_proj", "down_proj"])
    assert {n.split(".")[-2] for n, p in adapted.named_parameters() if p.requires_grad} == {"default"}
    assert all("lora_" in n for n, p in adapted.named_parameters() if p.requires_grad)
    plain, _ = models.load_model(tiny_model_dir)
    full = models.save_weights(plain)
    ids = torch.randint(0, 100, (2, 16))
    for seed in (1, 2):
        randomize_adapter(adapted, seed)
        blob = models.save_weights(adapted)
        assert models.is_adapter(blob) and not models.is_adapter(full) and len(blob) < len(full) / 20
        models.load_weights(plain, blob)
        with torch.no_grad():
            assert (plain(input_ids=ids).logits - adapted(input_ids=ids).logits).abs().max() < 1e-4
    models.load_weights(plain, full)
    base, _ = models.load_model(tiny_model_dir)
    for (name, p), q in zip(plain.state_dict().items(), base.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    # Full weights are the new base: an adapter after them merges into them.
    q_proj = "model.layers.0.self_attn.q_proj"
    weight = dict(plain.named_modules())[q_proj].weight
    with torch.no_grad():
        weight.add_(1.0)
    moved = weight.clone()
    models.load_weights(plain, models.save_weights(plain))
    models.load_weights(plain, blob)
    lora = dict(adapted.named_modules())
    a, b = (lora[f"base_model.model.{q_proj}.lora_{x}.default"].weight for x in "AB")
    assert torch.allclose(weight, moved + 2.0 * (b @ a), atol=1e-6)


def test_an_adapter_on_no_module_of_the_model_or_of_another_shape_is_refused(tiny_model_dir: Path,
                                                                            tmp_path: Path) -> None:
    model, _ = models.load_model(tiny_model_dir)
    with pytest.raises(ValueError, match=r"target_modules=\['qkv'\]: none is a module of this model; its linear "
                                         r"layers are named \[.*'q_proj'"):
        models.add_adapter(model, 4, 8, ["qkv"])
    blob = models.save_weights(models.add_adapter(model, 4, 8, ["q_proj"]))
    narrower, _ = models.load_model(models.build_tiny(tmp_path / "narrower", hidden_size=64))
    with pytest.raises(ValueError, match=r"adapter weights do not fit the model: model\.layers\.\d\.self_attn\."
                                         r"q_proj is not a linear layer of shape \(128, 128\) here"):
        models.load_weights(narrower, blob)
