"""The model relay: the one way out of a sandbox without network, to one model endpoint.

A harness that runs a program inside a sandbox (a CLI agent, an ``openai``-SDK script) gives
the sandbox its interception URL as ``spec.model_url``. The sandbox still has no network: the
backend binds a folder holding a Unix socket into it (at :data:`SOCKET_DIR`), its agent
listens on ``127.0.0.1:MODEL_PORT`` in the sandbox's own loopback and copies each connection
to that socket, and this relay, on the service's side of the socket, reads HTTP/1.1 requests
and forwards those under ``/v1`` to ``model_url`` (``/v1/chat/completions`` ->
``{model_url}/chat/completions``), streaming the answer back as it comes (token-by-token
server-sent events included). Any other path gets a 403 that says why; nothing else leaves.
Programs inside reach it at :data:`flywheel.sdk.sandbox.MODEL_BASE_URL`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import tempfile
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from pathlib import Path

import h11
import httpx

from flywheel.sdk.sandbox import MODEL_PREFIX, SandboxError

log = logging.getLogger(__name__)

_Send = Callable[..., Awaitable[None]]  # a connection's send(*events)

SOCKET_DIR = "/run/flywheel"  # where the socket's folder is bound inside the sandbox
SOCKET_NAME = "model.sock"
READ_CHUNK = 65536
MAX_REQUEST_BYTES = 64 * 1024 * 1024  # one request's body (a long conversation's messages fit)
PREFIX = "flywheel-relay-"  # + a random part: each relay's folder
# Per connection, not forwarded: they describe the hop, not the request or its answer.
HOP_HEADERS = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                         b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length"})


async def open_relay(model_url: str, timeout_s: float, parent: str | None,
                     client: httpx.AsyncClient | None = None) -> ModelRelay:
    """A started relay for one sandbox, its folder in ``parent`` (setting sandbox_relay_dir);
    a SandboxError naming that folder and the setting when it cannot open. ``client``: how
    ``model_url`` is reached (None: a client of the relay's own, over the network)."""
    relay = None
    try:
        relay = ModelRelay(model_url, timeout_s=timeout_s, parent=parent, client=client)
        await relay.start()
    except OSError as exc:
        if relay is not None:
            await relay.close()
        raise SandboxError("failed", f"cannot open the sandbox's model relay in {parent or tempfile.gettempdir()} "
                                     f"(setting sandbox_relay_dir): {exc}") from exc
    return relay


def remove_stale(parent: Path) -> None:
    """Remove relay folders left in ``parent`` by processes that died without closing their
    relays (SIGKILL): nothing listens on their sockets. Asked of the socket, not of a process
    id, so replicas sharing the folder from other PID namespaces keep theirs. Once a process,
    for each parent."""
    if parent in _swept:
        return
    _swept.add(parent)
    for folder in parent.glob(f"{PREFIX}*"):
        path = folder / SOCKET_NAME
        try:
            if not path.exists():  # a folder whose relay never started: stale once it is a minute old
                if time.time() - folder.stat().st_mtime > 60:
                    shutil.rmtree(folder, ignore_errors=True)
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(1.0)
                probe.connect(str(path))
        except ConnectionRefusedError:
            shutil.rmtree(folder, ignore_errors=True)
        except OSError:  # another user's, or busy: left alone
            continue


_swept: set[Path] = set()


class ModelRelay:
    """Serves one sandbox's socket; :meth:`close` stops it and removes its folder."""

    def __init__(self, model_url: str, timeout_s: float, parent: str | None = None,
                 client: httpx.AsyncClient | None = None) -> None:
        self.model_url = model_url.rstrip("/")
        # Its own folder, in ``parent`` (setting sandbox_relay_dir; None: the system's temporary folder).
        if parent is not None:
            os.makedirs(parent, exist_ok=True)
        remove_stale(Path(parent or tempfile.gettempdir()))
        self.folder = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
        self._own_client = client is None
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0))
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.forwarded = 0
        self.refused = 0

    async def start(self) -> None:
        path = self.folder / SOCKET_NAME
        self._server = await asyncio.start_unix_server(self._serve, path=str(path))
        # The sandbox runs as a user of its own: it may enter the folder and connect, nothing more.
        os.chmod(self.folder, 0o755)
        os.chmod(path, 0o777)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._own_client:
            await self.client.aclose()
        shutil.rmtree(self.folder, ignore_errors=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None  # a connection's handler runs as a task of its own
        self._connections.add(task)
        try:
            await self._connection(reader, writer)
        except (ConnectionError, h11.ProtocolError, asyncio.IncompleteReadError) as exc:
            log.debug("model relay connection ended: %s: %s", type(exc).__name__, exc)
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)

        async def next_event() -> h11.Event | type[h11.PAUSED] | type[h11.NEED_DATA]:
            while True:
                event = conn.next_event()
                if event is not h11.NEED_DATA:
                    return event
                conn.receive_data(await reader.read(READ_CHUNK))

        async def send(*events: h11.Event) -> None:
            for event in events:
                data = conn.send(event)
                if data:
                    writer.write(data)
            await writer.drain()

        while True:
            event = await next_event()
            if isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                return
            if not isinstance(event, h11.Request):
                return
            body = bytearray()
            while True:
                part = await next_event()
                if isinstance(part, h11.Data):
                    body += part.data
                    if len(body) > MAX_REQUEST_BYTES:
                        await self._refuse(send, 413, f"a request body over {MAX_REQUEST_BYTES} bytes")
                        return
                elif isinstance(part, h11.EndOfMessage):
                    break
                else:
                    return
            await self._forward(event, bytes(body), send)
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                return
            conn.start_next_cycle()

    async def _forward(self, request: h11.Request, body: bytes, send: _Send) -> None:
        target = request.target.decode("latin-1")
        path, _, query = target.partition("?")
        # A dot segment would climb out of the prefix once the client normalises the URL.
        climbs = any(part in (".", "..") for part in urllib.parse.unquote(path).split("/"))
        if climbs or (path != MODEL_PREFIX and not path.startswith(MODEL_PREFIX + "/")):
            self.refused += 1
            await self._refuse(send, 403, f"{target!r}: this sandbox reaches only its model endpoint, under "
                                          f"{MODEL_PREFIX}/ (for example {MODEL_PREFIX}/chat/completions)")
            return
        url = self.model_url + path[len(MODEL_PREFIX):] + (f"?{query}" if query else "")
        headers = [(k, v) for k, v in request.headers if k.lower() not in HOP_HEADERS]
        try:
            upstream = self.client.build_request(request.method.decode(), url, headers=headers, content=body)
            response = await self.client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            await self._refuse(send, 502, f"the model endpoint could not be reached: {type(exc).__name__}: {exc}")
            return
        self.forwarded += 1
        try:
            await send(h11.Response(status_code=response.status_code,
                                    headers=[(k, v) for k, v in response.headers.raw
                                             if k.lower() not in HOP_HEADERS]))
            if response.is_stream_consumed:  # a transport that answered whole (the endpoint in this process)
                await send(h11.Data(data=response.content))
            else:
                async for chunk in response.aiter_raw():
                    await send(h11.Data(data=chunk))
            await send(h11.EndOfMessage())
        finally:
            await response.aclose()

    @staticmethod
    async def _refuse(send: _Send, status: int, message: str) -> None:
        body = httpx.Response(status, json={"error": {"message": message, "type": "sandbox_relay"}}).content
        await send(h11.Response(status_code=status, headers=[(b"content-type", b"application/json"),
                                                             (b"content-length", str(len(body)).encode()),
                                                             (b"connection", b"close")]),
                   h11.Data(data=body), h11.EndOfMessage())
