"""Weight blobs through the JetStream object store, verified on the way back."""

from __future__ import annotations

import msgspec
import nats.js.errors
import pytest

from flywheel.contract import events, weights
from flywheel.contract.bus import Bus


async def test_put_then_get_verifies_the_blob(bus: Bus) -> None:
    data = b"\x01" * 300_000
    uri, sha, size = await weights.put(bus, "run-1", 3, data)
    update = events.WeightUpdate(run="run-1", version=3, uri=uri, sha256=sha, size_bytes=size)
    assert uri == "nats-os://flywheel-weights-run-1/00000003.safetensors"  # one bucket a run
    assert await weights.get(bus, update) == data
    with pytest.raises(ValueError, match="sha256"):
        await weights.get(bus, msgspec.structs.replace(update, sha256="0" * 64))
    with pytest.raises(ValueError, match="bytes"):
        await weights.get(bus, msgspec.structs.replace(update, size_bytes=1))
    with pytest.raises(ValueError, match="scheme"):
        await weights.get(bus, msgspec.structs.replace(update, uri="s3://bucket/x"))
    with pytest.raises(ValueError, match="not a Flywheel weights bucket"):
        await weights.get(bus, msgspec.structs.replace(update, uri="nats-os://KV_flywheel-runs/x"))


async def test_delete_purges_a_version_and_leaves_the_others(bus: Bus) -> None:
    updates = []
    for version in (0, 1):
        uri, sha, size = await weights.put(bus, "run-2", version, bytes([version]) * 200_000)
        updates.append(events.WeightUpdate(run="run-2", version=version, uri=uri, sha256=sha, size_bytes=size))
    before = (await bus.js.stream_info("OBJ_flywheel-weights-run-2")).state
    assert await weights.delete(bus, "run-2", 0)
    after = (await bus.js.stream_info("OBJ_flywheel-weights-run-2")).state
    # Chunks and metadata gone, no tombstone left: the stream's head moves past them, which
    # is where JetStream frees disk.
    per_version = before.messages // 2
    assert after.messages == per_version and after.first_seq == per_version + 1
    assert after.bytes < before.bytes - 190_000
    with pytest.raises(nats.js.errors.NotFoundError):
        await weights.get(bus, updates[0])
    assert await weights.get(bus, updates[1]) == b"\x01" * 200_000
    assert await weights.versions(bus, "run-2") == [1]
    assert await weights.versions(bus, "no-such-run") == []
    assert not await weights.delete(bus, "run-2", 0)  # gone already
    assert not await weights.delete(bus, "run-2", 7)  # never put
