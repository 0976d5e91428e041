"""What the integration tests' shared fixtures (tests/integration/conftest.py) hand to a test:
inference workers started as the process starts them, and an inference server on HTTP."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import nats.js.errors

from flywheel.contract.bus import Bus
from flywheel.contract.service import Service
from flywheel.contract.settings import InferenceSettings
from flywheel_inference.worker import Worker
from tests.helpers import until


class Workers:
    """Starts workers as the process does (each its own connection and Service: the consumer,
    the weights and run-state watchers, the heartbeat); stops them, by their handle."""

    def __init__(self, url: str, data_dir: Path) -> None:
        self.url = url
        self.data_dir = data_dir
        self.started: dict[int, tuple[Service, asyncio.Future[None], Worker]] = {}

    async def __call__(self, config: InferenceSettings | None = None) -> Worker:
        wbus = await Bus.connect(self.url, name="inference")
        # Trace nodes on the bus from a rollout's first call (the default holds a short rollout's
        # back): these tests count and check them.
        config = config or InferenceSettings(backoff_s=(0.2,), max_deliver=50, live_trace_after_s=0.0)
        worker = Worker.with_backends(wbus, self.data_dir, config)
        service = worker.service(handle_signals=False)
        running = asyncio.ensure_future(service.run())
        self.started[id(worker)] = (service, running, worker)

        async def consuming() -> bool:  # its task consumer exists: what it is sent, it is given
            assert not running.done(), running
            try:
                await wbus.js.consumer_info("TASKS", "inference")
            except nats.js.errors.NotFoundError:
                return False
            return True

        await until(consuming, what="the worker's task consumer")
        return worker

    async def stop(self, worker: Worker) -> None:
        """Stop one worker through its shutdown path; raises what its service died of, if it did."""
        service, running, _ = self.started.pop(id(worker))
        service.stop()
        try:
            await running
        finally:
            await worker.close()


@dataclass
class Served:
    url: str
    prompts: list[list[int]]  # every prompt the backend was given
