"""Weight blobs through the JetStream object store, verified on the way back."""

from __future__ import annotations

import msgspec
import pytest

from flywheel.contract import events, weights
from flywheel.contract.bus import Bus


async def test_put_then_get_verifies_the_blob(bus: Bus) -> None:
    data = b"\x01" * 300_000
    uri, sha, size = await weights.put(bus, "run-1", 3, data)
    update = events.WeightUpdate(run="run-1", version=3, uri=uri, sha256=sha, size_bytes=size)
    assert uri == "nats-os://flywheel-weights/run-1/00000003.safetensors"
    assert await weights.get(bus, update) == data
    with pytest.raises(ValueError, match="sha256"):
        await weights.get(bus, msgspec.structs.replace(update, sha256="0" * 64))
    with pytest.raises(ValueError, match="bytes"):
        await weights.get(bus, msgspec.structs.replace(update, size_bytes=1))
    with pytest.raises(ValueError, match="scheme"):
        await weights.get(bus, msgspec.structs.replace(update, uri="s3://bucket/x"))
