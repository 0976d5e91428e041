#!/usr/bin/env bash
# Set up, then start the embedded stack on this machine (Ctrl-C stops it all).
# Extra arguments go to `flywheel up`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/flywheel up "$@"
