"""Run configs: every checked-in TOML parses; bad values name their field; parts with
alternatives are typed variants, a user's own part by path is imported and checked; the
reference (``flywheel run --help-config``, docs/config.md) describes every field."""

from __future__ import annotations

import subprocess
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from flywheel.contract.config import (
    BY_PATH,
    DeepSpeedEngineConfig,
    FromPath,
    InferenceConfig,
    LeaveOneOutAdvantage,
    LossFromPath,
    MaskedLoss,
    RewardConfig,
    RunConfig,
    SamplingConfig,
    TrainerConfig,
    VLLMBackendConfig,
    reference,
    variants,
)

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
    ({"run": "r", "env": "e", "sft": {"context": "{answer}", "data": "c.jsonl"}},
     "sft: Value error, context='{answer}'"),
    ({"run": "r", "env": "e", "sft": {"context_share": 1.5}}, "sft.context_share"),
    ({"run": "r", "env": "e", "trainer": {"adapter": {"rank": 0}}}, "trainer.adapter.rank"),
    ({"run": "r", "env": "e", "trainer": {"adapter": {"target_modules": []}}}, "trainer.adapter.target_modules"),
    ({"run": "r", "env": "e", "trainer": {"adapter": {"rank": 128}}, "inference": {"backend": "vllm"}},
     "trainer.adapter.rank=128 is over inference.backend.max_lora_rank=64"),
    ({"run": "r", "env": "e", "trainer": {"adapter": {}, "engine": "deepspeed"}},
     "trainer.adapter: the deepspeed engine does not train adapters yet"),
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

    overrides = overrides_of(cfg.environments[0])
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

    name = load_environment("reverse_text").name
    assert subject_name("reverse_text", name) == "reverse_text"
    assert subject_name("flywheel/reverse-text@0.1.0", name) == "reverse_text"
    assert subject_name("pkg.module", name) == "reverse_text"


def test_environment_sampling_is_a_default_under_the_runs_own() -> None:
    from flywheel.sdk.environment import load_environment

    env = load_environment("reverse_text")
    env.sampling = {"temperature": 0.7, "max_tokens": 20}
    cfg = RunConfig.from_toml_text('run = "r"\nenv = "reverse_text"\n[sampling]\nmax_tokens = 12\n')
    merged = cfg.with_sampling_defaults({"reverse_text": env.sampling})
    assert (merged.sampling.temperature, merged.sampling.max_tokens) == (0.7, 12)
    assert RunConfig.parse(merged.model_dump()).sampling == merged.sampling
    env.sampling = {"temprature": 0.7}
    with pytest.raises(ValueError, match=r"environment 'reverse_text': sampling has \['temprature'\]"):
        cfg.with_sampling_defaults({"reverse_text": env.sampling})
    env.sampling = {"top_p": 2.0}
    with pytest.raises(ValueError, match=r"environment 'reverse_text': sampling \{'top_p': 2.0\}: Input should be"):
        cfg.with_sampling_defaults({"reverse_text": env.sampling})


def test_the_runs_sampling_is_the_contracts_shape_defaults_and_bounds() -> None:
    from flywheel.contract import events

    # One shape with one set of defaults: [sampling] is the bus's Sampling, field for field.
    assert list(SamplingConfig.model_fields) == list(events.Sampling.__struct_fields__)
    assert SamplingConfig().to_event() == events.Sampling()
    cfg = RunConfig.parse({"run": "r", "env": "e", "sampling": {"temperature": 0.5, "stop": ["\n"]}})
    assert cfg.sampling.to_event() == events.Sampling(temperature=0.5, stop=["\n"])
    # A run seeds each task's sampling from its own seed, not from [sampling].
    with pytest.raises(ValueError, match="sampling.seed=3: a run seeds each rollout's sampling from its own seed "
                                         r"\(top level\): write seed = 3 there instead"):
        RunConfig.parse({"run": "r", "env": "e", "sampling": {"seed": 3}})
    assert cfg.task_sampling(5) == events.Sampling(temperature=0.5, stop=["\n"])
    seeded = cfg.model_copy(update={"seed": 11, "group_size": 4})
    assert [seeded.task_sampling(p).seed for p in range(3)] == [11, 15, 19]
    assert seeded.task_sampling(0).with_seed_offset(3).seed == 14  # rollout 3 of task 0
    assert seeded.task_seed == 11 and cfg.task_seed == 0
    with pytest.raises(ValueError, match="seed is now the run's own: write seed = 0 at the top level"):
        RunConfig.parse({"run": "r", "env": "e", "trainer": {"seed": 1}})
    # One set of bounds: a run config loads only with sampling every backend takes.
    for sampling in ({"temperature": 0}, {"temperature": 1e-6}, {"temperature": float("inf")}, {"top_p": 0},
                     {"top_p": 1.5}, {"max_tokens": 0}, {"stop": ["\n", ""]}, {"seed": -1}):
        (name,) = sampling
        with pytest.raises(ValueError, match=rf"sampling\.{name}"):
            RunConfig.parse({"run": "r", "env": "e", "sampling": sampling})
        with pytest.raises(ValueError, match=rf"sampling\.{name}"):
            events.Sampling(**sampling).check()
    events.Sampling(temperature=1e-5, top_p=1.0, max_tokens=1, stop=["\n"], seed=0).check()


# --- parts with alternatives: advantage, loss, engine, inference backend ----------------------


def test_a_part_is_a_table_with_its_type_or_a_bare_name_and_round_trips() -> None:
    cfg = RunConfig.from_toml_text("""
run = "r"
env = "reverse_text"
[trainer]
advantage = "leave_one_out"
engine = {type = "deepspeed", zero_stage = 2}
[trainer.loss]
type = "masked"
clip_eps = 0.3
[inference]
backend = {type = "vllm"}
""")
    assert (cfg.trainer.advantage, cfg.trainer.loss, cfg.trainer.engine, cfg.inference.backend) == (
        LeaveOneOutAdvantage(), MaskedLoss(clip_eps=0.3), DeepSpeedEngineConfig(zero_stage=2), VLLMBackendConfig())
    dumped = cfg.model_dump()  # what RunState.config holds
    assert dumped["trainer"]["loss"] == {"type": "masked", "clip_eps": 0.3}
    assert RunConfig.parse(dumped) == cfg
    default = RunConfig(run="r", env="e")
    assert (str(default.trainer.advantage), str(default.trainer.loss), str(default.trainer.engine),
            str(default.inference.backend)) == ("group_mean(normalize_std=False)", "clipped(clip_eps=0.2)", "torch",
                                                "transformers")


def test_each_variant_is_tagged_with_its_type() -> None:
    for section, field in ((TrainerConfig, "advantage"), (TrainerConfig, "loss"), (TrainerConfig, "engine"),
                           (InferenceConfig, "backend")):
        parts = variants(section.model_fields[field])
        assert BY_PATH in parts and issubclass(parts[BY_PATH], FromPath)
        for tag, variant in parts.items():
            if tag != BY_PATH:  # the variant with its defaults (and what has none: OPD's teacher)
                assert variant.model_validate({"teacher": "t"} if tag == "opd" else {}).type == tag
                assert variant.FIELD == f"{section.__name__[:-6].lower()}.{field}"


@pytest.mark.parametrize(("trainer", "message"), [
    ({"loss": "nope"}, ("trainer.loss: type='nope' is not known; choose from 'clipped', 'masked', "
                        "'package.module:Name'")),
    ({"engine": {"zero_stage": 2}}, "trainer.engine: give its type"),
    ({"loss": {"type": "clipped", "clip_eps": 0}}, "trainer.loss.clip_eps: Input should be greater than 0"),
    ({"engine": {"type": "torch", "zero_stage": 2}}, "trainer.engine.zero_stage: Extra inputs are not permitted"),
    ({"engine": {"type": "deepspeed", "zero_stage": 4}}, "trainer.engine.zero_stage: Input should be less than"),
    ({"advantage": {"type": "group_mean", "normalize_std": "yes please"}}, "trainer.advantage.normalize_std: "),
    ({"clip_eps": 0.3}, ('trainer: Value error, clip_eps is now a field of the part it belongs to: write e.g. '
                         'loss = {type = "clipped", clip_eps = 0.2}')),
    ({"deepspeed_zero_stage": 2}, 'engine = {type = "deepspeed", zero_stage = 2}'),
    ({"normalize_advantage_std": True}, 'advantage = {type = "group_mean", normalize_std = true}'),
])
def test_bad_parts_name_the_field(trainer: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        RunConfig.parse({"run": "r", "env": "e", "trainer": trainer})
    assert message in str(err.value)


USER_PARTS = '''
def scaled(rewards, scale=1.0):
    return [scale * r for r in rewards]

def two_args(logprobs, old_logprobs):
    return logprobs, logprobs

class Engine:
    def __init__(self, model, trainer, dtype, lr_scale=1.0): ...
    def autocast(self): ...
    def backward(self, loss): ...
    def idle_backward(self): ...
    def step(self): ...
    def weights(self): ...
    def save(self, folder): ...
    def load(self, folder): ...

class HalfEngine:
    def __init__(self, model, trainer, dtype): ...
    def step(self): ...

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def user_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module of a user's own parts, importable as ``user_parts_mod``."""
    (tmp_path / "user_parts_mod.py").write_text(USER_PARTS)
    (tmp_path / "user_parts_broken.py").write_text("import no_such_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_parts_mod"


# The modules the operator trusts in these tests (the setting trusted_modules).
TRUSTED = ("user_parts_mod", "user_parts_broken", "user_parts_nowhere")


def test_a_users_part_by_path_is_imported_and_checked(user_parts: str) -> None:
    cfg = RunConfig.parse({"run": "r", "env": "e", "trainer": {
        "advantage": {"type": f"{user_parts}:scaled", "args": {"scale": 2.0}},
        "engine": f"{user_parts}:Engine"}}, trusted_modules=TRUSTED)
    assert cfg.trainer.advantage.bind({})([1.0, 0.5]) == [2.0, 1.0]
    assert cfg.trainer.engine.kwargs() == {}
    assert RunConfig.parse(cfg.model_dump(), trusted_modules=TRUSTED) == cfg


@pytest.mark.parametrize("trusted", [(), ("user_parts",), ("other", "user_parts_mod.inner")])
def test_a_part_by_path_from_a_module_the_operator_does_not_trust_is_refused_before_it_imports(
        user_parts: str, tmp_path: Path, trusted: tuple[str, ...]) -> None:
    """A run config's own part runs in the services that read the config, which hold NATS logins:
    only a module of the setting trusted_modules (or inside one) may be named; any other is
    refused before it is imported (its code never runs), naming the field and the setting. A
    built-in type needs no trust."""
    ran = "import pathlib\npathlib.Path(__file__).with_suffix('.ran').touch()\n"  # were it imported
    (tmp_path / "user_parts_mod.py").write_text(USER_PARTS + ran)
    for field, value in (("trainer.advantage", {"advantage": f"{user_parts}:scaled"}),
                         ("trainer.loss", {"loss": {"type": f"{user_parts}:two_args", "args": {}}}),
                         ("trainer.engine", {"engine": f"{user_parts}:Engine"})):
        with pytest.raises(ValueError) as err:
            RunConfig.parse({"run": "r", "env": "e", "trainer": value}, trusted_modules=trusted)
        assert f"{field}: Value error, type='{user_parts}:" in str(err.value)
        assert (f"module {user_parts!r} is not among the modules the operator trusts (the setting trusted_modules, "
                "FLYWHEEL_TRUSTED_MODULES; now ") in str(err.value)
        assert f"add {user_parts!r} to trusted_modules where the services run, or use a built-in type" in str(err.value)
    with pytest.raises(ValueError, match=r"inference\.backend: .*not among the modules the operator trusts"):
        RunConfig.parse({"run": "r", "env": "e", "inference": {"backend": f"{user_parts}:Engine"}},
                        trusted_modules=trusted)
    assert not (tmp_path / "user_parts_mod.ran").exists()  # never imported
    assert RunConfig.parse({"run": "r", "env": "e", "trainer": {"loss": "masked"}}).trainer.loss.type == "masked"
    # A submodule of a trusted package is trusted; the package's name as a prefix is not enough.
    RunConfig.parse({"run": "r", "env": "e", "trainer": {"advantage": f"{user_parts}:scaled"}},
                    trusted_modules=("user_parts_mod",))


@pytest.mark.parametrize(("part", "message"), [
    ({"advantage": "user_parts_nowhere:scaled"},
     ("trainer.advantage: Value error, type='user_parts_nowhere:scaled': cannot import 'user_parts_nowhere': "
      "ModuleNotFoundError")),
    ({"advantage": "user_parts_broken:scaled"},
     "cannot import 'user_parts_broken': ModuleNotFoundError: No module named 'no_such_module_anywhere'"),
    ({"advantage": "user_parts_mod:missing"}, "type='user_parts_mod:missing': 'user_parts_mod' has no 'missing'"),
    ({"advantage": "user_parts_mod:"}, "write it as 'package.module:Name'"),
    ({"advantage": {"type": "user_parts_mod:scaled", "args": {"shift": 1}}},
     "an advantage is called as (rewards, shift=...), which it does not take: got an unexpected keyword argument"),
    ({"loss": "user_parts_mod:two_args"},
     ("trainer.loss: Value error, type='user_parts_mod:two_args': a loss is called as (logprobs, old_logprobs, "
      "advantages), which it does not take: too many positional arguments")),
    ({"loss": "user_parts_mod:NOT_A_FUNCTION"},
     "a loss is a function called as (logprobs, old_logprobs, advantages, **args), not an object of type int"),
    ({"engine": "user_parts_mod:scaled"},
     ("trainer.engine: Value error, type='user_parts_mod:scaled': an engine is a class with the methods "
      "autocast, backward, idle_backward, step, weights, save, load, not an object of type function")),
    ({"engine": "user_parts_mod:HalfEngine"},
     "HalfEngine lacks autocast, backward, idle_backward, weights, save, load"),
])
def test_a_users_part_that_does_not_import_or_is_the_wrong_kind_is_refused(user_parts: str, part: dict,
                                                                           message: str) -> None:
    with pytest.raises(ValueError) as err:
        RunConfig.parse({"run": "r", "env": "e", "trainer": part}, trusted_modules=TRUSTED)
    assert message in str(err.value)


def test_a_users_backend_by_path_is_checked_as_a_backend(user_parts: str) -> None:
    with pytest.raises(ValueError, match=r"inference\.backend: .*an inference backend has the methods generate, swap, "
                                         r"close; Engine lacks generate, swap, close"):
        RunConfig.parse({"run": "r", "env": "e", "inference": {"backend": f"{user_parts}:Engine"}},
                        trusted_modules=TRUSTED)


# --- the reference -----------------------------------------------------------------------------


def models_of(model: type[BaseModel]) -> Iterator[type[BaseModel]]:
    """``model`` and every model its fields hold: sections, reward tables, each part's variants."""
    yield model
    for f in model.model_fields.values():
        for variant in variants(f).values():
            yield from models_of(variant)
        tp = f.annotation
        if typing.get_origin(tp) in (dict, list):
            tp = typing.get_args(tp)[-1]
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            yield from models_of(tp)


def test_every_field_has_a_description_and_the_reference_lists_it() -> None:
    text = reference()
    flat = " ".join(text.split())  # as printed, long lines are folded
    seen = set()
    for model in models_of(RunConfig):
        seen.add(model)
        assert model.__doc__, f"{model.__name__} has no docstring (the reference describes it with it)"
        for name, f in model.model_fields.items():
            assert f.description, f"{model.__name__}.{name} has no description"
            if model is RunConfig and _is_section(f):  # a heading, then its description
                assert f"\n## [{name}" in text or f"\n## [[{name}" in text
                assert f"{f.description[0].upper()}{f.description[1:]}." in flat
            elif name != "type":  # a variant's type is its own line, described by its docstring
                assert f"`{name}` (" in text and f.description in flat, f"{model.__name__}.{name}"
    assert {TrainerConfig, LossFromPath, DeepSpeedEngineConfig, RewardConfig} <= seen
    for part in ("advantage", "loss", "engine"):
        for tag in variants(TrainerConfig.model_fields[part]):
            assert f'`type = "{tag}"`' in text


def _is_section(f: FieldInfo) -> bool:
    tp = f.annotation
    if typing.get_origin(tp) in (dict, list):
        tp = typing.get_args(tp)[-1]
    return isinstance(tp, type) and issubclass(tp, BaseModel) and not variants(f)


def test_docs_config_md_is_the_generated_reference() -> None:
    assert (ROOT / "docs" / "config.md").read_text() == reference(), (
        "docs/config.md is out of date: .venv/bin/flywheel run --help-config > docs/config.md")


def test_the_config_module_imports_nothing_heavy() -> None:
    code = ("import sys, flywheel.contract.config; "
            "print(sorted(m for m in ('torch', 'fastapi', 'sqlalchemy', 'transformers', 'flywheel_trainer', "
            "'flywheel_inference', 'flywheel.sdk', 'flywheel.ops') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_set_overrides_reach_a_part_given_by_its_name() -> None:
    from flywheel.runtime.overrides import apply_override

    data = RunConfig.from_toml_text('run = "r"\nenv = "reverse_text"\n').model_dump()
    apply_override(data, "trainer.engine", "deepspeed")
    apply_override(data, "trainer.engine.zero_stage", 2)
    apply_override(data, "trainer.lr", 0.0)
    apply_override(data, "rewards.exact.weight", 0.5)
    apply_override(data, "trainer.sft_term.weight", 0.5)  # a table the config leaves unset (None)
    cfg = RunConfig.parse(data)
    assert cfg.trainer.sft_term is not None and cfg.trainer.sft_term.weight == 0.5
    assert cfg.trainer.engine.type == "deepspeed"
    assert cfg.trainer.engine.zero_stage == 2  # type: ignore[union-attr]  # a DeepSpeedEngineConfig: checked above
    assert cfg.trainer.lr == 0.0 and cfg.rewards["exact"].weight == 0.5
    with pytest.raises(ValueError, match=r"--set trainer.lr.x: trainer.lr is a value, not a table"):
        apply_override(data, "trainer.lr.x", 1)
    mixed = RunConfig.from_toml_text(TWO_ENVS).model_dump()
    apply_override(mixed, "envs.1.weight", 2.5)
    apply_override(mixed, "envs.1.loss.clip_eps", 0.1)
    apply_override(mixed, "envs.0.sampling.max_tokens", 30)
    cfg = RunConfig.parse(mixed)
    assert cfg.envs[1].weight == 2.5 and str(cfg.loss_of(cfg.envs[1])) == "masked(clip_eps=0.1)"
    assert cfg.sampling_of(cfg.envs[0]).max_tokens == 30
    with pytest.raises(ValueError, match=r"--set envs.2.weight: envs has tables 0 to 1, not '2'"):
        apply_override(mixed, "envs.2.weight", 1)
    with pytest.raises(ValueError, match=r"--set envs.weight: envs is a list of tables; set a key of one"):
        apply_override(mixed, "envs.weight", 1)


# --- several environments ----------------------------------------------------------------------

TWO_ENVS = """
run = "mix"
[sampling]
max_tokens = 16
[[envs]]
id = "reverse_text"
weight = 3
[[envs]]
id = "arithmetic"
args = {difficulty = "easy"}
loss = {type = "masked", clip_eps = 0.3}
[envs.sampling]
temperature = 0.7
[envs.rewards.formatted]
weight = 0.5
"""


def test_envs_tables_each_with_args_weight_sampling_parts_and_rewards() -> None:
    cfg = RunConfig.from_toml_text(TWO_ENVS)
    reverse, arithmetic = cfg.environments
    assert (reverse.id, reverse.weight, arithmetic.id, arithmetic.args) == ("reverse_text", 3, "arithmetic",
                                                                           {"difficulty": "easy"})
    assert cfg.env_ids == "reverse_text + arithmetic" and cfg.environment("arithmetic") is arithmetic
    assert str(cfg.loss_of(arithmetic)) == "masked(clip_eps=0.3)" and cfg.loss_of(reverse) == cfg.trainer.loss
    assert cfg.advantage_of(arithmetic) == cfg.trainer.advantage
    # The run's [sampling] for both; the table's own keys over it for its environment.
    assert (cfg.sampling_of(reverse).temperature, cfg.sampling_of(reverse).max_tokens) == (1.0, 16)
    assert (cfg.sampling_of(arithmetic).temperature, cfg.sampling_of(arithmetic).max_tokens) == (0.7, 16)
    assert cfg.task_sampling(0, arithmetic).temperature == 0.7
    # The environments' own settings are defaults under both: arithmetic's max_tokens 512 and
    # temperature 1.0 lose to the run's 16 and the table's 0.7.
    merged = cfg.with_sampling_defaults({"arithmetic": {"temperature": 1.0, "max_tokens": 512, "top_p": 0.9}})
    assert RunConfig.parse(merged.model_dump()) == merged  # what the run state stores reads back the same
    merged_arithmetic = merged.environment("arithmetic")
    assert (cfg.sampling_of(merged_arithmetic).temperature, merged.sampling_of(merged_arithmetic).max_tokens,
            merged.sampling_of(merged_arithmetic).top_p) == (0.7, 16, 0.9)
    assert merged.sampling_of(merged.environment("reverse_text")).top_p == 1.0
    one = RunConfig.from_toml_text('run = "r"\nenv = "reverse_text"\nenv_args = {a = 1}\n')
    assert [(e.id, e.args, e.weight) for e in one.environments] == [("reverse_text", {"a": 1}, 1.0)]


def test_the_task_mix_follows_the_weights_interleaved_the_same_for_every_reader() -> None:
    cfg = RunConfig.from_toml_text(TWO_ENVS)
    schedule = cfg.env_schedule(40)
    assert schedule.count(0) == 30 and schedule.count(1) == 10
    assert schedule[:8] == [0, 0, 1, 0, 0, 0, 1, 0]  # evenly spread, not 30 then 10
    assert schedule == RunConfig.parse(cfg.model_dump()).env_schedule(40) and schedule[:20] == cfg.env_schedule(20)
    assert set(RunConfig.from_toml_text('run = "r"\nenv = "e"\n').env_schedule(5)) == {0}


@pytest.mark.parametrize(("text", "message"), [
    ('[[envs]]\nid = "a"\nweight = 0\n', r"envs\.0\.weight: Input should be greater than 0"),
    ('[[envs]]\nid = "a"\nweight = -1\n', r"envs\.0\.weight: Input should be greater than 0"),
    ('[[envs]]\nid = "a"\n[[envs]]\nid = "b"\n[[envs]]\nid = "a"\n',
     r"envs\.2\.id='a': envs\.0 is that environment already"),
    ('env = "a"\n[[envs]]\nid = "b"\n', r"env: a run with \[\[envs\]\] names its environments there"),
    ('env_args = {x = 1}\n[[envs]]\nid = "b"\n', r"env_args: a run with \[\[envs\]\]"),
    ('', r"env: give the run's environment .*or an \[\[envs\]\] table"),
    ('[[envs]]\nid = "a b"\n', r"envs\.0: .*id='a b': give an environment id"),
    ('[[envs]]\nid = "a"\nloss = "nope"\n', r"envs\.0\.loss: type='nope' is not known"),
    ('[[envs]]\nid = "a"\n[envs.sampling]\ntemperature = -1\n', r"envs\.0\.sampling\.temperature"),
    ('[[envs]]\nid = "a"\n[envs.sampling]\nseed = 1\n', r"envs\.0\.sampling\.seed: Extra inputs"),
    ('scorers = {x = 1.0}\n[[envs]]\nid = "a"\n[envs.rewards.x]\nweight = 2\n',
     r"scorers\.x and envs\.0\.rewards\.x\.weight both set the weight"),
])
def test_bad_envs_tables_are_refused_naming_the_field(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RunConfig.from_toml_text('run = "r"\n' + text)


def test_evals_are_due_every_so_many_steps_at_the_start_and_at_the_last_step() -> None:
    cfg = RunConfig.from_toml_text(TWO_ENVS + """
[trainer]
num_steps = 25
[[evals]]
id = "arithmetic"
name = "arith-medium"
args = {difficulty = "medium"}
every = 10
[[evals]]
id = "flywheel/reverse-text@1.0"
every = 4
at_start = false
greedy = false
[evals.sampling]
max_tokens = 30
""")
    medium, reverse = cfg.evals
    assert (medium.label, reverse.label) == ("arith-medium", "reverse-text")
    assert [step for step in range(0, 26) if medium in cfg.evals_at(step)] == [0, 10, 20, 25]
    assert [step for step in range(0, 26) if reverse in cfg.evals_at(step)] == [4, 8, 12, 16, 20, 24, 25]
    assert cfg.evals_at(26) == [] and cfg.evals_at(3) == []
    assert cfg.eval_sampling(medium) == {"temperature": 0.0, "top_p": 1.0, "max_tokens": 16, "stop": []}
    assert cfg.eval_sampling(reverse) == {"temperature": 1.0, "top_p": 1.0, "max_tokens": 30, "stop": []}
    assert RunConfig.parse(cfg.model_dump()) == cfg


@pytest.mark.parametrize(("text", "message"), [
    ('[[evals]]\nid = "a"\nevery = 0\n', r"evals\.0\.every: Input should be greater than or equal to 1"),
    ('[[evals]]\nid = "a"\nnum_tasks = 0\n', r"evals\.0\.num_tasks: Input should be greater than or equal to 1"),
    ('[[evals]]\nid = "a"\n[[evals]]\nid = "owner/a@2"\n', r"evals\.1: evals\.0 has the name 'a' already"),
    ('[[evals]]\nid = "a"\nname = "a b"\n', r"evals\.0: .*name='a b': use 1 to 64 letters"),
    ('[[evals]]\nid = "a"\nevry = 3\n', r"evals\.0\.evry: Extra inputs are not permitted"),
])
def test_bad_evals_tables_are_refused_naming_the_field(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RunConfig.from_toml_text('run = "r"\nenv = "reverse_text"\n' + text)


async def prepare_run(cfg: RunConfig) -> Any:
    """The run's config and environments as flywheel run prepares them, its environments in
    workers in this process (tests/inprocess.py)."""
    from flywheel.runtime.runs import prepare_run as prepare
    from tests.inprocess import InProcessPool

    pool = InProcessPool()
    try:
        return await prepare(pool, cfg)
    finally:
        await pool.close()


async def test_an_eval_whose_environment_does_not_load_is_refused_before_the_run_starts() -> None:
    cfg = RunConfig.from_toml_text('run = "r"\nenv = "reverse_text"\n[[evals]]\nid = "arithmetic"\n'
                                   'args = {difficulty = "impossible"}\n')
    with pytest.raises(ValueError, match=r"evals\.0 \(arithmetic\): EnvironmentLoadError: arithmetic: "
                                         r"difficulty='impossible'"):
        await prepare_run(cfg)
    missing = RunConfig.from_toml_text('run = "r"\n[[envs]]\nid = "reverse_text"\n[[envs]]\nid = "no_such_env"\n')
    with pytest.raises(ValueError, match="no_such_env"):
        await prepare_run(missing)


async def test_an_sft_term_or_warm_up_on_an_environment_without_reference_answers_is_refused_before_it_starts(
        ) -> None:
    wordle = 'run = "r"\n[[envs]]\nid = "reverse_text"\n[[envs]]\nid = "wordle"\n'
    with pytest.raises(ValueError, match=r"envs\.1\.sft_term: environment 'wordle' defines no reference answers"):
        await prepare_run(RunConfig.from_toml_text(wordle + "sft_term = {weight = 0.1}\n"))
    with pytest.raises(ValueError, match=r"trainer\.sft_term: environment 'wordle' defines no reference answers"):
        await prepare_run(RunConfig.from_toml_text(wordle + "[trainer]\nsft_term = {weight = 0.1}\n"))
    with pytest.raises(ValueError, match=r"sft\.steps=5: environment 'wordle' defines no reference answers"):
        await prepare_run(RunConfig.from_toml_text(wordle + "[sft]\nsteps = 5\n"))
    # With data to learn instead, or on reverse-text's own answers, it is accepted.
    await prepare_run(RunConfig.from_toml_text(wordle + 'sft_term = {weight = 0.1, data = "chats.jsonl"}\n'))
    await prepare_run(RunConfig.from_toml_text(wordle.replace("[[envs]]\nid = \"wordle\"\n", "")
                                               + "sft_term = {weight = 0.1}\n"))
    with pytest.raises(ValueError, match=r"sft_term\.weight"):
        RunConfig.from_toml_text('run = "r"\nenv = "reverse_text"\n[trainer]\nsft_term = {weight = 0}\n')


def test_local_model_folders_become_absolute_and_a_missing_one_is_refused(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from flywheel.ops.run import local_models

    (tmp_path / "expert").mkdir()
    (tmp_path / "expert" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)

    def cfg(model: str, policy: str = "tiny") -> RunConfig:
        return RunConfig.parse({"run": "r", "env": "reverse_text", "teachers": {"t": {"model": model}},
                                "model": {"name": policy}, "trainer": {"advantage": {"type": "opd", "teacher": "t"}}})

    assert local_models(cfg("./expert")).teachers["t"].model == str(tmp_path / "expert")
    assert local_models(cfg("tiny")).teachers["t"].model == "tiny"  # a name, found where the teacher runs
    with pytest.raises(ValueError, match=r"teachers\.t\.model='\./gone': no model folder there"):
        local_models(cfg("./gone"))
    assert local_models(cfg("tiny", "./expert")).model.name == str(tmp_path / "expert")
    assert local_models(cfg("tiny", "tiny")).model.name == "tiny"
    with pytest.raises(ValueError, match=r"model\.name='\./gone': no model folder there .*such as 'tiny'$"):
        local_models(cfg("tiny", "./gone"))


def test_data_files_become_absolute_and_a_missing_one_is_refused_naming_its_field(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flywheel.ops.run import local_data

    (tmp_path / "chats.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    two = 'run = "r"\n[[envs]]\nid = "reverse_text"\n[[envs]]\nid = "arithmetic"\n'
    cfg = local_data(RunConfig.from_toml_text(two + 'sft_term = {weight = 0.1, data = "chats.jsonl"}\n'
                                              '[sft]\nsteps = 3\ndata = "./chats.jsonl"\n'))
    assert cfg.envs[1].sft_term is not None and cfg.envs[1].sft_term.data == str(tmp_path / "chats.jsonl")
    assert cfg.sft.data == str(tmp_path / "chats.jsonl")
    plain = RunConfig.from_toml_text(two)
    assert local_data(plain) is plain  # nothing to resolve: the config as it was
    with pytest.raises(ValueError, match=r"envs\.0\.sft_term\.data='gone\.jsonl': no such file"):
        local_data(RunConfig.from_toml_text(two.replace('id = "reverse_text"\n', 'id = "reverse_text"\n'
                                                        'sft_term = {weight = 0.1, data = "gone.jsonl"}\n')))
    with pytest.raises(ValueError, match=r"trainer\.sft_term\.data='gone\.jsonl': no such file"):
        local_data(RunConfig.from_toml_text(two + '[trainer]\nsft_term = {weight = 0.1, data = "gone.jsonl"}\n'))
    with pytest.raises(ValueError, match=r"sft\.data='gone\.jsonl': no such file"):
        local_data(RunConfig.from_toml_text(two + '[sft]\ndata = "gone.jsonl"\n'))
    # A dataset folder here becomes absolute, in the warm-up and in each term; a hub id stays as it is.
    (tmp_path / "chats").mkdir()
    cfg = local_data(RunConfig.from_toml_text(two + 'sft_term = {weight = 0.1, dataset = "chats"}\n[sft]\nsteps = 3\n'
                                              'dataset = "./chats"\n[trainer]\nsft_term = {weight = 0.1, dataset = '
                                              '"someone/chats"}\n'))
    assert cfg.envs[1].sft_term is not None and cfg.envs[1].sft_term.dataset == str(tmp_path / "chats")
    assert cfg.sft.dataset == str(tmp_path / "chats")
    assert cfg.trainer.sft_term is not None and cfg.trainer.sft_term.dataset == "someone/chats"
    with pytest.raises(ValueError, match=r"trainer\.sft_term: Value error, data='a\.jsonl' and dataset='b': give one"):
        RunConfig.from_toml_text(two + '[trainer]\nsft_term = {weight = 0.1, data = "a.jsonl", dataset = "b"}\n')


def test_an_opd_part_names_a_teacher_of_the_run_and_a_dense_one_asks_it_for_its_top_k() -> None:
    def cfg(advantage: dict, teachers: dict | None = None, **more: object) -> RunConfig:
        return RunConfig.parse({"run": "r", "env": "reverse_text", "teachers": teachers or {"t": {"model": "tiny"}},
                                "trainer": {"advantage": advantage}, **more})

    sampled = cfg({"type": "opd", "teacher": "t"})
    assert sampled.top_k_of("t") == 0 and sampled.teachers_of(sampled.environments[0]) == ["t"]
    dense = cfg({"type": "opd", "teacher": "t", "estimate": "reverse_top_k", "top_k": 8})
    term = dense.trainer.advantage.dense_term()
    assert term is not None and (term.teacher, term.forward, term.top_k) == ("t", False, 8)
    assert dense.top_k_of("t") == 8 and dense.teachers_of(dense.environments[0]) == ["t"]
    assert dense.trainer.advantage.token_terms() == [] and dense.trainer.advantage.kwargs() == {
        "reward_weight": 0.0, "normalize_std": False}
    with pytest.raises(ValueError, match=r"trainer\.advantage\.teacher: teacher 'u' is not a \[teachers.<name>\]"):
        cfg({"type": "opd", "teacher": "u", "estimate": "forward_top_k"})
    with pytest.raises(ValueError, match=r"trainer\.advantage\.top_k: Input should be greater than or equal to 1"):
        cfg({"type": "opd", "teacher": "t", "estimate": "forward_top_k", "top_k": 0})
    with pytest.raises(ValueError, match=r"trainer\.advantage\.estimate: Input should be .sampled., .forward_top_k."):
        cfg({"type": "opd", "teacher": "t", "estimate": "dense"})
    # Per environment: each asks for its own top-k of one teacher; the teacher computes the most.
    envs = RunConfig.parse({"run": "r", "teachers": {"t": {"model": "tiny"}}, "envs": [
        {"id": "reverse_text", "advantage": {"type": "opd", "teacher": "t", "estimate": "forward_top_k", "top_k": 4}},
        {"id": "arithmetic", "advantage": {"type": "opd", "teacher": "t", "estimate": "forward_top_k", "top_k": 12}},
        {"id": "wordle"}]})
    assert envs.top_k_of("t") == 12 and [envs.teachers_of(e) for e in envs.environments] == [["t"], ["t"], []]
