"""Weight blobs through the JetStream object store or a folder of files, verified on the way back."""

from __future__ import annotations

from pathlib import Path

import msgspec
import nats.js.errors
import pytest

from flywheel.contract import events, weights
from flywheel.contract.bus import Bus


async def test_put_then_get_verifies_the_blob(bus: Bus) -> None:
    data = b"\x01" * 300_000
    uri, sha, size = await weights.put(bus, "run-1", 3, data)
    update = events.WeightUpdate(run="run-1", version=3, uri=uri, sha256=sha, size_bytes=size)
    assert uri == "nats-os://flywheel-weights/run-1/00000003.safetensors"  # one bucket, an object a version
    assert await weights.get(bus, update) == data
    with pytest.raises(ValueError, match="sha256"):
        await weights.get(bus, msgspec.structs.replace(update, sha256="0" * 64))
    with pytest.raises(ValueError, match="bytes"):
        await weights.get(bus, msgspec.structs.replace(update, size_bytes=1))
    with pytest.raises(ValueError, match="scheme"):
        await weights.get(bus, msgspec.structs.replace(update, uri="s3://bucket/x"))
    with pytest.raises(ValueError, match="not Flywheel's weights bucket"):
        await weights.get(bus, msgspec.structs.replace(update, uri="nats-os://KV_flywheel-runs/x"))


async def test_delete_purges_a_version_and_leaves_the_others(bus: Bus) -> None:
    updates = []
    for version in (0, 1):
        uri, sha, size = await weights.put(bus, "run-2", version, bytes([version]) * 200_000)
        updates.append(events.WeightUpdate(run="run-2", version=version, uri=uri, sha256=sha, size_bytes=size))
        await weights.put(bus, "run-2/other", version, b"\xff" * 1000)  # another run's, between them
    before = (await bus.js.stream_info("OBJ_flywheel-weights")).state
    assert await weights.delete(bus, "run-2", 0)
    after = (await bus.js.stream_info("OBJ_flywheel-weights")).state
    # Chunks and metadata gone, no tombstone left: what the version held is freed, wherever it
    # was in the stream.
    # (A version of 200 KB is two chunks and its metadata, the stream's first three messages.)
    assert after.messages == before.messages - 3 and not after.num_deleted and after.first_seq == 4
    assert after.bytes < before.bytes - 190_000
    with pytest.raises(nats.js.errors.NotFoundError):
        await weights.get(bus, updates[0])
    assert await weights.get(bus, updates[1]) == b"\x01" * 200_000
    assert await weights.versions(bus, "run-2") == [1]
    assert await weights.versions(bus, "run-2/other") == [0, 1]
    assert await weights.versions(bus, "no-such-run") == []
    assert not await weights.delete(bus, "run-2", 0)  # gone already
    assert not await weights.delete(bus, "run-2", 7)  # never put


async def test_a_folder_keeps_versions_as_files_that_readers_find_by_their_uri(bus: Bus, tmp_path: Path) -> None:
    folder = tmp_path / "weights"
    updates = []
    for version in (0, 1, 2):
        uri, sha, size = await weights.put(bus, "run-3", version, bytes([version]) * 100_000, folder)
        updates.append(events.WeightUpdate(run="run-3", version=version, uri=uri, sha256=sha, size_bytes=size))
    assert updates[1].uri == (folder / "run-3" / "00000001.safetensors").as_uri()
    assert await weights.get(bus, updates[1]) == b"\x01" * 100_000  # read by its URI alone, verified
    with pytest.raises(ValueError, match="sha256"):
        await weights.get(bus, msgspec.structs.replace(updates[1], sha256="0" * 64))
    assert sorted(p.name for p in (folder / "run-3").iterdir()) == [  # whole files, no temporary left
        "00000000.safetensors", "00000001.safetensors", "00000002.safetensors"]
    assert await weights.delete(bus, "run-3", 0, folder) and not await weights.delete(bus, "run-3", 0, folder)
    assert await weights.versions(bus, "run-3", folder) == [1, 2]
    assert await weights.versions(bus, "run-4", folder) == []  # no files of that run
    assert await weights.versions(bus, "run-3") == []  # and nothing in its bucket
    # What readers keep: a file that is there; an object in the bucket.
    in_bucket = await weights.put(bus, "run-3", 9, b"\x09" * 1000)
    bucket_update = events.WeightUpdate(run="run-3", version=9, uri=in_bucket[0], sha256=in_bucket[1],
                                        size_bytes=in_bucket[2])
    kept = await weights.kept_updates(bus, [*updates, bucket_update])
    assert [u.version for u in kept] == [1, 2, 9]
