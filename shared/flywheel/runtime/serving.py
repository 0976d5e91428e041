"""An ASGI app served by uvicorn on a free loopback port inside the caller's event loop: an
eval's recording proxy, a test's or a benchmark's server."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class Served:
    """An ASGI app served by uvicorn on a free loopback port, in this event loop."""

    url: str
    server: Any
    task: asyncio.Task[None]

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def serve(app: Any, host: str = "127.0.0.1") -> Served:
    """Serve ``app`` on a free port of ``host`` until :meth:`Served.stop`."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield  # Ctrl-C belongs to whoever runs the loop (it stops the eval, not just this server)

    server = Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            await task
            raise RuntimeError("the server stopped before it started")
        await asyncio.sleep(0.01)  # a deliberate sleep - uvicorn says it started only through this flag
    return Served(f"http://{host}:{port}", server, task)
