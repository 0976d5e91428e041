#!/usr/bin/env bash
# Create .venv-trl: Hugging Face TRL (GRPOTrainer) on CPU, the baseline that
# benchmarks/trl_grpo.py runs. A venv of its own, with nothing of Flywheel in it, so the
# baseline measures TRL alone. Safe to run again: it only installs what is missing or changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv-trl
PIP=("$VENV/bin/python" -m pip --quiet --disable-pip-version-check)
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
    "${PIP[@]}" install --upgrade pip
fi
# Fast path: everything already there (the marker records this script's contents).
stamp="$VENV/.flywheel-setup"
want="$(sha256sum scripts/setup-trl.sh | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "import trl" 2>/dev/null; then
    exit 0
fi
# torch first, pinned: the same CPU build as .venv; an open range can pull a CUDA build.
"${PIP[@]}" install "torch==2.13.0"
# Every version pinned, so the baseline does not move under the comparison. transformers,
# accelerate and datasets are the versions .venv has (trl 1.16.0 accepts them), so both
# sides run the same model code.
"${PIP[@]}" install "torch==2.13.0" "trl==1.16.0" "transformers==5.24.0" \
    "accelerate==1.15.0" "datasets==5.2.0"
# reasoning-gym, the version .venv has (pyproject's "reasoning" extra): the TRL side of a
# comparison on a reasoning task scores with the same task generators and score_answer.
"${PIP[@]}" install "reasoning-gym==0.1.25"
"$VENV/bin/python" -c "import trl, reasoning_gym"
echo "$want" > "$stamp"
