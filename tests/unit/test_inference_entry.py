"""The inference entry point stays thin: ``--help`` imports no engine, client or server."""

from __future__ import annotations

import re
import subprocess
import sys

HEAVY = {"torch", "transformers", "fastapi", "uvicorn", "nats"}


def test_help_imports_nothing_heavy() -> None:
    # -X importtime lists every module the --help run imported, on stderr.
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "flywheel_inference", "--help"],
                         capture_output=True, text=True, check=True)
    imported = {m.group(1).split(".")[0] for m in re.finditer(r"\|\s+([\w.]+)\s*$", out.stderr, re.M)}
    assert "argparse" in imported and not HEAVY & imported, sorted(HEAVY & imported)
    assert "--port" in out.stdout and "inference_port" in out.stdout
