"""Runs in the run-state KV bucket: names, registration, reading and writing their state.

A run's :class:`flywheel.events.RunState` (tenant, status, policy version, config) lives
under its id in the ``flywheel-runs`` bucket. A run belongs to the tenant that registered
it first; every writer (gateway, CLI, client, ``flywheel run``, trainer) goes through
here, so the rule and the name checks live once.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import nats.js.errors

from flywheel import events
from flywheel.bus import Bus, watch_bucket

MAX_NAME_CHARS = 128
# A NATS subject token: no separators, no wildcards, no whitespace, not empty.
_TOKEN = re.compile(r"[^\s.*>]+")
# A run id or tenant is also a KV key (of the runs bucket, or in its value), which allows fewer characters.
_KV_KEY = re.compile(r"[-/_=a-zA-Z0-9]+")
_decoder = events.Decoder(events.RunState)


def is_token(value: object) -> bool:
    """A NATS subject token of at most MAX_NAME_CHARS: no '.', '*', '>' or whitespace, not empty."""
    return isinstance(value, str) and _TOKEN.fullmatch(value) is not None and len(value) <= MAX_NAME_CHARS


def is_key(value: object) -> bool:
    """A run-state key (run id, tenant): letters, digits, '-', '_', '/', '=', at most MAX_NAME_CHARS."""
    return isinstance(value, str) and _KV_KEY.fullmatch(value) is not None and len(value) <= MAX_NAME_CHARS


def check_token(field: str, value: str) -> str:
    """``value`` if it is a valid NATS subject token, else a ValueError naming ``field``."""
    if not is_token(value):
        raise ValueError(f"{field}={value!r} is not a valid NATS subject token: it must be 1 to {MAX_NAME_CHARS} "
                         "characters with no '.', '*', '>' or whitespace")
    return value


def check_key(field: str, value: str) -> str:
    """``value`` if it can be a run-state key (a run id, a tenant), else a ValueError naming ``field``."""
    if not is_key(value):
        raise ValueError(f"{field}={value!r} must be 1 to {MAX_NAME_CHARS} letters, digits, '-', '_', '/' or '=' "
                         "(it is a NATS subject token and a key of the runs KV bucket)")
    return value


class RunConflict(ValueError):
    """The run exists and belongs to another tenant."""


async def get_run(bus: Bus, run: str) -> events.RunState | None:
    kv = await bus.runs_kv()
    try:
        entry = await kv.get(run)
    except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
        return None
    return _decoder.decode(entry.value) if entry.value else None


async def get_or_create_run(bus: Bus, run: str, tenant: str = "default", config: dict[str, Any] | None = None,
                            kind: str = "train") -> tuple[events.RunState, bool]:
    """The run's state, created (owned by ``tenant``, with ``config``, of ``kind`` train or eval) if new;
    ``(state, created)``.
    An existing run is returned as it is, whoever owns it."""
    check_key("run", run)
    check_key("tenant", tenant)
    kv = await bus.runs_kv()
    for _ in range(2):  # a second pass only when another writer created it meanwhile
        state = await get_run(bus, run)
        if state is not None:
            return state, False
        state = events.RunState(id=run, tenant=tenant, config=config or {}, kind=kind)  # type: ignore[arg-type]
        try:
            await kv.create(run, events.encode(state))
            return state, True
        except nats.js.errors.KeyWrongLastSequenceError:
            continue
    raise RuntimeError(f"run {run!r}: the run-state key changed twice while it was being created")


async def register_run(bus: Bus, run: str, tenant: str = "default", config: dict[str, Any] | None = None,
                       kind: str = "train") -> tuple[events.RunState, bool]:
    """Like :func:`get_or_create_run`, but a run of another tenant is a :class:`RunConflict`."""
    state, created = await get_or_create_run(bus, run, tenant, config, kind)
    if state.tenant != tenant:
        raise RunConflict(f"run {run!r} belongs to tenant {state.tenant!r}, not {tenant!r}; "
                          "name another run or use its owner's tenant")
    return state, created


async def update_run(bus: Bus, run: str, **changes: Any) -> events.RunState:
    """Replace fields of an existing run's state (``updated_at`` is set); returns the new state."""
    state = await get_run(bus, run)
    if state is None:
        raise ValueError(f"run {run!r} is not registered")
    state = msgspec.structs.replace(state, updated_at=events.utc_now(), **changes)
    kv = await bus.runs_kv()
    await kv.put(run, events.encode(state))
    return state


async def watch_runs(bus: Bus, stopping: asyncio.Event,
                     on_state: Callable[[events.RunState], Awaitable[None]]) -> None:
    """Call ``on_state`` with every run's current state, then with every change, until ``stopping``."""
    async for value in watch_bucket(await bus.runs_kv(), stopping):
        await on_state(_decoder.decode(value))
