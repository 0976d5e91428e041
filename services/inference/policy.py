"""One run's policy: a backend, a batching loop in front of it, and its weight swaps.

Every sampling request for the run (rollouts of any task, HTTP requests) joins one queue;
the loop takes up to ``max_batch_size`` queued sequences with the same sampling settings
and generates them as one batch on the process's compute thread
(:func:`flywheel.contract.service.compute`), so the event loop keeps serving the bus and
HTTP meanwhile. On a backend with sessions (the transformers backend,
:class:`flywheel_inference.backends.DecodeSession`) the batch is continuous: requests of the
same settings queued while it runs join it between tokens, up to ``max_batch_size`` rows,
and each is answered as soon as its row finishes, so a multi-turn rollout's next call never
waits for another's long completion. Weight swaps take the same lock as a batch, and a
batch takes no more rows once a swap waits, so new weights load between batches and never
in the middle of a sequence; each result carries the version that produced it.

Weight updates are offered as they are seen (:meth:`Policy.offer`); the newest wins, so a
burst of versions loads only the last. Anyone can publish on a weights subject, so an
update can be bogus (a blob that is missing, or does not match its sha256 or size,
possibly with a huge version number). A load that fails:

- leaves the run on the weights it has: sampling goes on with them, under the run's
  admission bound, which only a successful load advances, so staleness stays bounded;
- does not block later updates: the next newest offered version above the loaded one is
  tried, and an update offered later is loaded if its version is above the loaded one,
  even if a higher (bogus) version failed;
- is kept as :attr:`Policy.load_error` (the version, its URI and why), logged, and reported
  through ``on_error`` (the worker puts it in its heartbeat), until a load succeeds. While
  the run has no weights loaded at all, its tasks wait (they are not failed because of
  someone else's bogus update) and :meth:`sample` says why there are none.

A fetch that fails with :class:`TransientFetchError` (the server restarting, a timeout) is
tried again ``len(retry_s)`` times with backoff before it counts as failed; a blob that
does not verify is not retried. Not covered: a bogus update whose blob does verify (it loads
like any other).

Runs on one base model (LoRA runs, :mod:`flywheel_inference.adapters`) share one
:class:`Batcher`: their requests join one queue and batch together, each row with its run's
adapter, and a swap of any of them takes the shared lock. A run with its own model has a
batcher of its own.

Streaming: a request may pass ``on_token``, called on the event loop with each token as its
batch samples it (the backend calls back from its thread, between tokens; a backend whose
``generate`` takes no ``on_token`` has its tokens called back when the batch is done). Other
requests in the batch are not affected.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import msgspec
from opentelemetry import trace

from flywheel.contract import events
from flywheel.contract.retry import Backoff, retry
from flywheel.contract.service import compute
from flywheel_inference.completion import Backend, Completion

log = logging.getLogger(__name__)
# A span a sampled batch, linked to the spans (rollouts) whose requests it holds; no-op unless tracing is set up.
TRACER = trace.get_tracer(__name__)

FetchWeights = Callable[[events.WeightUpdate], Awaitable[bytes]]
OnLoaded = Callable[[events.WeightUpdate], Awaitable[None]]
# (index of the prompt in the request, token id, logprob)
OnToken = Callable[[int, int, float], None]

# Offered updates kept while one loads: the last few to arrive, so a failed (bogus) one falls
# back to the next newest without keeping every version of a burst.
MAX_OFFERED = 8


class WeightsUnavailable(RuntimeError):
    """The run has no weights loaded yet; the message says what it waits for."""


class TransientFetchError(RuntimeError):
    """Raised by a fetch for a failure worth another try (the server restarting, a timeout)."""


@dataclass(frozen=True)
class Sampled:
    completion: Completion
    version: int
    generation_s: float  # wall time of the batch it was generated in


@dataclass
class _Request:
    policy: Policy  # whose weights (version, adapter) sample it
    prompt: Sequence[int]
    sampling: events.Sampling
    key: bytes  # the sampling settings without the seed: requests with equal keys batch together
    seed: int | None
    future: asyncio.Future[Sampled]
    on_token: Callable[[int, float], None] | None = None  # (token id, logprob), on the event loop
    caller: trace.SpanContext | None = None  # the span that asked (its rollout's trace): the batch's span links it


def _batch_key(sampling: events.Sampling) -> bytes:
    return msgspec.json.encode(msgspec.structs.replace(sampling, seed=None))


class Batcher:
    """One backend's batching loop: the queued requests of every policy on it, taken oldest
    first, up to ``max_batch_size`` with the same sampling settings per batch, generated on the
    compute thread under :attr:`lock` (which weight swaps take too). Each row is sampled with
    its policy's adapter, if it has one, and its result carries its policy's version."""

    def __init__(self, backend: Backend, max_batch_size: int) -> None:
        self.backend = backend
        self.max_batch_size = max_batch_size
        self.lock = asyncio.Lock()  # one batch or one swap at a time
        self.swaps_waiting = 0  # weight swaps waiting for the lock: a running batch takes no more rows
        self.running_key: bytes | None = None  # the sampling settings of the batch running now, if rows may join it
        self._joinable = False  # a request that may join the running batch is queued (read on the compute thread)
        self._queue: deque[_Request] = deque()
        self._queued = asyncio.Event()
        self._task = asyncio.ensure_future(self._batches())
        self._task.add_done_callback(_loop_ended)

    def submit(self, requests: Sequence[_Request]) -> None:
        self._queue.extend(requests)
        if self.running_key is not None and any(r.key == self.running_key for r in requests):
            self._joinable = True
        self._queued.set()

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    def _take_batch(self, key: bytes | None = None, room: int | None = None) -> list[_Request]:
        """The oldest request and up to ``max_batch_size - 1`` more with the same settings; with
        ``key``, up to ``room`` requests of those settings (rows joining a running batch)."""
        if key is None:
            key = self._queue[0].key
        room = self.max_batch_size if room is None else room
        batch: list[_Request] = []
        rest: deque[_Request] = deque()
        while self._queue:
            r = self._queue.popleft()
            if r.future.done():  # its caller gave up (cancelled)
                continue
            (batch if r.key == key and len(batch) < room else rest).append(r)
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
            async with self.lock:
                for r in [r for r in batch if r.policy.closed]:  # released while queued: the rest go on
                    r.future.set_exception(WeightsUnavailable(f"run {r.policy.run!r}: its policy was released "
                                                              "(the run ended) before this request was sampled"))
                batch = [r for r in batch if not r.policy.closed]
                if not batch:
                    continue
                versions = [r.policy.version for r in batch]
                assert None not in versions, "sampled before the first weights were loaded"
                started = time.monotonic()
                links = [trace.Link(c) for c in {r.caller for r in batch if r.caller is not None}]
                if hasattr(self.backend, "session"):  # rows join and leave between tokens
                    with TRACER.start_as_current_span("sample batch", links=links,
                                                      attributes={"flywheel.batch_size": len(batch)}):
                        await self._continuous(batch)
                    continue
                try:
                    with TRACER.start_as_current_span("sample batch", links=links,
                                                      attributes={"flywheel.batch_size": len(batch)}):
                        completions = await self._generate(batch)
                except Exception as exc:
                    for r in batch:
                        if not r.future.done():
                            r.future.set_exception(exc)
                    continue
            elapsed_s = time.monotonic() - started
            for r, c, version in zip(batch, completions, versions, strict=True):
                if not r.future.done():
                    r.future.set_result(Sampled(c, cast(int, version), elapsed_s))

    async def _continuous(self, batch: list[_Request]) -> None:
        """Sample ``batch`` as a batch that queued requests of the same settings join between
        tokens, while there is room and no weight swap waits; each request is answered as soon
        as its row finishes (its generation time: from joining to finishing). Under the lock."""
        loop = asyncio.get_running_loop()
        key, sampling = batch[0].key, batch[0].sampling
        rows: dict[int, tuple[_Request, float, int]] = {}  # session row -> (request, joined at, version)

        def on_token(row: int, token_id: int, logprob: float) -> None:  # in the backend's thread
            stream = rows[row][0].on_token
            if stream is not None:
                loop.call_soon_threadsafe(stream, token_id, logprob)

        session = self.backend.session(sampling, on_token)  # type: ignore[attr-defined]  # checked by the caller
        waiting = batch
        try:
            while True:
                waiting = [r for r in waiting if not r.future.done()]
                if waiting:
                    adapters = [r.policy.adapter for r in waiting]
                    indices = await compute(session.add, [r.prompt for r in waiting], [r.seed for r in waiting],
                                            adapters if any(a is not None for a in adapters) else None)
                    joined = time.monotonic()
                    for i, r in zip(indices, waiting, strict=True):
                        rows[i] = (r, joined, cast(int, r.policy.version))
                if not session.num_rows:
                    return
                self.running_key = key if session.can_join else None
                self._joinable = any(r.key == key for r in self._queue)
                for i, completion in await compute(self._run, session):
                    r, joined, version = rows.pop(i)
                    if not r.future.done():
                        r.future.set_result(Sampled(completion, version, time.monotonic() - joined))
                room = self.max_batch_size - session.num_rows
                if not session.num_rows or self.swaps_waiting or not session.can_join or room <= 0:
                    waiting = []
                    if not session.num_rows:
                        return
                    continue
                waiting = [r for r in self._take_batch(key, room) if not r.policy.closed] if self._queue else []
        except Exception as exc:
            for r, _, _ in rows.values():
                if not r.future.done():
                    r.future.set_exception(exc)
            for r in waiting:
                if not r.future.done():
                    r.future.set_exception(exc)
        finally:
            self.running_key = None
            session.close()

    def _run(self, session: Any) -> list[tuple[int, Completion]]:
        """Steps of ``session`` until a row finishes, or a request that may join is queued (on the
        compute thread)."""
        while session.num_rows:
            done = session.step()
            if done or (self._joinable and session.num_rows < self.max_batch_size and not self.swaps_waiting):
                return done
        return []

    async def _generate(self, batch: list[_Request]) -> list[Completion]:
        prompts, sampling, seeds = [r.prompt for r in batch], batch[0].sampling, [r.seed for r in batch]
        streams = [r.on_token for r in batch]
        generate: Callable[..., list[Completion]] = self.backend.generate
        adapters = [r.policy.adapter for r in batch]
        if any(a is not None for a in adapters):
            generate = functools.partial(generate, adapters=adapters)
        if not any(streams):
            return await compute(generate, prompts, sampling, seeds)
        if not _takes_on_token(self.backend.generate):  # a backend of the user's own may predate streaming
            completions = await compute(generate, prompts, sampling, seeds)
            for stream, c in zip(streams, completions, strict=True):
                if stream is not None:
                    for token_id, logprob in zip(c.token_ids, c.logprobs, strict=True):
                        stream(token_id, logprob)
            return completions
        loop = asyncio.get_running_loop()

        def on_token(row: int, token_id: int, logprob: float) -> None:  # in the backend's thread
            stream = streams[row]
            if stream is not None:
                loop.call_soon_threadsafe(stream, token_id, logprob)

        return await compute(generate, prompts, sampling, seeds, on_token)


def _loop_ended(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("a batching loop died", exc_info=task.exception())


class Policy:
    def __init__(self, run: str, backend: Backend, fetch: FetchWeights, max_batch_size: int,
                 on_loaded: OnLoaded | None = None, on_error: Callable[[str], None] | None = None,
                 retry_s: Sequence[float] = (0.5, 1.0, 2.0, 4.0), batcher: Batcher | None = None,
                 adapter: str | None = None) -> None:
        """``fetch`` gets an update's verified blob; ``on_loaded(update)`` runs after each load,
        ``on_error(message)`` after each failed one; ``retry_s`` are the delays before each
        new try of a fetch that failed with :class:`TransientFetchError`. ``batcher``: the
        shared base's batching loop (``backend`` is then the run's view on that base and
        ``adapter`` the name its rows are sampled with); None: a batcher of its own on ``backend``."""
        self.run = run
        self.backend = backend
        self.adapter = adapter
        self.closed = False
        self.last_used = time.monotonic()  # when it was last asked to sample (or built)
        self.load_error: str | None = None  # why the last load failed; None once one succeeds
        self._fetch = fetch
        self._on_loaded = on_loaded
        self._on_error = on_error
        self._retry = Backoff.of(retry_s)  # the waits between fetches of one version, one a retry
        self._num_retries = len(retry_s)
        self._owns_batcher = batcher is None
        self._batcher = batcher if batcher is not None else Batcher(backend, max_batch_size)
        self._offers: dict[int, events.WeightUpdate] = {}  # version -> update, in arrival order: not tried yet
        self._offered = asyncio.Event()
        self._loaded = asyncio.Event()  # set once the first weights are loaded
        self._updating = asyncio.ensure_future(self._updates())
        self._updating.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("run %s: policy loop died", self.run, exc_info=task.exception())

    @property
    def version(self) -> int | None:
        return self.backend.version

    async def close(self) -> None:
        """Stop loading weights and release the backend (on a shared base: evict the run's adapter)."""
        self.closed = True
        self._updating.cancel()
        await asyncio.gather(self._updating, return_exceptions=True)
        if self._owns_batcher:
            await self._batcher.close()
            await compute(self.backend.close)
            return
        async with self._batcher.lock:
            await compute(self.backend.close)

    # --- weights ------------------------------------------------------------------------------

    def offer(self, update: events.WeightUpdate) -> None:
        """A weight update was seen; it will be tried unless its version is not above the loaded one."""
        if self.version is not None and update.version <= self.version:
            return
        # A later update of the same version replaces it; the oldest arrivals go first, so a
        # burst of bogus high versions cannot push out a real update that comes after them.
        self._offers.pop(update.version, None)
        self._offers[update.version] = update
        while len(self._offers) > MAX_OFFERED:
            del self._offers[next(iter(self._offers))]
        self._offered.set()

    async def wait_ready(self) -> int:
        """Wait until the run's first weights are loaded, however long; returns the loaded version."""
        await self._loaded.wait()
        assert self.version is not None
        return self.version

    def serve_as_built(self) -> None:
        """Serve the weights the backend was built with, as version 0: a model no trainer
        publishes weights for (an eval's base model, :meth:`flywheel_inference.hosting.Hosting.hosted`)."""
        if self.version is None:
            self.backend.version = 0
        self.load_error = None
        self._loaded.set()
        log.info("run %s: serving the model's own weights (as version 0)", self.run)

    async def swap(self, data: bytes, version: int) -> None:
        self._batcher.swaps_waiting += 1  # the running batch takes no more rows: it ends, then the swap
        try:
            await self._batcher.lock.acquire()
        finally:
            self._batcher.swaps_waiting -= 1
        try:
            await compute(self.backend.swap, data, version)
        finally:
            self._batcher.lock.release()

    async def load(self, update: events.WeightUpdate) -> None:
        """Fetch (retrying what is transient) and load ``update`` now; raises what failed."""
        await self.swap(await self._fetch_with_retries(update), update.version)
        self.load_error = None
        self._loaded.set()
        log.info("run %s: weights version %d loaded", self.run, update.version)

    async def _fetch_with_retries(self, update: events.WeightUpdate) -> bytes:
        def say(exc: BaseException, delay_s: float, num_failed: int) -> None:
            log.warning("run %s: weights version %d: %s; trying again in %.1fs", self.run, update.version, exc,
                        delay_s)

        return await retry(functools.partial(self._fetch, update), self._retry,
                           transient=lambda exc: isinstance(exc, TransientFetchError),
                           max_retries=self._num_retries, on_retry=say)

    async def _updates(self) -> None:
        while True:
            await self._offered.wait()
            self._offered.clear()
            while self._offers:
                update = self._offers.pop(max(self._offers))
                if self.version is not None and update.version <= self.version:
                    continue
                try:
                    await self.load(update)
                except Exception as exc:
                    self._failed(update, exc)
                    continue
                for version in [v for v in self._offers if v <= update.version]:
                    del self._offers[version]
                if self._on_loaded is not None:
                    await self._on_loaded(update)

    def _failed(self, update: events.WeightUpdate, exc: Exception) -> None:
        cause = exc.__cause__ if isinstance(exc, TransientFetchError) and exc.__cause__ is not None else exc
        now = (f"the run stays on version {self.version}" if self.version is not None
               else "the run has no weights loaded yet: its tasks wait for an update that loads")
        self.load_error = (f"weights version {update.version} ({update.uri}) could not be loaded: "
                           f"{type(cause).__name__}: {cause}; {now}")
        log.error("run %s: %s", self.run, self.load_error)
        if self._on_error is not None:
            self._on_error(self.load_error)

    # --- sampling -----------------------------------------------------------------------------

    async def sample(self, prompts: Sequence[Sequence[int]], sampling: events.Sampling,
                     seeds: Sequence[int | None] | None = None, on_token: OnToken | None = None) -> list[Sampled]:
        """Sample one completion per prompt, batched with whatever else is queued for the run;
        ``on_token(i, token_id, logprob)`` is called with prompt i's tokens as they are sampled.

        Raises ValueError (see :meth:`check`) and :class:`WeightsUnavailable` (see
        :meth:`check_ready`) before anything is queued, so a bad request never fails the batch
        it would join.
        """
        self.check(prompts, sampling)
        self.check_ready()
        self.last_used = time.monotonic()
        seeds = seeds if seeds is not None else [None if sampling.seed is None else sampling.seed + i
                                                 for i in range(len(prompts))]
        loop = asyncio.get_running_loop()
        key = _batch_key(sampling)
        caller = trace.get_current_span().get_span_context()
        requests = [_Request(self, p, sampling, key, s, loop.create_future(),
                             None if on_token is None else functools.partial(on_token, i),
                             caller if caller.is_valid else None)
                    for i, (p, s) in enumerate(zip(prompts, seeds, strict=True))]
        self._batcher.submit(requests)
        return list(await asyncio.gather(*(r.future for r in requests)))

    def check_ready(self) -> None:
        """:class:`WeightsUnavailable`, saying what the run waits for, while it has no weights."""
        if self.version is None:
            why = f" (the last update failed: {self.load_error})" if self.load_error else ""
            raise WeightsUnavailable(f"run {self.run!r}: no weights loaded yet{why}; waiting for the trainer's "
                                     "weights (version 0 comes after its warm-up)")

    def check(self, prompts: Sequence[Sequence[int]], sampling: events.Sampling) -> None:
        """ValueError, naming the field, for settings or prompts this model cannot sample."""
        sampling.check()
        limit = self.backend.max_positions
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompts[{i}] is empty: a completion needs at least one prompt token")
            if limit is not None and len(prompt) + sampling.max_tokens > limit:
                raise ValueError(f"sampling.max_tokens={sampling.max_tokens} plus the prompt ({len(prompt)} tokens) "
                                 f"exceeds the model's context of {limit} positions")


def _takes_on_token(generate: Callable[..., object]) -> bool:
    return any(p.name == "on_token" or p.kind is p.VAR_KEYWORD for p in inspect.signature(generate).parameters.values())
