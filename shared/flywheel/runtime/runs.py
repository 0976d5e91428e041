"""A run's environments, loaded in environment workers: the one way services and commands load them.

Inference, the scorer, the trainer, the orchestrator and ``flywheel run`` all load a run's
environments here (:func:`load_run_environments`, :func:`load_for_run`), so they all score and
train on the same rewards: each environment of the run config (its ``[[envs]]``, or its one
``env``) with the run's args and reward overrides, in a worker of the run's tenant
(:class:`flywheel.runtime.environments.WorkerPool`). A hub environment (``owner/name[@version]``)
not installed here is installed from the hub first, by this process, never by the worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flywheel.runtime.environments import WorkerEnvironment, WorkerPool
from flywheel.runtime.envworker import LoadSpec
from flywheel.sdk.environment import (
    EnvironmentLoadError,
    EnvironmentNotInstalled,
    EnvironmentOverrides,
    available,
    ensure_installed,
    overrides_of,
    pin_hub_environments,
    subject_name,
)

if TYPE_CHECKING:
    from flywheel.contract.config import EnvConfig, RunConfig


@dataclass(frozen=True)
class RunEnvironment:
    """One environment of a run, loaded: its name in subjects (``tasks.<run>.<name>``, each
    rollout's ``env``), its part of the run config, and the environment in its workers with
    the run's overrides applied."""

    name: str
    config: EnvConfig
    env: WorkerEnvironment


def run_config(config: RunConfig | Mapping[str, Any]) -> RunConfig:
    """``config``, or the run config a run's state holds (``RunState.config``), parsed."""
    from flywheel.contract.config import RunConfig

    return config if isinstance(config, RunConfig) else RunConfig.parse(dict(config), source="run config")


def config_ids(environments: Mapping[str, RunEnvironment]) -> dict[str, str]:
    """A run's ``RunState.env_ids``: each environment's id in the run config by its name in
    subjects, for a run with several (a run with one has it in its config's ``env``)."""
    return {name: found.config.id for name, found in environments.items()} if len(environments) > 1 else {}


def _install(env_id: str, sha256: str | None) -> None:
    """A hub environment installed here (from the settings' hub) when it is not, at its version.
    Only package metadata is read: nothing of the environment is imported in this process."""
    if "/" not in env_id:
        return
    name, _, version = env_id.partition("@")
    have = available().get(name)
    if have is not None and (not version or have == version):
        return
    # imported here: the hub's HTTP client only when an environment is missing
    from flywheel.sdk.hub import Hub, HubError

    try:
        with Hub() as hub:
            ensure_installed(env_id, hub, sha256)
    except (HubError, ValueError) as exc:
        raise EnvironmentNotInstalled(f"environment {env_id!r} is not installed here, nor could the hub install "
                                      f"it: {exc}") from exc


async def load_environment(pool: WorkerPool, env_id: str, overrides: EnvironmentOverrides | None = None,
                           tenant: str = "") -> WorkerEnvironment:
    """``env_id`` with ``overrides`` loaded in a worker of ``tenant`` (installed from the hub first
    when it is a hub id missing here); EnvironmentLoadError saying why when it does not load."""
    await asyncio.to_thread(_install, env_id, overrides.sha256 if overrides else None)
    return await pool.load(LoadSpec.of(env_id, overrides), tenant)


async def load_run_environments(pool: WorkerPool, config: RunConfig | Mapping[str, Any], tenant: str = ""
                                ) -> dict[str, RunEnvironment]:
    """Every environment of a run, by its name in subjects, in the config's order; ValueError
    when two have one name."""
    cfg = run_config(config)
    found: dict[str, RunEnvironment] = {}
    for env_cfg in cfg.environments:
        env = await load_environment(pool, env_cfg.id, overrides_of(env_cfg, cfg.hub_pins.get(env_cfg.id)), tenant)
        name = subject_name(env_cfg.id, env.name)
        if name in found:
            raise ValueError(f"environments {found[name].config.id!r} and {env_cfg.id!r} of run {cfg.run!r} both "
                             f"have the name {name!r} (their tasks' subject): run them in separate runs")
        found[name] = RunEnvironment(name, env_cfg, env)
    return found


async def load_for_run(pool: WorkerPool, config: RunConfig | Mapping[str, Any], name: str | None = None,
                       tenant: str = "") -> WorkerEnvironment:
    """One environment of a run, as :func:`load_run_environments` loads it: the one named
    ``name`` (a rollout's or task's ``env``) of a run with several, or its only one (whatever
    ``name`` says: a task published to the run by hand takes the run's environment). Loads
    only that one where its id is its name (a module name). EnvironmentLoadError when the
    run has no such environment; ValueError when it has several and no ``name`` is given."""
    cfg = run_config(config)
    environments = cfg.environments
    if name is None or len(environments) == 1:
        if len(environments) > 1:
            raise ValueError(f"run {cfg.run!r} has {len(environments)} environments ({cfg.env_ids}); name one")
        first = environments[0]
        return await load_environment(pool, first.id, overrides_of(first, cfg.hub_pins.get(first.id)), tenant)
    for env_cfg in environments:
        if env_cfg.id == name:
            return await load_environment(pool, env_cfg.id, overrides_of(env_cfg, cfg.hub_pins.get(env_cfg.id)),
                                          tenant)
    found = (await load_run_environments(pool, cfg, tenant)).get(name)
    if found is None:
        raise EnvironmentLoadError(f"run {cfg.run!r} has no environment named {name!r}; its environments are "
                                   f"{cfg.env_ids}")
    return found.env


async def prepare_run(pool: WorkerPool, cfg: RunConfig, gateway_url: str | None = None, tenant: str = ""
                      ) -> tuple[RunConfig, dict[str, RunEnvironment]]:
    """A run config as it is registered, and its environments: each loaded (what does not load
    is refused here, before anything starts), its own sampling settings written in as
    defaults under the config's (:meth:`flywheel.contract.config.RunConfig.with_sampling_defaults`).
    Hub environments not installed here are pinned and installed first
    (:func:`flywheel.sdk.environment.pin_hub_environments`, from the hub at ``gateway_url``;
    default: the settings')."""
    cfg = await asyncio.to_thread(pin_hub_environments, cfg, gateway_url)
    environments = await load_run_environments(pool, cfg, tenant)
    for i, found in enumerate(environments.values()):
        # What learns reference answers needs them: refused here, not after the trainer loaded its model.
        term = cfg.sft_term_of(found.config)
        where = f"envs.{i}.sft_term" if found.config.sft_term is not None else "trainer.sft_term"
        has_reference = found.env.info.has_reference
        if term is not None and not (term.data or term.dataset) and not has_reference:
            raise ValueError(f"{where}: environment {found.config.id!r} defines no reference answers (no "
                             f"reference(task)) for its SFT term to learn; give the term data (a JSON Lines file "
                             "of chats) or a dataset, or remove it")
        if cfg.sft.steps and not (cfg.sft.data or cfg.sft.dataset) and not has_reference:
            raise ValueError(f"sft.steps={cfg.sft.steps}: environment {found.config.id!r} defines no reference "
                             "answers (no reference(task)) for the warm-up to learn; give sft.data (a JSON Lines "
                             "file of chats) or sft.dataset, or set sft.steps = 0")
    for i, spec in enumerate(cfg.evals):  # evals load where they run, in the orchestrator; refused here first
        try:
            await load_environment(pool, spec.id, EnvironmentOverrides(args=dict(spec.args),
                                                                       sha256=cfg.hub_pins.get(spec.id)), tenant)
        except Exception as exc:  # whatever its module raised, it does not load: say so and where
            raise ValueError(f"evals.{i} ({spec.label}): {type(exc).__name__}: {exc}") from exc
    cfg = cfg.with_sampling_defaults({found.config.id: found.env.sampling for found in environments.values()})
    return cfg, environments
