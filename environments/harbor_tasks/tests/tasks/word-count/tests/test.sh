#!/bin/bash
# Compares /app/count.txt with the expected count ([verifier] env) and writes reward.json:
# "reward" and a second number, as a verifier with several criteria does.
mkdir -p /logs/verifier
python3 - <<'PY'
import json
import os
from pathlib import Path

expected = int(os.environ["EXPECTED"])
try:
    given = int(Path("/app/count.txt").read_text().strip())
except (OSError, ValueError):
    given = None
off_by = abs(given - expected) if given is not None else -1
rewards = {"reward": float(given == expected), "off_by": float(off_by), "note": "not a number: ignored"}
Path("/logs/verifier/reward.json").write_text(json.dumps(rewards))
PY
