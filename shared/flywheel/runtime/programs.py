"""A program harness's program, run for one rollout in a sandbox of its own.

An environment worker never starts the programs of its program harnesses itself: several
rollouts share a worker, and one rollout's program must not read, write or signal another's.
It asks its host (``program``), which runs the program here: a fresh sandbox
(:mod:`flywheel.runtime.isolation`) with the worker's view (the same interpreter and packages,
read-only), the program's files in its own ``/work``, and one way out: the rollout's model
endpoint, through the model relay (:mod:`flywheel.runtime.relay`) at
:data:`flywheel.sdk.sandbox.MODEL_BASE_URL`. The sandbox's agent (``agent.py``) runs the
program and reports its exit, output and whether it ran out of time; the sandbox goes when
the program ends.

``{python}`` in the command line is the worker's interpreter, and any Python started inside
finds the worker's packages and only those (a ``sitecustomize`` on its ``PYTHONPATH`` takes
the interpreter's own package folders off the path, as a worker runs without them, and adds
the worker's), so one command serves ``flywheel eval`` and training alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.contract.settings import WorkersSettings
from flywheel.runtime.isolation import (
    WORKDIR,
    AgentChannel,
    AgentGone,
    Isolation,
    Limits,
    MiB,
    View,
    agent_argv,
    agent_preamble,
    decode_b64,
    encode_b64,
)
from flywheel.runtime.relay import SOCKET_DIR, SOCKET_NAME, open_relay
from flywheel.sdk.sandbox import MODEL_PORT

if TYPE_CHECKING:
    from flywheel.runtime.environments import Layout, RolloutLink

SITE_DIR = "/run/flywheel-site"  # where the sitecustomize that finds the worker's packages is bound
MAX_OUTPUT_BYTES = 1024 * 1024  # of each of stdout and stderr kept (a program's last JSON line is its state)
MAX_FILES_BYTES = 64 * 1024 * 1024
GRACE_S = 10.0  # past its timeout_s, the sandbox is killed from outside


# The sandbox's Pythons start without -S (a program starts others, which must find the same
# packages): this takes off the path the interpreter's own package folders (Debian's
# dist-packages: a distribution's certifi points at /etc/ssl, which a sandbox does not see) and
# forgets what their .pth files imported already, then puts the worker's on it, its
# environment's own folder first.
SITECUSTOMIZE = """\
import site, sys
own = [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))]
sys.path[:] = [p for p in sys.path if p not in own]
for name, module in list(sys.modules.items()):
    if any((getattr(module, "__file__", None) or "").startswith(p.rstrip("/") + "/") for p in own):
        del sys.modules[name]
for d in {site_dirs!r}:
    site.addsitedir(d)
sys.path[1:1] = {path!r}
"""


class ProgramError(RuntimeError):
    """A program's sandbox could not be run; the message says why."""


class Programs:
    """Runs programs for a host's workers (see the module)."""

    def __init__(self, settings: WorkersSettings, isolation: Isolation) -> None:
        self.settings = settings
        self.isolation = isolation
        self._sites: dict[tuple[tuple[str, ...], tuple[str, ...]], tempfile.TemporaryDirectory[str]] = {}

    def _site(self, layout: Layout) -> str:
        """A folder holding a ``sitecustomize.py`` that puts ``layout``'s packages on the path."""
        key = (layout.site_dirs, layout.path)
        found = self._sites.get(key)
        if found is None:
            found = self._sites[key] = tempfile.TemporaryDirectory(prefix="flywheel-site-")
            Path(found.name, "sitecustomize.py").write_text(SITECUSTOMIZE.format(site_dirs=list(layout.site_dirs),
                                                                                 path=list(layout.path)))
            Path(found.name).chmod(0o755)
            Path(found.name, "sitecustomize.py").chmod(0o644)
        return found.name

    async def run(self, link: RolloutLink, layout: Layout, args: Any) -> dict[str, Any]:
        argv, env, files, stdin, timeout_s = _checked(args)
        argv = [layout.python if a == "{python}" else a for a in argv]
        relay = await open_relay(link.base_url, timeout_s, None, link.http_client)
        view = View(read_only=layout.view.read_only, hidden=layout.view.hidden, disk_mb=self.settings.disk_mb,
                    binds=((str(relay.folder), SOCKET_DIR), (self._site(layout), SITE_DIR)))
        inside = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKDIR, "LANG": "C.UTF-8", "TMPDIR": "/tmp",
                  "PYTHONPATH": SITE_DIR}
        limits = Limits(memory_bytes=self.settings.memory_mb * MiB, pids=self.settings.pids, cpu=self.settings.cpu)
        started = None
        try:
            started = await self.isolation.start(agent_argv(layout.python), inside, view, limits, name="program")
            child = started.child

            async def write(data: bytes) -> None:
                child.stdin.write(data)
                await child.stdin.drain()

            channel = AgentChannel(child.stdout.readexactly, write)
            child.stdin.write(agent_preamble())
            async with asyncio.timeout(timeout_s + GRACE_S):
                await channel.read_frame()  # the agent is up
                await _asked(channel, {"op": "configure", "env": inside, "workdir": WORKDIR,
                                       "model_port": MODEL_PORT, "model_socket": f"{SOCKET_DIR}/{SOCKET_NAME}"})
                for name, data in files.items():
                    await _asked(channel, {"op": "write_file", "path": name, "data": encode_b64(data), "mode": 0o644})
                reply = await _asked(channel, {"op": "exec", "cmd": argv, "env": env, "stdin": encode_b64(stdin),
                                               "timeout_s": timeout_s, "max_output_bytes": MAX_OUTPUT_BYTES})
        except TimeoutError:
            return {"exit_code": -9, "stdout": "", "stderr": "", "timed_out": True}
        except AgentGone as exc:
            words = started.last_words() if started is not None else ""
            raise ProgramError(f"the program's sandbox ended before the program did ({exc})"
                               + (f": {words[-1000:]}" if words else "")) from None
        finally:
            if started is not None:
                await started.stop()
            await relay.close()
        return {"exit_code": int(reply["exit_code"]), "timed_out": bool(reply["timed_out"]),
                "stdout": decode_b64(reply["stdout"]).decode(errors="replace"),
                "stderr": decode_b64(reply["stderr"]).decode(errors="replace")}

    async def close(self) -> None:
        for folder in self._sites.values():
            with contextlib.suppress(OSError):
                folder.cleanup()
        self._sites.clear()


async def _asked(channel: AgentChannel, request: dict[str, Any]) -> dict[str, Any]:
    reply = await channel.call(request)
    if not reply.get("ok"):
        raise ProgramError(f"the program's sandbox refused {request['op']}: {reply.get('error')}")
    return reply


def _checked(args: Any) -> tuple[list[str], dict[str, str], dict[str, bytes], bytes, float]:
    """A worker's ``program`` request, its types and sizes checked (a worker is not trusted)."""
    argv, env, files = args.get("argv"), args.get("env") or {}, args.get("files") or {}
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError("argv: a non-empty list of strings")
    if not isinstance(env, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("env: an object of strings")
    if not isinstance(files, Mapping) or not all(isinstance(k, str) and isinstance(v, bytes) for k, v in files.items()):
        raise ValueError("files: an object of names to bytes")
    if sum(len(v) for v in files.values()) > MAX_FILES_BYTES:
        raise ValueError(f"files: over {MAX_FILES_BYTES} bytes in all")
    stdin = args.get("stdin") or b""
    timeout_s = args.get("timeout_s")
    if not isinstance(stdin, bytes) or not isinstance(timeout_s, int | float) or not 0 < timeout_s < 86400:
        raise ValueError("stdin: bytes; timeout_s: seconds, positive")
    return list(argv), dict(env), dict(files), stdin, float(timeout_s)
