#!/usr/bin/env bash
# Set up, then run the default test suite (everything not marked slow, gpu or docker).
#   scripts/test.sh            the default suite
#   scripts/test.sh --slow     only the slow tier
#   scripts/test.sh -k bus     extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
markers="not slow and not gpu and not docker"
if [ "${1:-}" = "--slow" ]; then
    markers="slow and not gpu and not docker"
    shift
fi
# pytest exits 5 when no test ran; that is a failure here, and `set -e` makes it one.
exec .venv/bin/python -m pytest -m "$markers" "$@"
