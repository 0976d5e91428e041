"""The model relay's folders: a relay left by a killed process is swept; a live one is kept."""

from __future__ import annotations

import socket
from pathlib import Path

from flywheel.runtime import relay


def dead_relay_folder(parent: Path, name: str) -> Path:
    """A relay folder as a SIGKILLed service leaves it: a socket file nothing listens on."""
    folder = parent / f"{relay.PREFIX}{name}"
    folder.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(folder / relay.SOCKET_NAME))
    return folder


async def test_folders_of_dead_relays_go_and_live_ones_stay(tmp_path: Path) -> None:
    dead = dead_relay_folder(tmp_path, "dead")
    unrelated = tmp_path / "flywheel-other"
    unrelated.mkdir()
    young = tmp_path / f"{relay.PREFIX}starting"  # a relay between its folder and its socket
    young.mkdir()
    live = await relay.open_relay("http://127.0.0.1:9/v1", 5.0, str(tmp_path / "first"))
    try:
        (tmp_path / "first" / "x").mkdir()  # a later parent, swept when its first relay opens
        dead_in_first = dead_relay_folder(tmp_path / "first", "dead")
        other = await relay.open_relay("http://127.0.0.1:9/v1", 5.0, str(tmp_path))
        try:
            assert not dead.exists() and young.exists() and unrelated.exists()
            assert live.folder.exists() and other.folder.exists()
            # Once a process for each parent: a folder left after the sweep stays until the next process.
            assert dead_in_first.exists()
        finally:
            await other.close()
    finally:
        await live.close()
    assert not live.folder.exists()
