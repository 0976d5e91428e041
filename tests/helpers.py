"""Small helpers shared by the test tiers."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

    from flywheel.runtime.environments import WorkerPool
    from flywheel.sdk.environment import Environment
    from flywheel.sdk.sandbox import SandboxClient


async def until(cond: Callable[[], bool | Awaitable[bool]], timeout_s: float = 15.0, what: str = "condition") -> None:
    """Bounded polling of a condition (sync or async); fails the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if not isinstance(value, bool):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)  # noqa: sleep - the polling interval of this bounded wait


@contextlib.asynccontextmanager
async def serving_app(app: Any, lifespan: Literal["on", "off"] = "off") -> AsyncIterator[str]:
    """``app`` served by uvicorn on a free loopback port (its URL), in this event loop; SIGTERM and
    SIGINT stay the test process's (a hung test can still be stopped)."""
    import uvicorn

    from flywheel.runtime.natsserver import free_port

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            yield

    port = free_port()
    server = Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan=lifespan, log_level="warning"))
    serving = asyncio.ensure_future(server.serve())
    await until(lambda: server.started, what="uvicorn to start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await serving


def num_tasks(env: Environment) -> int:
    """The number of rows in ``env``'s fixed task set (a loaded environment's tasks are a TaskSet)."""
    from flywheel.sdk.environment import TaskSet

    assert isinstance(env.tasks, TaskSet) and env.tasks.size is not None, f"{env.name}: no fixed task set"
    return env.tasks.size


def random_adapter(model_dir: Path, rank: int, targets: list[str], seed: int, std: float = 0.3) -> torch.nn.Module:
    """The model at ``model_dir`` with a LoRA adapter (alpha 2 x rank) whose A and B are random
    (B not zero: it changes what is sampled), in eval mode."""
    import torch

    from flywheel.sdk import models

    model = models.add_adapter(models.load_model(model_dir)[0], rank, 2 * rank, targets)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
    return model.eval()


@contextlib.asynccontextmanager
async def worker_pool(name: str = "test", sandbox: SandboxClient | None = None, **settings: Any
                      ) -> AsyncIterator[WorkerPool]:
    """A real pool of environment workers (sandboxed processes) over a data folder of its own,
    with the ``workers`` settings given; every worker stopped after."""
    from flywheel.contract.settings import WorkersSettings
    from flywheel.runtime.environments import WorkerPool

    with tempfile.TemporaryDirectory(prefix="flywheel-test-data-") as data:
        pool = WorkerPool(WorkersSettings(**settings), Path(data), name=name, sandbox=sandbox)
        try:
            yield pool
        finally:
            await pool.close()
