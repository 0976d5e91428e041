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
