"""Composition root of the gateway's HTTP API: :func:`create_app` builds every part.

At start (the lifespan, before the server takes requests) it migrates the trace store,
opens it, connects to NATS (ensuring the streams) and builds the run registry; at stop it
closes them in reverse. Nothing is created at import time, so tests build an app per
test with their own settings. Request bodies are bounded by ``gateway_max_body_bytes``
(:mod:`flywheel.contract.bodylimit`).

Who may call what is :mod:`flywheel_gateway.auth`: API keys (``auth = "keys"``) or an open
API on loopback only; ``create_app`` refuses to build an open app for a host that is not one.

The environment hub and its package index: :mod:`flywheel_gateway.api_hub`. Web pages (runs, a
run's reward curve, a rollout's trace): :mod:`flywheel_gateway.web`.

Not covered: rate limits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse

from flywheel.contract.bodylimit import BodyLimit, too_large_detail
from flywheel.contract.bus import Bus
from flywheel.contract.keys import KeyCheck, check_open
from flywheel.contract.metrics import ObservedHTTP
from flywheel.contract.service import Service
from flywheel.contract.settings import Settings
from flywheel_gateway import (
    api_health,
    api_hub,
    api_keys,
    api_rollouts,
    api_runs,
    api_tasks,
    api_traces,
    api_usage,
    web,
)
from flywheel_gateway.auth import caller
from flywheel_gateway.migrate import migrate
from flywheel_gateway.responses import install_error_handlers
from flywheel_gateway.runs import RunRegistry
from flywheel_gateway.store import Store

log = logging.getLogger(__name__)


def create_app(settings: Settings) -> FastAPI:
    if settings.auth == "open":
        check_open("the gateway", settings.gateway_host)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            url = settings.resolved_database_url
            await migrate(url)
            store = Store.open(url)
            stack.push_async_callback(store.close)
            bus = await Bus.for_settings(settings, "gateway")
            stack.push_async_callback(bus.close)
            app.state.store = store
            app.state.bus = bus
            app.state.runs = RunRegistry(bus, store)
            app.state.prices = settings.prices
            app.state.quotas = settings.quotas
            app.state.hub_max_file_bytes = settings.gateway_max_body_bytes
            app.state.keys = KeyCheck(bus, service_token=settings.service_token) if settings.auth == "keys" else None
            if settings.auth == "open":
                log.warning("the gateway's API runs open (auth = \"open\"): no API keys, every caller on this "
                            "machine may read and change every tenant's runs; set FLYWHEEL_AUTH=keys to require them")
            # A heartbeat like every service's, for `flywheel status`; uvicorn owns the signals.
            service = Service("gateway", bus, info={"url": settings.resolved_gateway_url}, handle_signals=False)
            beating = asyncio.ensure_future(service.run())
            try:
                yield
            finally:
                service.stop()
                await beating

    app = FastAPI(
        title="Flywheel gateway",
        summary="Publish tasks to the bus; read runs and their metrics, and the recorded tasks, rollouts, scores "
                "and trace graphs; push, install and evaluate environments on the hub.",
        version="0.1.0",
        lifespan=lifespan,
    )
    for router in (api_tasks.router, api_runs.router, api_rollouts.router, api_traces.router, api_usage.router,
                   api_keys.router, api_hub.router, api_hub.index):
        app.include_router(router, dependencies=[Depends(caller)])
    app.include_router(web.router, dependencies=[Depends(caller)])  # the web pages: the API's keys, no schema
    app.include_router(web.login_router)  # the pages' login: it takes the key
    app.mount("/static", web.static_files(), name="static")
    app.include_router(api_health.router)
    install_error_handlers(app)
    limit = settings.gateway_max_body_bytes
    app.add_middleware(BodyLimit, max_body_bytes=limit, refuse=lambda detail: JSONResponse({"detail": detail}, 413),
                       detail=too_large_detail("the gateway", limit, "gateway_max_body_bytes",
                                               "send fewer tasks per request, or push a smaller package"))
    app.add_middleware(ObservedHTTP)  # outermost: spans and figures cover the body limit's answers too
    return app
