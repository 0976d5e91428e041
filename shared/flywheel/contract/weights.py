"""Weight blobs: where the trainer puts them and how inference gets them back, verified.

A :class:`flywheel.contract.events.WeightUpdate` carries a URI, a sha256 and a size, never the
weights themselves. By default blobs live in the JetStream object store ``flywheel-weights``,
one object a version of a run (``nats-os://flywheel-weights/<run>/<version>.safetensors``), so a
deployment needs nothing but NATS; with a folder (the trainer setting ``weights_dir``, which
``flywheel up`` sets on one machine) they are files, ``<folder>/<run>/<version>.safetensors``
(``file://`` URIs), written whole before their update is published, for a folder every
inference process sees at that path. The trainer keeps the last few versions of its run (the
trainer setting ``weight_versions_kept``; :func:`delete` purges older ones as it publishes): a
version is a full copy of the model, and a purged version frees its disk (the operator makes
the bucket once, with the streams: no service may make one). Readers go by the URI, whatever
the store (:func:`get`, :func:`kept_updates`). Not covered: ``s3://`` (add a reader to ``READERS``).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import nats.js.errors
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_META_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE

from flywheel.contract import events
from flywheel.contract.bus import WEIGHTS_BUCKET, Bus
from flywheel.contract.names import path_name


def _name(version: int) -> str:
    return f"{version:08d}.safetensors"


def _object(run: str, version: int) -> str:
    """The object of ``run``'s weights at ``version`` in the bucket."""
    return f"{run}/{_name(version)}"


def _write_whole(path: Path, data: bytes) -> None:
    """``data`` at ``path``, renamed into place: a reader sees no file or the whole of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


async def put(bus: Bus, run: str, version: int, data: bytes, folder: Path | None = None) -> tuple[str, str, int]:
    """Store ``data`` as the weights of ``run`` at ``version``, in the weights bucket or, given a
    ``folder`` (``weights_dir``), as a file there; returns (uri, sha256, size_bytes)."""
    if folder is not None:
        path = (folder / path_name(run) / _name(version)).absolute()
        await asyncio.to_thread(_write_whole, path, data)  # a big model's file takes a while: off the loop
        return path.as_uri(), hashlib.sha256(data).hexdigest(), len(data)
    store = await bus.weights_store()
    name = _object(run, version)
    await bus.retry(lambda: store.put(name, data))  # a put again replaces the object whole
    return f"nats-os://{WEIGHTS_BUCKET}/{name}", hashlib.sha256(data).hexdigest(), len(data)


async def delete(bus: Bus, run: str, version: int, folder: Path | None = None) -> bool:
    """Purge the weights of ``run`` at ``version``, chunks and metadata both (the object
    store's own delete leaves a tombstone, a live message that keeps the stream's head, and
    so its disk, where it is), or its file in ``folder``; False when there were none (never
    put, or purged already)."""
    if folder is not None:
        try:
            (folder / path_name(run) / _name(version)).unlink()
        except FileNotFoundError:
            return False
        return True
    name = _object(run, version)
    try:
        store = await bus.weights_store()
        info = await bus.retry(lambda: store.get_info(name))
    except nats.js.errors.NotFoundError:
        return False
    stream = OBJ_STREAM_TEMPLATE.format(bucket=WEIGHTS_BUCKET)
    meta = OBJ_META_PRE_TEMPLATE.format(bucket=WEIGHTS_BUCKET, obj=base64.urlsafe_b64encode(name.encode()).decode())
    chunks = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=WEIGHTS_BUCKET, obj=info.nuid)
    await bus.retry(lambda: bus.js.purge_stream(stream, subject=meta))  # first: no reader finds it half gone
    await bus.retry(lambda: bus.js.purge_stream(stream, subject=chunks))
    return True


async def versions(bus: Bus, run: str, folder: Path | None = None) -> list[int]:
    """The versions of ``run`` in the bucket (or its files in ``folder``), ascending (none: ``[]``)."""
    if folder is not None:
        names = [p.name.split(".", 1)[0] for p in (folder / path_name(run)).glob("*.safetensors")]
        return sorted(int(n) for n in names if n.isdigit())
    try:
        store = await bus.weights_store()
        infos = await bus.retry(lambda: store.list(ignore_deletes=True))
    except nats.js.errors.NotFoundError:  # nats-py's "no objects" too
        return []
    names = [info.name.removeprefix(f"{run}/").split(".", 1)[0] for info in infos
             if info.name.startswith(f"{run}/") and "/" not in info.name.removeprefix(f"{run}/")]
    return sorted(int(n) for n in names if n.isdigit())


async def updates(bus: Bus, run: str, newest: int | None = None) -> list[events.WeightUpdate]:
    """The run's weight updates in the WEIGHTS stream, by version, the ``newest`` of them (None:
    all; one per version, the last published). What does not decode is skipped: the weights
    watchers dead-letter it."""
    from nats.js.api import ConsumerConfig, DeliverPolicy

    from flywheel.contract.bus import Undecodable, decode_message

    subject = f"weights.{run}"
    info = await bus.js.stream_info("WEIGHTS", subjects_filter=subject)
    if not (info.state.subjects or {}).get(subject):
        return []
    decoder: events.Decoder[events.WeightUpdate] = events.Decoder(events.WeightUpdate)
    found: dict[int, events.WeightUpdate] = {}
    sub = await bus.js.subscribe(subject, stream="WEIGHTS", ordered_consumer=True,
                                 config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
    try:
        while True:
            msg = await sub.next_msg(timeout=bus.config.request_timeout_s)
            try:
                update = decode_message(decoder, msg)
            except Undecodable:
                pass
            else:
                found[update.version] = update
            if msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    ordered = sorted(found.values(), key=lambda u: u.version)
    return ordered if newest is None else ordered[-newest:]


async def _read_object_store(bus: Bus, uri: str) -> bytes:
    parsed = urlparse(uri)
    if parsed.netloc != WEIGHTS_BUCKET:
        raise ValueError(f"weights uri {uri!r}: bucket {parsed.netloc!r} is not Flywheel's weights bucket "
                         f"({WEIGHTS_BUCKET})")
    store = await bus.weights_store()
    # nats-py joins an object's chunks with bytes += (quadratic: minutes, the event loop held, for
    # the 538 MB of SmolLM2-135M); written into a buffer a chunk at a time it is linear.
    buffer = io.BytesIO()
    await store.get(parsed.path.lstrip("/"), writeinto=buffer)
    return buffer.getvalue()


def file_of(uri: str) -> Path:
    """The file a ``file://`` URI names (``Path.as_uri`` quotes: a run's ``%2F`` is ``%252F`` there)."""
    return Path(url2pathname(urlparse(uri).path))


async def _read_file(bus: Bus, uri: str) -> bytes:
    return await asyncio.to_thread(file_of(uri).read_bytes)


async def kept_updates(bus: Bus, updates: list[events.WeightUpdate]) -> list[events.WeightUpdate]:
    """Those of ``updates`` (of one run) whose blob is still kept: in the bucket, or as its file."""
    in_bucket: set[int] | None = None
    kept = []
    for update in updates:
        parsed = urlparse(update.uri)
        if parsed.scheme == "file":
            if file_of(update.uri).exists():
                kept.append(update)
            continue
        if in_bucket is None:
            in_bucket = set(await versions(bus, update.run))
        if update.version in in_bucket:
            kept.append(update)
    return kept


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
