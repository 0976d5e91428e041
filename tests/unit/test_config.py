"""Run configs: every checked-in TOML parses; bad values name their field."""

from __future__ import annotations

from pathlib import Path

import pytest

from flywheel.contract.config import RunConfig

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


def test_env_args_and_reward_tables_become_environment_overrides() -> None:
    cfg = RunConfig.from_toml_text("""
run = "r"
env = "reverse_text"
scorers = {exact = 2.0}
[env_args]
difficulty = 3
[rewards.similarity]
weight = 0.5
[rewards.brevity]
function = "my_rewards:brevity"
group = true
""")
    from flywheel.sdk.environment import overrides_of

    overrides = overrides_of(cfg)
    assert overrides.args == {"difficulty": 3}
    assert {name: (r.weight, r.function, r.group) for name, r in overrides.rewards.items()} == {
        "similarity": (0.5, None, None), "brevity": (None, "my_rewards:brevity", True)}
    assert RunConfig.parse(cfg.model_dump()) == cfg  # round-trips through the run state


@pytest.mark.parametrize(("data", "message"), [
    ({"rewards": {"x": {}}}, "rewards.x: Value error, give weight, function or both"),
    ({"rewards": {"x": {"function": "nocolon"}}}, "function='nocolon': write it as 'package.module:function'"),
    ({"rewards": {"x": {"weight": -1}}}, "rewards.x.weight: Input should be greater than or equal to 0"),
    ({"rewards": {"exact": {"weight": 1}}, "scorers": {"exact": 2}},
     "scorers.exact and rewards.exact.weight both set the weight of 'exact': keep one"),
    ({"rewards": {"x": {"weight": 1, "wieght": 2}}}, "rewards.x.wieght: Extra inputs are not permitted"),
    ({"env": "two words"}, "env='two words': give an environment id"),
])
def test_bad_reward_tables_name_the_field(data: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        RunConfig.parse({"run": "r", "env": "reverse_text", **data})
    assert message in str(err.value)


def test_the_subject_token_is_the_env_or_the_environments_name() -> None:
    from flywheel.sdk.environment import load_environment, subject_name

    env = load_environment("reverse_text")
    assert subject_name("reverse_text", env) == "reverse_text"
    assert subject_name("flywheel/reverse-text@0.1.0", env) == "reverse_text"
    assert subject_name("pkg.module", env) == "reverse_text"


def test_environment_sampling_is_a_default_under_the_runs_own() -> None:
    from flywheel.sdk.environment import load_environment

    env = load_environment("reverse_text")
    env.sampling = {"temperature": 0.7, "max_tokens": 20}
    cfg = RunConfig.from_toml_text('run = "r"\nenv = "reverse_text"\n[sampling]\nmax_tokens = 12\n')
    merged = cfg.with_sampling_defaults(env.sampling, "environment 'reverse_text'")
    assert (merged.sampling.temperature, merged.sampling.max_tokens) == (0.7, 12)
    assert RunConfig.parse(merged.model_dump()).sampling == merged.sampling
    env.sampling = {"temprature": 0.7}
    with pytest.raises(ValueError, match=r"environment 'reverse_text': sampling has \['temprature'\]"):
        cfg.with_sampling_defaults(env.sampling, "environment 'reverse_text'")
    env.sampling = {"top_p": 2.0}
    with pytest.raises(ValueError, match=r"environment 'reverse_text': sampling \{'top_p': 2.0\}: Input should be"):
        cfg.with_sampling_defaults(env.sampling, "environment 'reverse_text'")
