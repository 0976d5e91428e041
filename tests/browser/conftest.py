"""Fixtures of the browser tier: Debian's Chromium driven by Playwright (scripts/setup-browser.sh
installs both; Playwright's own browser download is not used), and the gateway under API keys
served on a free loopback port against the test's real nats-server."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from fastapi import FastAPI

from flywheel.contract.settings import Settings
from flywheel.runtime.natsserver import NatsServer
from flywheel.runtime.serving import serve
from flywheel_gateway.app import create_app

if TYPE_CHECKING:
    from playwright.async_api import Browser

# Debian's chromium package. Playwright is imported by the fixtures alone: the default suite
# collects this folder (and deselects it) where scripts/setup-browser.sh never ran.
CHROMIUM = Path("/usr/bin/chromium")


@dataclass
class Gateway:
    app: FastAPI
    url: str


@pytest.fixture
async def gateway(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Gateway]:
    """The gateway with API keys, its lifespan running, served over HTTP."""
    app = create_app(Settings(nats_url=nats_server.url, data_dir=tmp_path / "data", auth="keys"))
    async with app.router.lifespan_context(app):
        served = await serve(app)
        try:
            yield Gateway(app, served.url)
        finally:
            await served.stop()


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    """Headless Chromium (no sandbox as root: Chromium refuses to start its own otherwise)."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run scripts/setup-browser.sh (the browser tier needs it)")
    from playwright.async_api import async_playwright

    args = ["--no-sandbox"] if os.geteuid() == 0 else []
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=args)
        try:
            yield launched
        finally:
            await launched.close()


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    folder = tmp_path / "screenshots"
    folder.mkdir()
    return folder
