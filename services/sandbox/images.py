"""Images built from a caller's Dockerfile (``sandbox.build``), for the docker backend.

A build context is a stranger's code: its ``RUN`` steps run on the engine. So each build has
bounds (the settings' ``[sandbox]`` section): ``build_timeout_s`` (past it the connection to
the engine is closed, which stops the build), ``build_max_mb`` (a bigger image is removed and
refused), a memory cap and a low CPU weight on its steps, and no network unless ``build_network`` is on. The image
is tagged by the context's content hash (:func:`flywheel.sdk.sandbox.build_tag`), so the same
bytes are built once: a later request finds the image and answers ``cached``. Images carry the
label :data:`BUILD_LABEL` (``docker image prune --filter label=flywheel.sdk.sandbox.build``
removes them). Sandboxes then run from the image as from any other: read-only root, the
sandbox's user, no network.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import socket
import time
from typing import Any

import requests
import urllib3.exceptions

from flywheel.contract.settings import SandboxSettings
from flywheel.sdk.sandbox import BuildRequest, Built, SandboxError, build_tag

log = logging.getLogger(__name__)

BUILD_LABEL = "flywheel.sdk.sandbox.build"
BUILD_MEMORY_BYTES = 4 * 1024**3  # each RUN step's memory, swap included
# A RUN step's CPU weight against the engine's containers (1024 each by default): a stranger's
# build gets a quarter of a sandbox's share of a busy machine, so it slows rollouts little.
BUILD_CPU_SHARES = 256
LOG_TAIL = 30  # lines of the build's output an error carries


class ImageBuilder:
    """Builds contexts on one engine (``base_url``: the backend's), one build of a tag at a time."""

    def __init__(self, client: Any, base_url: str | None) -> None:
        self.client = client  # a docker.DockerClient
        self.base_url = base_url
        self._locks: dict[str, asyncio.Lock] = {}

    async def build(self, request: BuildRequest, limits: SandboxSettings) -> Built:
        started = time.monotonic()
        tag = build_tag(request.context, request.dockerfile)
        async with self._locks.setdefault(tag, asyncio.Lock()):
            size = await self._run(self._size, tag)
            if size is not None:
                return Built(image=tag, cached=True, size_mb=size, duration_s=round(time.monotonic() - started, 3))
            timeout_s = min(request.timeout_s, limits.build_timeout_s)
            await self._build(request, tag, timeout_s, limits.build_network)
            size = await self._run(self._size, tag)
            if size is None:
                raise SandboxError("failed", f"the engine reported the build of {tag} done but has no such image")
            if size > limits.build_max_mb:
                await self._run(self._remove, tag)
                raise SandboxError("too_large", f"the image built from {request.dockerfile} is {size:.0f} MB, over "
                                                f"this service's limit of {limits.build_max_mb} MB (setting "
                                                "sandbox.build_max_mb): it was removed")
        duration_s = round(time.monotonic() - started, 3)
        log.info("sandbox: built image %s (%.0f MB) in %.1f s", tag, size, duration_s)
        return Built(image=tag, cached=False, size_mb=size, duration_s=duration_s)

    async def _build(self, request: BuildRequest, tag: str, timeout_s: float, network: bool) -> None:
        import docker
        import docker.utils

        # A client of its own, whose response is kept: cutting its connection stops this build
        # (the engine cancels a build whose client went away) and nothing else.
        where = {"base_url": self.base_url} if self.base_url else docker.utils.kwargs_from_env()
        api = docker.APIClient(timeout=int(timeout_s) + 30, **where)
        responses: list[Any] = []
        api.hooks["response"].append(lambda response, *args, **kwargs: responses.append(response))
        lines: list[str] = []
        done = asyncio.get_running_loop().run_in_executor(None, self._stream, api, request, tag, network, lines)
        try:
            async with asyncio.timeout(timeout_s):
                error = await asyncio.shield(done)
        except TimeoutError:
            for response in responses:
                _cut(response)
            await asyncio.gather(done, return_exceptions=True)
            raise SandboxError("failed", f"the image build ran past {timeout_s:.0f} s (at most setting "
                                         f"sandbox.build_timeout_s) and was stopped; its output ends:\n"
                                         f"{_tail(lines)}") from None
        finally:
            api.close()
        if error is not None:
            raise SandboxError("failed", f"the image build failed: {error}; its output ends:\n{_tail(lines)}")

    @staticmethod
    def _stream(api: Any, request: BuildRequest, tag: str, network: bool, lines: list[str]) -> str | None:
        """Run the build, collecting its output in ``lines``; the engine's error, or None."""
        import docker.errors

        try:
            for chunk in api.build(fileobj=io.BytesIO(request.context), custom_context=True,
                                   dockerfile=request.dockerfile, tag=tag, rm=True, forcerm=True, pull=False,
                                   network_mode=None if network else "none", labels={BUILD_LABEL: "1"},
                                   container_limits={"memory": BUILD_MEMORY_BYTES, "memswap": BUILD_MEMORY_BYTES,
                                                     "cpushares": BUILD_CPU_SHARES},
                                   decode=True):
                if "stream" in chunk:
                    lines.extend(line for line in str(chunk["stream"]).splitlines() if line.strip())
                    del lines[:-LOG_TAIL]
                if "error" in chunk:
                    detail = chunk.get("errorDetail")
                    return str(chunk["error"] if not isinstance(detail, dict) else detail.get("message", detail))
        except docker.errors.APIError as exc:
            return str(exc.explanation or exc)
        except (requests.RequestException, urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
            # The connection cut (a timeout), or the engine gone mid-answer.
            return f"{type(exc).__name__}: {exc}"
        return None

    def _size(self, tag: str) -> float | None:
        import docker.errors

        try:
            image = self.client.images.get(tag)
        except docker.errors.ImageNotFound:
            return None
        return round(float(image.attrs.get("Size", 0)) / 1e6, 1)

    def _remove(self, tag: str) -> None:
        self.client.images.remove(tag, force=True)

    @staticmethod
    async def _run(fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def _cut(response: Any) -> None:
    """Shut the socket of a streamed ``requests`` response: a read blocked on it returns now."""
    connection = getattr(response.raw, "_connection", None)
    sock = getattr(connection, "sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _tail(lines: list[str]) -> str:
    return "\n".join(lines[-LOG_TAIL:]) or "(no output)"

