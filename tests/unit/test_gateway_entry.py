"""The gateway's entry point stays thin, and the recorder's config refuses unknown streams."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flywheel.contract.settings import RecorderSettings
from flywheel_gateway import recorder


def test_entry_point_defers_heavy_imports() -> None:
    code = ("import sys, flywheel_gateway.__main__ as m\n"
            "heavy = sorted({'fastapi', 'uvicorn', 'sqlalchemy', 'alembic', 'nats'} & set(sys.modules))\n"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
    help_text = subprocess.run([sys.executable, "-m", "flywheel_gateway", "--help"], capture_output=True, text=True,
                               check=True).stdout
    assert "api" in help_text and "recorder" in help_text


def test_recorder_refuses_unknown_streams() -> None:
    with pytest.raises(ValueError, match=r"streams: \['BOGUS'\] are not Flywheel streams"):
        recorder.build(None, None, RecorderSettings(),  # type: ignore[arg-type]  # refused before bus or store is used
                       streams=("TASKS", "BOGUS"))
