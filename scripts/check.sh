#!/usr/bin/env bash
# Static checks over the whole tree, as CI runs them: ruff (lint and import order) and mypy
# (types), both configured in pyproject.toml, then the docs site (mkdocs.yml) built strictly.
#   scripts/check.sh          set up, then check
#   scripts/check.sh --fix    let ruff fix what it can first
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/mypy ] && [ -x .venv/bin/mkdocs ] || scripts/setup.sh
if [ "${1:-}" = "--fix" ]; then
    .venv/bin/ruff check --fix .
fi
status=0
.venv/bin/ruff check . || status=$?  # and mypy still runs, so one run shows every problem
# mypy finds packages by their import names, and the services and environments live in
# folders named otherwise (pyproject.toml's package-dir: services/gateway is flywheel_gateway).
# It reads them through build/typecheck, a tree of links by import name, and its messages
# name the real files.
.venv/bin/python - <<'PY'
import os, shutil, tomllib
from pathlib import Path

tree = Path("build/typecheck")
shutil.rmtree(tree, ignore_errors=True)
tree.mkdir(parents=True)
for name, folder in tomllib.loads(Path("pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].items():
    (tree / name).symlink_to(os.path.relpath(folder, tree), target_is_directory=True)
(tree / "links.txt").write_text("".join(f"{tree / n}/ {p}/\n" for n, p in sorted(
    tomllib.loads(Path("pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].items())))
PY
.venv/bin/mypy > build/typecheck/mypy.out 2>&1 || status=$?
# build/typecheck/<name>/ back to the folder it links to
sed_args=()
while read -r link folder; do sed_args+=(-e "s#^${link}#${folder}#"); done < build/typecheck/links.txt
sed "${sed_args[@]}" build/typecheck/mypy.out
# The docs site (docs/, into build/site): --strict turns every warning into a failure, so a
# broken or absolute link, a missing anchor or a page left out of nav fails the check.
.venv/bin/mkdocs build --strict --quiet || status=$?
exit "$status"
