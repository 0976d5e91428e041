"""Run untrusted code in a sandbox: the client, and the request/reply messages of ``sandbox.*``.

A tool or a verifier calls the sandbox service over NATS request/reply (not a stream: the
caller waits for the answer)::

    from flywheel.sdk.sandbox import SandboxClient, SandboxSpec

    client = SandboxClient(bus)                      # a connected flywheel.contract.bus.Bus
    box = await client.create(SandboxSpec(memory_mb=256, labels={"rollout": rollout_id}))
    await client.write_file(box, "main.py", b"print(6 * 7)")
    result = await client.exec(box, "python3 main.py", timeout_s=10)
    result.exit_code, result.stdout                  # 0, "42\\n"
    await client.destroy(box)

    result = await client.run("python3 -m pytest -q", files={"test_x.py": source})   # one shot

A session keeps its state between execs: files, and the folder a shell command ends in
(``cd src`` then ``ls`` lists ``src``). Every exec starts a fresh process: shell variables
and background processes do not survive it (whatever an exec leaves running is killed when
it returns). Errors come back as :class:`SandboxError` with a ``kind`` (``not_found``,
``invalid_request``, ``too_large``, ``capacity``, ``gone``, ``failed``, ``unavailable``).

Subjects (JSON bodies, the Structs below; every reply is tagged, an error is
:class:`ErrorReply`):

- ``sandbox.create``, ``sandbox.run``, ``sandbox.build``: queue group ``sandbox``, so replicas
  share the load.
- ``sandbox.<instance>.<op>`` for ``exec``, ``write_file``, ``read_file``, ``destroy`` and
  ``destroy_by_label``: a sandbox lives in one replica, and its id says which
  (``<hex>@<instance>``).

An image of one's own (the docker backend): :meth:`SandboxClient.build` sends a build context
(a tar archive, :func:`context_archive` makes one of a folder with a Dockerfile) and gets an
image tag named by the context's content hash, which a ``SandboxSpec(image=...)`` then uses. The
service builds each context once (a second build of the same bytes answers ``cached``), within
its time and size bounds and with no network unless its settings allow it; the local backend
refuses with a message naming the backend that builds.

Not covered: streaming output while a command runs, and interactive terminals.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import hashlib
import io
import re
import secrets
import tarfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import msgspec

from flywheel.contract.retry import SANDBOX_CAPACITY, retry

if TYPE_CHECKING:
    from flywheel.contract.bus import Bus
    from flywheel.sdk.harness import RolloutContext

QUEUE_GROUP = "sandbox"
# Labels a rollout's sandbox carries (sandbox_tools): the service meters a sandbox's seconds to
# the run its RUN_LABEL names.
RUN_LABEL = "flywheel-run"
ROLLOUT_LABEL = "flywheel-rollout"
SERVICE_NAME = "sandbox"
# Labels every sandbox made in this context gets (under the spec's own): the run, and the
# rollout, whose work is under way. The scorer sets them around each reward (metered_to), so a
# sandbox a reward makes (run_tests, a verifier of its own) is metered to the rollout's run.
_METERED_TO: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar("flywheel_sandbox_metered_to",
                                                                                       default=None)
WORKDIR = "/work"
# The sandbox id carries the replica that holds it: "<hex>@<instance>".
INSTANCE_TOKEN = re.compile(r"[^A-Za-z0-9_-]")
# Spare seconds a request waits beyond the command's own timeout (start, transfer).
REQUEST_MARGIN_S = 10.0
# A sandbox given a spec.model_url reaches it, and nothing else, at MODEL_BASE_URL in its own
# loopback: requests under MODEL_PREFIX go to model_url with the prefix taken off.
MODEL_PORT = 8377
MODEL_PREFIX = "/v1"
MODEL_BASE_URL = f"http://127.0.0.1:{MODEL_PORT}{MODEL_PREFIX}"

T = TypeVar("T")


@contextlib.contextmanager
def metered_to(run: str, rollout_id: str | None = None) -> Iterator[None]:
    """Within this block (and the tasks it starts), sandboxes this process's clients make are
    labelled with ``run`` and ``rollout_id``, so the sandbox service meters their seconds to
    the run. An empty ``run`` labels nothing."""
    labels = {RUN_LABEL: run} | ({ROLLOUT_LABEL: rollout_id} if rollout_id else {}) if run else {}
    token = _METERED_TO.set(labels)
    try:
        yield
    finally:
        _METERED_TO.reset(token)


def _metered(spec: SandboxSpec | None) -> SandboxSpec:
    spec = spec or SandboxSpec()
    labels = _METERED_TO.get()
    return msgspec.structs.replace(spec, labels={**labels, **spec.labels}) if labels else spec

Positive = Annotated[float, msgspec.Meta(gt=0)]
Count = Annotated[int, msgspec.Meta(ge=1)]
Path_ = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]


class _Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Requests: strict (an unknown field is a caller's mistake worth naming)."""


class _Reply(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Replies: tagged, so one decoder reads the expected reply or an error."""


class SandboxSpec(_Message, frozen=True):
    """What a sandbox gets. ``image`` None: the backend's default (local: the host's
    ``/usr`` read-only; docker: setting ``sandbox_image``). Memory, processes, disk and
    CPU are limits of the whole sandbox; ``disk_mb`` is the size of each writable tmpfs
    (``/work``, ``/tmp``, ``/dev/shm``; the rest is read-only); ``files`` are written into the
    workdir (relative paths) before the first exec; ``labels`` select sandboxes for bulk
    destroy. ``network=True`` is refused (kind ``invalid_request``) unless the service runs
    with setting ``sandbox_allow_network`` on.

    ``model_url`` (an http(s) base URL, e.g. a rollout's interception URL ending in ``/v1``):
    the one place a sandbox without network reaches. Programs inside call it at
    :data:`MODEL_BASE_URL` (``http://127.0.0.1:8377/v1``); the service relays requests under
    ``/v1`` to it, streamed, and refuses any other path (local backend)."""

    image: str | None = None
    cpu: Annotated[float, msgspec.Meta(gt=0, le=64)] = 1.0
    memory_mb: Annotated[int, msgspec.Meta(ge=16, le=65536)] = 512
    pids: Annotated[int, msgspec.Meta(ge=8, le=4096)] = 128
    disk_mb: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 256
    ttl_s: Positive = 3600.0
    idle_ttl_s: Positive = 600.0
    network: bool = False
    model_url: Annotated[str, msgspec.Meta(pattern=r"^https?://[^/\s]+(/\S*)?$", max_length=2048)] | None = None
    env: dict[str, str] = {}
    files: dict[str, bytes] = {}
    labels: dict[str, str] = {}


class CreateRequest(_Message, frozen=True):
    """caller -> ``sandbox.create``. The same ``idempotency_key`` returns the same live sandbox."""

    spec: SandboxSpec = SandboxSpec()
    idempotency_key: str | None = None


class ExecRequest(_Message, frozen=True):
    """caller -> ``sandbox.<instance>.exec``. ``cmd``: a string runs in bash (the session's
    folder carries over), a list runs as argv. ``cwd`` relative to the session's folder."""

    id: str
    cmd: str | Annotated[list[str], msgspec.Meta(min_length=1)]
    cwd: str | None = None
    env: dict[str, str] = {}
    stdin: bytes = b""
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 30.0


class WriteFileRequest(_Message, frozen=True):
    """caller -> ``sandbox.<instance>.write_file``; a relative path is under the workdir."""

    id: str
    path: Path_
    data: bytes
    mode: Annotated[int, msgspec.Meta(ge=0, le=0o777)] = 0o644


class ReadFileRequest(_Message, frozen=True):
    """caller -> ``sandbox.<instance>.read_file``."""

    id: str
    path: Path_


class DestroyRequest(_Message, frozen=True):
    """caller -> ``sandbox.<instance>.destroy``; destroying a sandbox that is gone is not an error."""

    id: str


class DestroyByLabelRequest(_Message, frozen=True):
    """caller -> ``sandbox.<instance>.destroy_by_label``: every sandbox whose labels include all of these."""

    labels: Annotated[dict[str, str], msgspec.Meta(min_length=1)]


class RunRequest(_Message, frozen=True):
    """caller -> ``sandbox.run``: create, write ``files``, exec ``cmd``, destroy; one reply."""

    cmd: str | Annotated[list[str], msgspec.Meta(min_length=1)]
    files: dict[str, bytes] = {}
    spec: SandboxSpec = SandboxSpec()
    stdin: bytes = b""
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 30.0


class BuildRequest(_Message, frozen=True):
    """caller -> ``sandbox.build``: an image built from ``context`` (a tar archive holding
    ``dockerfile``), for ``SandboxSpec.image``. ``timeout_s``: at most the service's own bound
    (setting ``sandbox.build_timeout_s``)."""

    context: Annotated[bytes, msgspec.Meta(min_length=1)]
    # A path inside the context: no leading '/', no '..' segment.
    dockerfile: Annotated[str, msgspec.Meta(pattern=r"^(?!(.*/)?\.\.(/|$))[A-Za-z0-9._-][A-Za-z0-9._/-]*$",
                                            max_length=255)] = "Dockerfile"
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 600.0


class Created(_Reply, frozen=True, tag="created"):
    """``sandbox.create`` -> caller."""

    id: str
    reused: bool = False  # True when the idempotency key named a live sandbox


class ExecResult(_Reply, frozen=True, tag="exec_result"):
    """``exec`` and ``run`` -> caller. Output is decoded as UTF-8 (bad bytes replaced) and
    cut at the service's limit, said by ``*_truncated``. ``timed_out``: the command was
    killed at ``timeout_s`` (``exit_code`` is then -9). A negative exit code is the signal
    that ended the command."""

    exit_code: int
    stdout: str
    stderr: str
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    duration_s: float = 0.0


class FileWritten(_Reply, frozen=True, tag="file_written"):
    size_bytes: int


class FileData(_Reply, frozen=True, tag="file_data"):
    data: bytes


class Destroyed(_Reply, frozen=True, tag="destroyed"):
    """``destroy`` / ``destroy_by_label`` -> caller: how many sandboxes were destroyed."""

    count: int


class Built(_Reply, frozen=True, tag="built"):
    """``sandbox.build`` -> caller: the image's tag (``flywheel-build:<hash>``), whether it was
    built before (``cached``), its size and how long this request took."""

    image: str
    cached: bool
    size_mb: float
    duration_s: float


class ErrorReply(_Reply, frozen=True, tag="error"):
    """Any request -> caller, when it cannot be done; ``error`` says why and what to do."""

    kind: str
    error: str


REQUEST_TYPES: dict[str, type[_Message]] = {
    "create": CreateRequest,
    "run": RunRequest,
    "exec": ExecRequest,
    "write_file": WriteFileRequest,
    "read_file": ReadFileRequest,
    "destroy": DestroyRequest,
    "destroy_by_label": DestroyByLabelRequest,
    "build": BuildRequest,
}
POOLED_OPS = ("create", "run", "build")  # queue group subjects; the rest go to the replica holding the sandbox
REPLY_TYPES: dict[str, type[_Reply]] = {
    "create": Created, "run": ExecResult, "exec": ExecResult, "write_file": FileWritten,
    "read_file": FileData, "destroy": Destroyed, "destroy_by_label": Destroyed, "build": Built,
}


class SandboxError(Exception):
    """A request the sandbox service could not do; ``kind`` says which sort of failure."""

    def __init__(self, kind: str, error: str) -> None:
        super().__init__(error)
        self.kind = kind
        self.error = error


def instance_token(instance: str) -> str:
    """A service instance name made safe as one subject token."""
    return INSTANCE_TOKEN.sub("_", instance)


def subject(op: str, instance: str | None = None) -> str:
    if op in POOLED_OPS:
        return f"sandbox.{op}"
    assert instance is not None, op
    return f"sandbox.{instance_token(instance)}.{op}"


def instance_of(sandbox_id: str) -> str:
    """The service instance that holds a sandbox, from its id (``<hex>@<instance>``)."""
    _, sep, instance = sandbox_id.partition("@")
    if not sep or not instance or INSTANCE_TOKEN.search(instance):
        raise SandboxError("invalid_request", f"id {sandbox_id!r} is not a sandbox id (expected '<hex>@<instance>', "
                                              "as returned by create)")
    return instance


_encoder = msgspec.json.Encoder()
_reply_decoders = {op: msgspec.json.Decoder(reply | ErrorReply) for op, reply in REPLY_TYPES.items()}


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


class SandboxClient:
    """Talks to the sandbox service over a connected :class:`flywheel.contract.bus.Bus`.

    Every method is a coroutine and raises :class:`SandboxError` on an error reply. The
    ``box`` argument is the id :meth:`create` returned. Safe to share between tasks.
    """

    def __init__(self, bus: Bus, request_timeout_s: float = 60.0) -> None:
        """``request_timeout_s``: how long create, file and destroy requests wait; an exec
        waits its own ``timeout_s`` plus a margin."""
        self.bus = bus
        self.request_timeout_s = request_timeout_s

    async def _request(self, op: str, message: msgspec.Struct, timeout_s: float, instance: str | None = None) -> Any:
        import nats.errors

        subj = subject(op, instance)
        try:
            msg = await self.bus.nc.request(subj, encode(message), timeout=timeout_s)
        except nats.errors.NoRespondersError:
            gone = " or the replica holding this sandbox has stopped" if instance else ""
            raise SandboxError("unavailable", f"no sandbox service answers on {subj}: start one "
                                              f"(python -m flywheel_sandbox, or flywheel up){gone}") from None
        except nats.errors.TimeoutError:
            raise SandboxError("unavailable", f"{subj}: no answer within {timeout_s:.0f} s") from None
        reply = _reply_decoders[op].decode(msg.data)
        if isinstance(reply, ErrorReply):
            raise SandboxError(reply.kind, reply.error)
        return reply

    async def create(self, spec: SandboxSpec | None = None, idempotency_key: str | None = None) -> str:
        """Start a sandbox (from the warm pool when the spec allows); returns its id."""
        request = CreateRequest(spec=_metered(spec), idempotency_key=idempotency_key)
        reply = await self._request("create", request, self.request_timeout_s)
        return reply.id

    async def exec(self, box: str, cmd: str | list[str], cwd: str | None = None, env: Mapping[str, str] | None = None,
                   stdin: bytes | str = b"", timeout_s: float = 30.0) -> ExecResult:
        """Run ``cmd`` in the sandbox; a string through bash, a list as argv."""
        data = stdin.encode() if isinstance(stdin, str) else stdin
        request = ExecRequest(id=box, cmd=cmd, cwd=cwd, env=dict(env or {}), stdin=data, timeout_s=timeout_s)
        return await self._request("exec", request, timeout_s + REQUEST_MARGIN_S, instance_of(box))

    async def write_file(self, box: str, path: str, data: bytes | str, mode: int = 0o644) -> int:
        """Write a file (parents are made); returns its size in bytes."""
        payload = data.encode() if isinstance(data, str) else data
        reply = await self._request("write_file", WriteFileRequest(id=box, path=path, data=payload, mode=mode),
                                    self.request_timeout_s, instance_of(box))
        return reply.size_bytes

    async def read_file(self, box: str, path: str) -> bytes:
        reply = await self._request("read_file", ReadFileRequest(id=box, path=path), self.request_timeout_s,
                                    instance_of(box))
        return reply.data

    async def destroy(self, box: str) -> bool:
        """Stop the sandbox and everything in it; False when it was already gone."""
        reply = await self._request("destroy", DestroyRequest(id=box), self.request_timeout_s, instance_of(box))
        return reply.count > 0

    async def destroy_by_label(self, labels: Mapping[str, str]) -> int:
        """Destroy, on every live replica, each sandbox whose labels include all of ``labels``;
        returns how many."""
        from flywheel.contract.service import read_heartbeats

        instances = [b.instance for b in await read_heartbeats(self.bus) if b.service == SERVICE_NAME]
        total = 0
        for instance in instances:
            reply = await self._request("destroy_by_label", DestroyByLabelRequest(labels=dict(labels)),
                                        self.request_timeout_s, instance)
            total += reply.count
        return total

    async def run(self, cmd: str | list[str], files: Mapping[str, bytes | str] | None = None,
                  spec: SandboxSpec | None = None, stdin: bytes | str = b"", timeout_s: float = 30.0) -> ExecResult:
        """One shot for verifiers: a fresh sandbox, ``files`` written, ``cmd`` run, sandbox gone."""
        encoded = {path: (d.encode() if isinstance(d, str) else d) for path, d in (files or {}).items()}
        data = stdin.encode() if isinstance(stdin, str) else stdin
        request = RunRequest(cmd=cmd, files=encoded, spec=_metered(spec), stdin=data, timeout_s=timeout_s)
        return await self._request("run", request, timeout_s + self.request_timeout_s)

    async def build(self, context: bytes, dockerfile: str = "Dockerfile", timeout_s: float = 600.0) -> Built:
        """The image of ``context`` (a tar archive; :func:`context_archive`), built once by the
        service (docker backend); ``Built.image`` goes in ``SandboxSpec.image``."""
        request = BuildRequest(context=context, dockerfile=dockerfile, timeout_s=timeout_s)
        built: Built = await self._request("build", request, timeout_s + self.request_timeout_s)
        return built

    @contextlib.asynccontextmanager
    async def session(self, spec: SandboxSpec | None = None) -> AsyncIterator[str]:
        """``async with client.session(spec) as box:`` a sandbox destroyed on the way out."""
        box = await self.create(spec)
        try:
            yield box
        finally:
            await self.destroy(box)


def context_archive(folder: Path) -> bytes:
    """``folder`` (a build context: a Dockerfile and what it copies) as a tar archive that is the
    same bytes for the same files: sorted, no times or owners, modes kept; symbolic links and
    other special files are refused (a ValueError naming the path)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(folder).as_posix()
            if path.is_symlink() or not (path.is_file() or path.is_dir()):
                raise ValueError(f"{path}: a build context holds plain files and folders only")
            info = tarfile.TarInfo(rel)
            info.mode = path.stat().st_mode & 0o777
            if path.is_dir():
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                data = path.read_bytes()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def build_tag(context: bytes, dockerfile: str = "Dockerfile") -> str:
    """The tag the service gives the image of ``context``: its content hash, so the same files
    are built once."""
    digest = hashlib.sha256(dockerfile.encode() + b"\0" + context).hexdigest()
    return f"{BUILD_REPOSITORY}:{digest[:48]}"


BUILD_REPOSITORY = "flywheel-build"


# --- the rollout's session ------------------------------------------------------------------

SESSION_RESOURCE = "flywheel.sdk.sandbox_tools.session"
NO_SERVICE = "start the sandbox service (flywheel up) or set nats_url"
# Errors of the service itself (not of what the model ran): the rollout fails rather than go on.
SERVICE_FAILURES = frozenset({"unavailable", "capacity", "not_found"})
# How long a create waits while the service is at its cap of live sandboxes (then the error stands).
CAPACITY_WAIT_S = 120.0


class SandboxUnavailable(RuntimeError):
    """The sandbox service cannot serve this rollout; the message says what to start or set."""


def service_unavailable(exc: SandboxError) -> SandboxUnavailable:
    return SandboxUnavailable(f"sandbox service: {exc.error} ({NO_SERVICE})")


async def when_there_is_room(start: Callable[[], Awaitable[T]], give_up: asyncio.Event | None = None) -> T:
    """``start()`` (a create or a one-shot run), tried again with backoff while the service is at
    its cap of live sandboxes, for up to :data:`CAPACITY_WAIT_S` or until ``give_up`` is set: many
    rollouts or rewards at once wait for sandboxes to free up rather than fail. An attempt under
    way is never cut short (the sandbox it makes must be known to be destroyed)."""
    stop = give_up or asyncio.Event()

    def at_capacity(exc: BaseException) -> bool:
        return isinstance(exc, SandboxError) and exc.kind == "capacity" and not stop.is_set()

    async def wait(delay_s: float) -> None:
        with contextlib.suppress(TimeoutError):  # asyncio.timeout, not wait_for: see bus.wait_at_most
            async with asyncio.timeout(delay_s):
                await stop.wait()

    return await retry(start, SANDBOX_CAPACITY, transient=at_capacity, timeout_s=CAPACITY_WAIT_S, wait=wait)


# --- the rollout's session ------------------------------------------------------------------


async def sandbox_session(ctx: RolloutContext, spec: SandboxSpec | None = None) -> tuple[SandboxClient, str]:
    """The rollout's sandbox (client and id), created from ``spec`` on the first call and
    destroyed when the rollout's context closes. Later calls return the same one (their
    ``spec`` is not looked at)."""
    client = ctx.sandbox_client
    if client is None:
        raise SandboxUnavailable(f"no sandbox service for this rollout: {NO_SERVICE}")
    pending: asyncio.Future[str] | None = ctx.resources.get(SESSION_RESOURCE)
    if pending is None:
        spec = spec or SandboxSpec()
        label = ctx.rollout_id or f"local-{secrets.token_hex(8)}"
        run = {RUN_LABEL: ctx.run} if ctx.run else {}  # metered to the run (sandbox seconds)
        spec = msgspec.structs.replace(spec, labels={**spec.labels, ROLLOUT_LABEL: label, **run})
        ended = asyncio.Event()
        pending = asyncio.ensure_future(when_there_is_room(functools.partial(client.create, spec), ended))
        ctx.resources[SESSION_RESOURCE] = pending

        async def destroy_session() -> None:
            ended.set()  # a create still waiting for room stops waiting; one under way finishes
            try:
                box = await pending
            except SandboxError:
                return  # never made
            await client.destroy(box)

        ctx.on_close(destroy_session)
    try:
        return client, await asyncio.shield(pending)
    except SandboxError as exc:
        raise service_unavailable(exc) if exc.kind in SERVICE_FAILURES else SandboxUnavailable(
            f"the rollout's sandbox could not be created: {exc}") from exc
