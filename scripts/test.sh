#!/usr/bin/env bash
# Set up, then run the default test suite (everything not marked slow, long, gpu, docker, vllm or browser).
#   scripts/test.sh            the default suite
#   scripts/test.sh --long     only the long tier (end-to-end fault and recovery checks; CI runs it)
#   scripts/test.sh --slow     only the slow tier (the end-to-end learning runs), two test files at a time: its
#                              runs wait on their processes more than they compute
#   scripts/test.sh --slow-ci  the slow tier as CI runs it: without the tests marked outside_ci (each says why)
#   scripts/test.sh --vllm     only the vLLM tier, in .venv-vllm (scripts/setup-vllm.sh)
#   scripts/test.sh --docker   only the docker tier: a private Docker engine (root; scripts/setup-docker.sh
#                              installs it), the compose deployment brought up and torn down
#   scripts/test.sh --browser  only the browser tier: the web pages in Debian's headless Chromium, driven by
#                              Playwright (scripts/setup-browser.sh installs both; chromium needs root)
#   scripts/test.sh -k bus     extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--vllm" ]; then
    shift
    scripts/setup-vllm.sh
    # Only tests/vllm: the rest of the tree needs extras (gateway, trainer) this venv leaves out.
    exec .venv-vllm/bin/python -m pytest -m vllm tests/vllm "$@"
fi
scripts/setup.sh
markers="not slow and not long and not gpu and not docker and not vllm and not browser"
if [ "${1:-}" = "--docker" ]; then
    shift
    scripts/setup-docker.sh
    markers="docker and not gpu and not vllm and not browser"
fi
if [ "${1:-}" = "--long" ]; then
    markers="long and not slow and not gpu and not docker and not vllm and not browser"
    shift
fi
if [ "${1:-}" = "--slow" ] || [ "${1:-}" = "--slow-ci" ]; then
    markers="slow and not gpu and not docker and not vllm and not browser"
    [ "$1" = "--slow-ci" ] && markers="$markers and not outside_ci"
    shift
    set -- -n "${FLYWHEEL_SLOW_WORKERS:-2}" --dist loadfile "$@"
fi
if [ "${1:-}" = "--browser" ]; then
    shift
    scripts/setup-browser.sh
    markers="browser and not gpu and not docker and not vllm"
fi
# pytest exits 5 when no test ran; that is a failure here, and `set -e` makes it one.
exec .venv/bin/python -m pytest -m "$markers" "$@"
