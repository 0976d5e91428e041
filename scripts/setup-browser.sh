#!/usr/bin/env bash
# Install what the browser tier (scripts/test.sh --browser, tests/browser) needs: Debian's
# chromium package (Playwright's own browser download is not used: the tests launch
# /usr/bin/chromium) and the playwright Python package in .venv, at the version in
# scripts/constraints.txt. Debian/Ubuntu; chromium needs root (apt-get). Safe to run again:
# it installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x /usr/bin/chromium ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "setup-browser.sh: /usr/bin/chromium is missing; installing it needs root (apt-get install chromium)" >&2
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
wanted="$(grep -E '^playwright==' scripts/constraints.txt)"
if [ "$(.venv/bin/python -m pip freeze 2>/dev/null | grep -E '^playwright==')" != "$wanted" ]; then
    .venv/bin/python -m pip install --quiet -c scripts/constraints.txt playwright
fi
