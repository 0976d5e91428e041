"""Weight blobs: where the trainer puts them and how inference gets them back, verified.

A :class:`flywheel.contract.events.WeightUpdate` carries a URI, a sha256 and a size, never the
weights themselves. By default blobs live in the JetStream object store bucket
``flywheel-weights`` (``nats-os://flywheel-weights/<run>/<version>.safetensors``), so the
embedded stack needs nothing but NATS; ``file://`` URIs serve a volume shared by trainer
and inference. The trainer keeps the last few versions of its run in the bucket
(:func:`delete` drops older ones as it publishes; the trainer setting
``weight_versions_kept``): a version is a full copy of the model, so a run of many steps
would otherwise fill the disk. Not covered: ``s3://`` (add a reader to ``READERS``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import urlparse

import nats.js.errors

from flywheel.contract import events
from flywheel.contract.bus import WEIGHTS_BUCKET, Bus


def _name(run: str, version: int) -> str:
    return f"{run}/{version:08d}.safetensors"


async def put(bus: Bus, run: str, version: int, data: bytes) -> tuple[str, str, int]:
    """Store ``data`` as the weights of ``run`` at ``version``; returns (uri, sha256, size_bytes)."""
    name = _name(run, version)
    store = await bus.weights_store()
    await bus.retry(lambda: store.put(name, data))  # a put again replaces the object whole
    return f"nats-os://{WEIGHTS_BUCKET}/{name}", hashlib.sha256(data).hexdigest(), len(data)


async def delete(bus: Bus, run: str, version: int) -> bool:
    """Drop the weights of ``run`` at ``version`` from the bucket (their chunks are purged);
    False when there were none (never put, or dropped already)."""
    store = await bus.weights_store()
    try:
        await bus.retry(lambda: store.delete(_name(run, version)))
    except nats.js.errors.NotFoundError:
        return False
    return True


async def _read_object_store(bus: Bus, uri: str) -> bytes:
    parsed = urlparse(uri)
    if parsed.netloc != WEIGHTS_BUCKET:
        raise ValueError(f"weights uri {uri!r}: bucket {parsed.netloc!r} is not {WEIGHTS_BUCKET!r}")
    store = await bus.weights_store()
    result = await store.get(parsed.path.lstrip("/"))
    return result.data or b""


async def _read_file(bus: Bus, uri: str) -> bytes:
    return Path(urlparse(uri).path).read_bytes()


READERS: dict[str, Callable[[Bus, str], Awaitable[bytes]]] = {"nats-os": _read_object_store, "file": _read_file}


async def get(bus: Bus, update: events.WeightUpdate) -> bytes:
    """The blob of ``update``, checked against its size and sha256 before anyone loads it."""
    scheme = urlparse(update.uri).scheme
    if scheme not in READERS:
        raise ValueError(f"weights uri {update.uri!r}: scheme {scheme!r} is not one of {', '.join(READERS)}")
    data = await READERS[scheme](bus, update.uri)
    if len(data) != update.size_bytes:
        raise ValueError(f"weights {update.uri}: {len(data)} bytes, the update says {update.size_bytes}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != update.sha256:
        raise ValueError(f"weights {update.uri}: sha256 {digest} does not match the update's {update.sha256}")
    return data
