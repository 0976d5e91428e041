"""The models behind the runs' policies: a backend of a run's own, or a base shared by LoRA runs.

A run that trains an adapter (``trainer.adapter``) is hosted on the shared base of its model
(:class:`SharedBase`: one backend per model, dtype and backend settings, loaded for the first
such run): the run's policy is a view that loads its adapter there, and one batching loop takes
every such run's requests, each row with its run's adapter (:mod:`flywheel_inference.adapters`).
The base goes with its last adapter. A backend that keeps no adapters side by side (one of the
user's own) gets a copy per run, the adapter merged in. Any other run's policy has a backend of
its own. The heartbeat's ``shared_bases`` lists the bases (:meth:`Policies.counters`).

Weights come from the bus's blob store (:func:`flywheel.contract.weights.get`); a fetch that
fails for a reason worth another try (the server restarting or slow) says so to the policy,
which tries again (:class:`flywheel_inference.policy.TransientFetchError`). Which runs have a
policy, and for how long, is :mod:`flywheel_inference.hosting`'s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import nats.errors
import nats.js.errors

from flywheel.contract import events, weights
from flywheel.contract.bus import Bus
from flywheel.contract.config import RunConfig
from flywheel.contract.heap import freeze_heap
from flywheel.contract.service import compute
from flywheel_inference.completion import Backend
from flywheel_inference.once import once
from flywheel_inference.policy import Batcher, OnLoaded, Policy, TransientFetchError

log = logging.getLogger(__name__)

BuildBackend = Callable[[RunConfig], Backend]


@dataclass
class SharedBase:
    """One loaded base model shared by the LoRA runs on it: its backend (holding their
    adapters), one batching loop for all of them, and the names (runs, ``RUN@STEP``
    snapshots) whose adapters it holds."""

    model: str
    backend: Backend
    batcher: Batcher
    names: set[str] = field(default_factory=set)

    def counters(self) -> dict[str, Any]:
        slots = getattr(self.backend, "adapters", None)
        loaded = getattr(slots, "adapters", {})
        return {"model": self.model, "adapters": sorted(self.names),
                "adapter_bytes": sum(a.num_bytes for a in loaded.values())}


def _fetch_is_transient(exc: Exception) -> bool:
    """A fetch failure worth another try: the server restarting or slow. A blob that is missing
    or does not verify (ValueError) stays so."""
    if isinstance(exc, nats.js.errors.APIError):
        return isinstance(exc, nats.js.errors.ServiceUnavailableError)
    return isinstance(exc, (nats.errors.Error, TimeoutError, ConnectionError))


class Policies:
    """Builds the policies of runs and snapshots on backends from ``build``, sharing a base
    between LoRA runs; ``on_change`` is called when the shared bases change."""

    def __init__(self, bus: Bus, build: BuildBackend, on_change: Callable[[], None]) -> None:
        self.bus = bus
        self._build = build
        self._on_change = on_change
        self.bases: dict[tuple[str, str, str], SharedBase] = {}  # (model, dtype, backend) -> its LoRA runs' base
        self._base_loading: dict[tuple[str, str, str], asyncio.Future[SharedBase | Backend]] = {}

    async def policy(self, name: str, cfg: RunConfig, on_loaded: OnLoaded | None = None,
                     on_error: Callable[[str], None] | None = None) -> Policy:
        """The policy of run (or snapshot) ``name``. A run that trains an adapter gets a view on
        the shared base of its model (loaded once for every such run, and batched together);
        any other run, or one whose backend keeps no adapters, a backend of its own."""
        if cfg.trainer.adapter is not None:
            key = (cfg.model.name, cfg.model.dtype, cfg.inference.backend.model_dump_json())
            base: SharedBase | Backend
            if key in self.bases:
                base = self.bases[key]
            else:
                base = await once(self._base_loading, key, lambda: self._load_base(key, cfg))
            if isinstance(base, SharedBase):
                # imported here: torch, loaded only once a LoRA run is hosted
                from flywheel_inference.adapters import AdapterView

                base.names.add(name)
                base.batcher.max_batch_size = max(base.batcher.max_batch_size, cfg.inference.max_batch_size)
                log.info("run %s: adapter on the shared base %s (with %s)", name, cfg.model.name,
                         ", ".join(sorted(base.names - {name})) or "no other run yet")
                self._on_change()
                return Policy(name, AdapterView(cast(Any, base.backend), name), self._fetch,
                              cfg.inference.max_batch_size, on_loaded=on_loaded, on_error=on_error,
                              batcher=base.batcher, adapter=name)
            backend = base
        else:
            log.info("run %s: loading model %s (%s backend)", name, cfg.model.name, cfg.inference.backend)
            backend = await compute(self._build, cfg)
            freeze_heap()  # the model and what loading it imported
        return Policy(name, backend, self._fetch, cfg.inference.max_batch_size, on_loaded=on_loaded,
                      on_error=on_error)

    async def _load_base(self, key: tuple[str, str, str], cfg: RunConfig) -> SharedBase | Backend:
        """The shared base of ``key``, loaded now; a backend that keeps no adapters side by side
        (a backend of the user's own) is returned as it is, for the run alone (it merges them)."""
        log.info("loading model %s (%s backend) as a shared base for LoRA runs", cfg.model.name,
                 cfg.inference.backend)
        backend = await compute(self._build, cfg)
        freeze_heap()  # the model and what loading it imported
        if not hasattr(backend, "adapters"):
            return backend
        base = self.bases[key] = SharedBase(cfg.model.name, backend, Batcher(backend, cfg.inference.max_batch_size))
        return base

    async def close_policy(self, policy: Policy) -> None:
        """Close ``policy``; a shared base whose last adapter it held is closed too."""
        await policy.close()
        for key, base in list(self.bases.items()):
            if getattr(policy.backend, "base", None) is not base.backend:
                continue
            base.names.discard(policy.run)
            if not base.names:
                log.info("shared base %s: no adapter left on it; unloaded", base.model)
                del self.bases[key]
                await base.batcher.close()
                await compute(base.backend.close)
        self._on_change()

    def counters(self) -> list[dict[str, Any]]:
        """The heartbeat's ``shared_bases``."""
        return [base.counters() for base in self.bases.values()]

    async def close(self) -> None:
        """Close the shared bases (after the policies on them)."""
        for base in self.bases.values():
            await base.batcher.close()
            await compute(base.backend.close)

    async def _fetch(self, update: events.WeightUpdate) -> bytes:
        try:
            return await weights.get(self.bus, update)
        except Exception as exc:
            if _fetch_is_transient(exc):
                raise TransientFetchError(f"{type(exc).__name__}: {exc}") from exc
            raise
