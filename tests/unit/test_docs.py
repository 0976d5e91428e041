"""The README stays a short front door and the docs stay one site: the README is under 300 lines,
every relative link in it reaches a file or folder of the repository, and every page under docs/
is in mkdocs.yml's nav (scripts/check.sh builds the site with --strict, which checks the links
between pages and their anchors)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target) and ![alt](target)
EXTERNAL = ("http://", "https://", "#", "mailto:")


def nav_pages(nav: object) -> set[str]:
    """The page files a mkdocs nav names, at any depth: a list of 'Title: file.md', bare files
    or 'Section: [...]' entries."""
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, list):
        return set().union(*(nav_pages(item) for item in nav))
    if isinstance(nav, dict):
        return set().union(*(nav_pages(value) for value in nav.values()))
    return set()


def test_the_readme_is_under_300_lines() -> None:
    lines = len(README.read_text().splitlines())
    assert lines < 300, f"README.md has {lines} lines: move detail into a page under docs/"


def test_every_relative_link_of_the_readme_exists() -> None:
    text = README.read_text()
    targets = [t for t in LINK.findall(text) if not t.startswith(EXTERNAL)]
    assert targets, "the README links into docs/"
    missing = [t for t in targets if not (ROOT / t.split("#", 1)[0]).exists()]
    assert not missing, f"README.md links to paths that do not exist: {missing}"


def test_every_docs_page_is_in_the_nav() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = ROOT / config.get("docs_dir", "docs")
    pages = {p.relative_to(docs).as_posix() for p in docs.rglob("*.md")}
    listed = nav_pages(config["nav"])
    assert pages - listed == set(), f"pages missing from mkdocs.yml's nav: {sorted(pages - listed)}"
    assert listed - pages == set(), f"mkdocs.yml's nav names pages that do not exist: {sorted(listed - pages)}"
