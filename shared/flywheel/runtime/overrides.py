"""A run config with ``--set KEY=VALUE`` overrides: the CLI's ``run`` and ``sft`` and the trainer
read a config the same way."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from flywheel.contract.config import RunConfig


def parse_sets(items: Sequence[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` options as overrides: each value as JSON where it is JSON, else as text."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: write KEY=VALUE, e.g. trainer.lr=0")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


def config_with(config_path: str, overrides: Mapping[str, Any], run_id: str | None = None,
                trusted_modules: Sequence[str] = ()) -> RunConfig:
    """The run config at ``config_path`` with ``overrides`` (see :func:`apply_override`) and,
    given, ``run_id`` as its run; ValueError naming the field for a bad value."""
    data = RunConfig.from_toml(config_path, trusted_modules).model_dump()
    for dotted, value in overrides.items():
        apply_override(data, dotted, value)
    if run_id:
        data["run"] = run_id
    return RunConfig.parse(data, source=config_path, trusted_modules=trusted_modules)


def apply_override(data: dict[str, Any], dotted: str, value: Any) -> None:
    """``--set dotted=value`` on a config's data: ``trainer.lr``, ``trainer.loss.clip_eps``,
    ``envs.1.weight`` (the second ``[[envs]]`` table). A part given by its bare name (``--set
    trainer.engine=deepspeed`` before ``--set trainer.engine.zero_stage=2``) becomes
    ``{"type": name}`` so its fields can be set."""
    section: Any = data
    *parents, leaf = dotted.split(".")
    for i, key in enumerate(parents):
        if isinstance(section, list):
            if not key.isdigit() or int(key) >= len(section):
                raise ValueError(f"--set {dotted}: {'.'.join(parents[:i])} has tables 0 to {len(section) - 1}, "
                                 f"not {key!r}")
            section = section[int(key)]
            continue
        if isinstance(section.get(key), str):
            section[key] = {"type": section[key]}
        if section.get(key) is None:
            # a table the config may not have yet ([rewards.x], [env_args]) or leaves unset (trainer.kl)
            section[key] = {}
        section = section[key]
        if not isinstance(section, dict | list):
            raise ValueError(f"--set {dotted}: {'.'.join(parents[:i + 1])} is a value, not a table")
    if isinstance(section, list):
        raise ValueError(f"--set {dotted}: {'.'.join(parents)} is a list of tables; set a key of one, e.g. "
                         f"{'.'.join(parents)}.0.KEY")
    section[leaf] = value
