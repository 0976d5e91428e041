"""What ``flywheel eval --model`` takes for a model no training run trained
(:mod:`flywheel.ops.evalmodel`): a model name as a run config's ``model.name`` takes it, a Hugging
Face folder made absolute, anything else none (a run id); the run it is served as."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flywheel.ops.evalmodel import model_name, served_run_id


def test_a_model_name_or_a_folder_is_a_model_anything_else_is_not(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert model_name("tiny") == "tiny" and model_name("smollm2") == "smollm2"
    folder = tmp_path / "my model"
    folder.mkdir()
    assert model_name(str(folder)) is None  # no config.json: not a Hugging Face folder
    (folder / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert model_name("my model") == str(folder.resolve())  # absolute, as every service reads it
    assert model_name("some-run") is None and model_name("some-run@3") is None


def test_the_run_a_model_is_served_as_is_a_valid_run_id_named_after_it(tmp_path: Path) -> None:
    pattern = r"model-{}-\d{{8}}T\d{{6}}-[0-9a-f]{{4}}"
    assert re.fullmatch(pattern.format("tiny"), served_run_id("tiny"))
    assert re.fullmatch(pattern.format("SmolLM2_135M"), served_run_id(str(tmp_path / "SmolLM2 135M")))
    assert served_run_id("tiny") != served_run_id("tiny")  # two evals at once get a run each
