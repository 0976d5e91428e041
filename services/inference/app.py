"""Composition root of the inference process: the worker and the HTTP API, built together.

:func:`create_app` builds nothing at import time. At start (the lifespan) it connects to
NATS, builds the :class:`~flywheel_inference.worker.Worker` and runs it under a
:class:`flywheel.contract.service.Service` (the task consumer, the weight and run-state
watchers, the runs' teachers: :class:`~flywheel_inference.teacher.TeacherHost`, the
heartbeat) beside the HTTP server, which owns the signals. With ``auth = "keys"`` the
OpenAI API wants a tenant's key (:mod:`flywheel_inference.api`). At stop it stops the service
(in-flight tasks finish or are handed back), closes the policies and drains the connection. If the
worker dies while the server is up, ``app.state.worker_failed`` is set and ``on_worker_exit``
is called (the entry point uses it to stop the server and exit non-zero, instead of
serving without a worker).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from flywheel.contract.bus import Bus
from flywheel.contract.keys import KeyCheck, check_open
from flywheel.contract.metrics import ObservedHTTP
from flywheel.contract.settings import Settings
from flywheel_inference import api
from flywheel_inference.teacher import TeacherHost
from flywheel_inference.worker import Worker

log = logging.getLogger(__name__)


def create_app(settings: Settings, url: str | None = None,
               on_worker_exit: Callable[[], None] | None = None) -> FastAPI:
    """``url`` is where this server is reached (shown in the heartbeat; program harnesses get it).
    The worker's bounds are the settings' ``inference`` section. Open (``auth = "open"``, no API
    keys) is refused unless it listens on a loopback address (``inference_host``)."""
    if settings.auth == "open":
        check_open("inference", settings.inference_host)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        bus = await Bus.for_settings(settings, "inference")
        worker = Worker.with_backends(bus, settings.data_dir, settings.inference, url, settings.workers,
                                      settings.trusted_modules)
        service = worker.service(handle_signals=False)
        service.add_task(TeacherHost(bus, settings.data_dir, settings.inference, worker.info, worker.pool,
                                     settings.trusted_modules).run)
        app.state.worker = worker
        app.state.interception = worker.interception
        app.state.keys = KeyCheck(bus, service_token=settings.service_token) if settings.auth == "keys" else None
        if settings.auth == "open":
            log.warning("inference's OpenAI API runs open (auth = \"open\"): no API keys, every caller on this "
                        "machine may sample from every run; set FLYWHEEL_AUTH=keys to require them")
        running = asyncio.ensure_future(service.run())
        stopping = False

        def ended(task: asyncio.Task[None]) -> None:
            if not stopping:
                app.state.worker_failed = True
                log.error("inference worker stopped while the server was up",
                          exc_info=None if task.cancelled() else task.exception())
                if on_worker_exit is not None:
                    on_worker_exit()

        running.add_done_callback(ended)
        try:
            yield
        finally:
            stopping = True
            service.stop()
            try:
                await running  # raises what the worker died of
            finally:
                await worker.close()

    app = FastAPI(title="Flywheel inference",
                  summary="OpenAI-compatible completions from each run's current policy.",
                  version="0.1.0", lifespan=lifespan)
    api.install(app, settings.inference.max_body_bytes)
    app.add_middleware(ObservedHTTP)
    return app
