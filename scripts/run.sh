#!/usr/bin/env bash
# Set up, then the main job: train the tiny model to reverse text with asynchronous RL on
# this machine (the embedded stack starts and stops by itself). Extra arguments go to
# `flywheel run`, e.g. --set trainer.num_steps=100.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/flywheel run examples/reverse-text.toml "$@"
