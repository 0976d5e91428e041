"""One run's policy: a backend, a batching loop in front of it, and its weight swaps.

Every sampling request for the run (rollouts of any task, HTTP requests) joins one queue;
the loop takes up to ``max_batch_size`` queued sequences with the same sampling settings
and generates them as one batch in a worker thread, so the event loop keeps serving the
bus and HTTP meanwhile. Weight swaps take the same lock as a batch, so new weights load
between batches and never in the middle of a sequence; each result carries the version
that produced it.

Weight updates are offered as they are seen (:meth:`Policy.offer`); the newest wins, so a
burst of versions loads only the last. A blob that fails to fetch, verify or load is
kept as :attr:`Policy.error`, which fails sampling for the run with that reason until a
later update loads: a run never silently samples from weights the trainer has moved on
from. Not covered: LoRA adapters, several runs sharing one base model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import msgspec

from flywheel import events
from flywheel_inference.backends import Backend, Completion, check_sampling

log = logging.getLogger(__name__)

FetchWeights = Callable[[events.WeightUpdate], Awaitable[bytes]]
OnLoaded = Callable[[events.WeightUpdate], Awaitable[None]]


class WeightsUnavailable(RuntimeError):
    """The run's weights failed to load; the message says which version and why."""


@dataclass(frozen=True)
class Sampled:
    completion: Completion
    version: int
    generation_s: float  # wall time of the batch it was generated in


@dataclass
class _Request:
    prompt: Sequence[int]
    sampling: events.Sampling
    key: bytes  # the sampling settings without the seed: requests with equal keys batch together
    seed: int | None
    future: asyncio.Future[Sampled]


def _batch_key(sampling: events.Sampling) -> bytes:
    return msgspec.json.encode(msgspec.structs.replace(sampling, seed=None))


class Policy:
    def __init__(self, run: str, backend: Backend, fetch: FetchWeights, max_batch_size: int,
                 on_loaded: OnLoaded | None = None) -> None:
        """``fetch`` gets an update's verified blob; ``on_loaded(update)`` runs after each load."""
        self.run = run
        self.backend = backend
        self.max_batch_size = max_batch_size
        self.error: WeightsUnavailable | None = None
        self._fetch = fetch
        self._on_loaded = on_loaded
        self._lock = asyncio.Lock()  # one batch or one swap at a time
        self._queue: deque[_Request] = deque()
        self._queued = asyncio.Event()
        self._wanted: events.WeightUpdate | None = None
        self._offered = asyncio.Event()
        self._state = asyncio.Condition()  # notified when weights load or fail
        self._tasks = [asyncio.ensure_future(self._batches()), asyncio.ensure_future(self._updates())]
        for t in self._tasks:
            t.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("run %s: policy loop died", self.run, exc_info=task.exception())

    @property
    def version(self) -> int | None:
        return self.backend.version

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.to_thread(self.backend.close)

    # --- weights ------------------------------------------------------------------------------

    def offer(self, update: events.WeightUpdate) -> None:
        """A weight update was seen; load it unless a newer one is already wanted or loaded."""
        known = [v for v in (self.version, None if self._wanted is None else self._wanted.version) if v is not None]
        if not known or update.version > max(known):
            self._wanted = update
            self._offered.set()

    async def wait_ready(self) -> int:
        """Wait until the run's weights are loaded (the first update); returns their version.

        Raises :class:`WeightsUnavailable` while the latest update failed to load.
        """
        async with self._state:
            await self._state.wait_for(lambda: self.version is not None or self.error is not None)
            if self.error is not None:
                raise self.error
            assert self.version is not None
            return self.version

    async def swap(self, data: bytes, version: int) -> None:
        async with self._lock:
            await asyncio.to_thread(self.backend.swap, data, version)

    async def _updates(self) -> None:
        while True:
            await self._offered.wait()
            self._offered.clear()
            update = self._wanted
            assert update is not None
            try:
                await self.swap(await self._fetch(update), update.version)
            except Exception as exc:  # noqa: BLE001 - kept as the run's error, raised to every sampler
                error: WeightsUnavailable | None = WeightsUnavailable(
                    f"run {self.run!r}: weights version {update.version} ({update.uri}) could not be loaded: "
                    f"{type(exc).__name__}: {exc}")
                log.error("%s", error, exc_info=exc)
            else:
                error = None
                log.info("run %s: weights version %d loaded", self.run, update.version)
            async with self._state:
                self.error = error
                self._state.notify_all()
            if error is None and self._on_loaded is not None:
                await self._on_loaded(update)

    # --- sampling -----------------------------------------------------------------------------

    async def sample(self, prompts: Sequence[Sequence[int]], sampling: events.Sampling,
                     seeds: Sequence[int | None] | None = None) -> list[Sampled]:
        """Sample one completion per prompt, batched with whatever else is queued for the run.

        Raises ValueError (see :meth:`check`) before anything is queued, so a bad request
        never fails the batch it would join.
        """
        self.check(prompts, sampling)
        if self.error is not None:
            raise self.error
        if self.version is None:
            raise WeightsUnavailable(f"run {self.run!r}: no weights loaded yet (waiting for version 0)")
        seeds = seeds if seeds is not None else [None if sampling.seed is None else sampling.seed + i
                                                 for i in range(len(prompts))]
        loop = asyncio.get_running_loop()
        key = _batch_key(sampling)
        requests = [_Request(p, sampling, key, s, loop.create_future()) for p, s in zip(prompts, seeds, strict=True)]
        self._queue.extend(requests)
        self._queued.set()
        return list(await asyncio.gather(*(r.future for r in requests)))

    def check(self, prompts: Sequence[Sequence[int]], sampling: events.Sampling) -> None:
        """ValueError, naming the field, for settings or prompts this model cannot sample."""
        check_sampling(sampling)
        limit = self.backend.max_positions
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompts[{i}] is empty: a completion needs at least one prompt token")
            if limit is not None and len(prompt) + sampling.max_tokens > limit:
                raise ValueError(f"sampling.max_tokens={sampling.max_tokens} plus the prompt ({len(prompt)} tokens) "
                                 f"exceeds the model's context of {limit} positions")

    def _take_batch(self) -> list[_Request]:
        """The oldest request and up to ``max_batch_size - 1`` more with the same settings."""
        key = self._queue[0].key
        batch: list[_Request] = []
        rest: deque[_Request] = deque()
        while self._queue:
            r = self._queue.popleft()
            if r.future.done():  # its caller gave up (cancelled)
                continue
            (batch if r.key == key and len(batch) < self.max_batch_size else rest).append(r)
        self._queue = rest
        return batch

    async def _batches(self) -> None:
        while True:
            while not self._queue:
                self._queued.clear()
                await self._queued.wait()
            batch = self._take_batch()
            if not batch:
                continue
            async with self._lock:
                version = self.version
                assert version is not None, "sampled before the first weights were loaded"
                started = time.monotonic()
                try:
                    completions = await asyncio.to_thread(self.backend.generate, [r.prompt for r in batch],
                                                          batch[0].sampling, [r.seed for r in batch])
                except Exception as exc:  # noqa: BLE001 - handed to every caller of the batch
                    for r in batch:
                        if not r.future.done():
                            r.future.set_exception(exc)
                    continue
            elapsed_s = time.monotonic() - started
            for r, c in zip(batch, completions, strict=True):
                if not r.future.done():
                    r.future.set_result(Sampled(c, version, elapsed_s))
