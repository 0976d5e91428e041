"""Run configs: every checked-in TOML parses; bad values name their field."""

from __future__ import annotations

from pathlib import Path

import pytest

from flywheel.config import RunConfig

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("path", sorted(ROOT.glob("examples/**/*.toml")), ids=lambda p: p.name)
def test_every_checked_in_config_parses(path: Path) -> None:
    RunConfig.from_toml(path)


@pytest.mark.parametrize(("data", "field"), [
    ({"run": "a.b", "env": "e"}, "run="),
    ({"run": "r", "env": "e", "trainer": {"loss": "nope"}}, "trainer.loss"),
    ({"run": "r", "env": "e", "trainer": {"advantage": "x"}}, "trainer.advantage"),
    ({"run": "r", "env": "e", "group_size": 3, "trainer": {"batch_size": 8}}, "group_size=3"),
    ({"run": "r", "env": "e", "trainer": {"lr": -1}}, "trainer.lr"),
    ({"run": "r", "env": "e", "sampling": {"temprature": 1}}, "sampling.temprature"),
    ({"env": "e"}, "run"),
])
def test_bad_values_name_the_field(data: dict, field: str) -> None:
    with pytest.raises(ValueError) as err:
        RunConfig.parse(data)
    assert field in str(err.value)


def test_a_config_round_trips_through_the_run_state() -> None:
    cfg = RunConfig.parse({"run": "r", "env": "reverse_text", "group_size": 4, "trainer": {"batch_size": 16}})
    assert RunConfig.parse(cfg.model_dump()) == cfg and cfg.groups_per_step == 4
