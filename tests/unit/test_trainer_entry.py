"""The trainer's entry point stays thin: ``--help`` and importing it pull in no torch."""

from __future__ import annotations

import subprocess
import sys


def test_entry_point_defers_heavy_imports() -> None:
    code = ("import sys, flywheel_trainer.__main__\n"
            "print(','.join(sorted({'torch', 'transformers', 'deepspeed', 'nats'} & set(sys.modules))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
    help_text = subprocess.run([sys.executable, "-m", "flywheel_trainer", "--help"], capture_output=True, text=True,
                               check=True).stdout
    assert "--run" in help_text


def test_run_is_required() -> None:
    out = subprocess.run([sys.executable, "-m", "flywheel_trainer"], capture_output=True, text=True, check=False)
    assert out.returncode == 2 and "--run" in out.stderr
