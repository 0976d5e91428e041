"""A run's policy and its weight loads, with a fake backend and a fake fetch: a failed load
leaves the run on its weights, a later update above them still loads, a transient fetch
failure is tried again with backoff, a blob that does not verify is not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from flywheel.contract import events
from flywheel_inference.completion import Completion, OnRowToken
from flywheel_inference.policy import Batcher, Policy, TransientFetchError, WeightsUnavailable
from tests.backend_checks import PROMPTS
from tests.helpers import until

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class FakeBackend:
    """Loads any blob but b"broken"; samples one token."""

    tokenizer: PreTrainedTokenizerBase  # left unset: the policy never reads it
    max_positions: int | None = None

    def __init__(self) -> None:
        self.version: int | None = None

    def swap(self, data: bytes, version: int) -> None:
        if data == b"broken":
            raise ValueError("not a safetensors file")
        self.version = version

    def generate(self, prompts: Sequence[Sequence[int]], sampling: events.Sampling,
                 seeds: Sequence[int | None] | None = None, on_token: OnRowToken | None = None) -> list[Completion]:
        if on_token is not None:
            for row in range(len(prompts)):
                on_token(row, 1, 0.0)
        return [Completion([1], [0.0], "length", "x") for _ in prompts]

    def close(self) -> None:
        pass


@dataclass
class FakeStore:
    """Blobs by URI; ``failures[uri]`` are raised, one per fetch, before the blob is returned."""

    blobs: dict[str, bytes] = field(default_factory=dict)
    failures: dict[str, list[Exception]] = field(default_factory=dict)
    fetched: list[str] = field(default_factory=list)

    async def fetch(self, update: events.WeightUpdate) -> bytes:
        self.fetched.append(update.uri)
        if self.failures.get(update.uri):
            raise self.failures[update.uri].pop(0)
        if update.uri not in self.blobs:
            raise ValueError(f"weights {update.uri}: sha256 does not match")
        return self.blobs[update.uri]


def update(version: int, uri: str | None = None) -> events.WeightUpdate:
    return events.WeightUpdate(run="r", version=version, uri=uri or f"mem://{version}", sha256="0" * 64, size_bytes=1)


@pytest.fixture
def store() -> FakeStore:
    return FakeStore(blobs={f"mem://{v}": b"weights" for v in range(4)})


@pytest.fixture
def errors() -> list[str]:
    """What the policy reported through on_error."""
    return []


@pytest.fixture
async def policy(store: FakeStore, errors: list[str]) -> AsyncIterator[Policy]:
    p = Policy("r", FakeBackend(), store.fetch, max_batch_size=4, on_error=errors.append, retry_s=(0.01, 0.01, 0.01))
    yield p
    await p.close()


SAMPLING = events.Sampling(max_tokens=1)


async def test_a_bogus_update_leaves_the_run_on_its_weights_and_a_later_lower_one_loads(
        policy: Policy, errors: list[str]) -> None:
    policy.offer(update(0))
    await until(lambda: policy.version == 0, what="version 0")
    policy.offer(update(10**9, "mem://bogus"))
    await until(lambda: policy.load_error is not None, what="the failed load")
    assert policy.load_error is not None
    assert "weights version 1000000000 (mem://bogus)" in policy.load_error
    assert "sha256" in policy.load_error and "stays on version 0" in policy.load_error
    assert errors == [policy.load_error]
    (sampled,) = await policy.sample([[5]], SAMPLING)  # sampling goes on, on the weights it has
    assert sampled.version == 0
    policy.offer(update(1))
    await until(lambda: policy.version == 1, what="version 1, below the bogus one")
    assert policy.load_error is None


async def test_the_newest_of_a_burst_that_fails_falls_back_to_the_next_newest(
        policy: Policy, store: FakeStore) -> None:
    store.blobs["mem://broken"] = b"broken"  # verifies, does not load
    for u in (update(1), update(2), update(3, "mem://broken")):
        policy.offer(u)
    await until(lambda: policy.version == 2, what="version 2")
    assert store.fetched == ["mem://broken", "mem://2"]  # version 1 was never needed
    assert policy.load_error is None


async def test_a_transient_fetch_failure_is_tried_again_and_a_bad_blob_is_not(
        policy: Policy, store: FakeStore) -> None:
    store.failures["mem://0"] = [TransientFetchError("server restarting")] * 2
    policy.offer(update(0))
    await until(lambda: policy.version == 0, what="version 0 after two failed tries")
    assert store.fetched == ["mem://0"] * 3

    store.failures["mem://1"] = [TransientFetchError("timeout")] * 4  # one more than retry_s allows
    policy.offer(update(1))
    await until(lambda: policy.load_error is not None, what="version 1 given up")
    assert policy.load_error is not None
    assert store.fetched.count("mem://1") == 4 and "timeout" in policy.load_error

    policy.offer(update(5, "mem://missing"))
    await until(lambda: "version 5" in (policy.load_error or ""), what="version 5 failed")
    assert store.fetched.count("mem://missing") == 1  # does not verify: not tried again
    assert policy.version == 0


async def test_without_weights_a_failure_is_reported_and_sampling_says_why(policy: Policy) -> None:
    policy.offer(update(0, "mem://bogus"))
    await until(lambda: policy.load_error is not None, what="the failed load")
    assert policy.load_error is not None
    assert "no weights loaded yet" in policy.load_error
    with pytest.raises(WeightsUnavailable, match=r"weights version 0 .*mem://bogus"):
        await policy.sample([[5]], SAMPLING)
    policy.offer(update(0))  # the real version 0, published after a bogus one of the same number
    assert await policy.wait_ready() == 0


async def test_a_flood_of_bogus_versions_does_not_push_out_a_real_update_that_comes_after(
        policy: Policy, store: FakeStore) -> None:
    policy.offer(update(0))
    await until(lambda: policy.version == 0, what="version 0")
    for i in range(50):
        policy.offer(update(10**9 + i, f"mem://bogus-{i}"))
    policy.offer(update(1))
    await until(lambda: policy.version == 1, what="version 1, after the flood")
    assert len(store.fetched) <= 1 + 8  # version 0, then at most the last few offered


class SharedFakeBackend(FakeBackend):
    """Records the adapters of each batch; row i's token is the length of its adapter's name."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[str | None]] = []

    def generate(self, prompts: Sequence[Sequence[int]], sampling: events.Sampling,
                 seeds: Sequence[int | None] | None = None, on_token: OnRowToken | None = None,
                 adapters: Sequence[str | None] | None = None) -> list[Completion]:
        names: list[str | None] = list(adapters) if adapters is not None else [None] * len(prompts)
        self.batches.append(names)
        return [Completion([len(n or "")], [0.0], "length", "x") for n in names]


async def test_runs_on_one_batcher_batch_together_each_with_its_adapter_and_version(store: FakeStore) -> None:
    shared = SharedFakeBackend()
    batcher = Batcher(shared, max_batch_size=8)
    short, long = (Policy(name, FakeBackend(), store.fetch, 8, batcher=batcher, adapter=name)
                   for name in ("a", "bbb"))
    short.offer(update(0))
    long.offer(update(2))
    await until(lambda: (short.version, long.version) == (0, 2), what="both runs' weights")
    out = await asyncio.gather(short.sample([[5], [6]], SAMPLING), long.sample([[7]], SAMPLING))
    assert shared.batches == [["a", "a", "bbb"]]  # one batch, each row with its run's adapter
    assert [(s.completion.token_ids, s.version) for s in out[0] + out[1]] == [([1], 0), ([1], 0), ([3], 2)]
    # A run released while its rows wait: they fail, saying so; the other run's rows are sampled.
    pending = asyncio.ensure_future(short.sample([[5]], SAMPLING))
    kept = asyncio.ensure_future(long.sample([[7]], SAMPLING))
    await short.close()
    with pytest.raises(WeightsUnavailable, match="'a': its policy was released"):
        await pending
    assert (await kept)[0].completion.token_ids == [3]
    await long.close()
    await batcher.close()


async def test_a_request_joins_the_batch_running_on_the_transformers_backend(tiny_model_dir: Path) -> None:
    """Continuous batching: a request queued while a batch of the same settings runs joins it
    between tokens (its first token comes before the running row's last), and each row is
    answered when it finishes."""
    from flywheel_inference.backends import TransformersBackend

    backend = TransformersBackend.build(tiny_model_dir, "float32")
    backend.version = 0  # as if version 0 were loaded

    async def no_fetch(u: events.WeightUpdate) -> bytes:
        raise AssertionError("no weights are fetched here")

    policy = Policy("r", backend, no_fetch, max_batch_size=8)
    sampling = events.Sampling(max_tokens=48, seed=3)
    order: list[str] = []
    first = asyncio.ensure_future(policy.sample([PROMPTS[0]], sampling, on_token=lambda i, t, lp: order.append("a")))
    await until(lambda: len(order) >= 3, what="the first request's batch running")
    second = asyncio.ensure_future(policy.sample([PROMPTS[1]], sampling, on_token=lambda i, t, lp: order.append("b")))
    (a,), (b,) = await first, await second
    assert a.completion.finish_reason == "length"  # it ran all along (no early EOS at this seed)
    last_a = len(order) - 1 - order[::-1].index("a")
    assert order.index("b") < last_a, order
    assert order.count("b") == len(b.completion.token_ids) and b.version == 0
    await policy.close()
