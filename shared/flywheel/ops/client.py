"""Publish tasks and read the bus's state from Python, without the gateway.

The bus is open to anyone: this is the few lines it takes from Python (the ``flywheel tasks
publish`` and ``flywheel status`` commands are thin wrappers around it)::

    from flywheel.ops.client import Client

    async with await Client.connect("nats://127.0.0.1:4233") as fw:
        ids = await fw.publish_tasks(run="r1", env="reverse-text", rows=[{"text": "abc"}], num_rollouts=4)

or, outside an event loop, ``flywheel.ops.client.publish_tasks(...)`` with the same arguments.

Task ids are :func:`flywheel.contract.events.task_id`'s, as every producer makes them (the
gateway, ``flywheel run``, ``flywheel eval``): a row with a top-level string ``"id"`` keeps it
as its task id; any other row gets a deterministic id, uuid5 over (run, env, position,
canonical row), where the position is the 1-based line number of a JSONL file or the 1-based
index in ``rows``. Publishing the same rows again therefore stores nothing new: the server
drops a repeated ``Nats-Msg-Id`` within its duplicate window (``BusConfig.duplicate_window_s``,
two minutes by default), and the trace store upserts by id whenever the repeat comes. Past the
window the server stores the repeat (and inference rolls it out again): it cannot tell, so
republish on purpose only. Everything is validated before anything is published, so a bad row
publishes nothing from its batch. Publishing also registers the run in the runs KV bucket
(:class:`flywheel.contract.events.RunState`, owned by ``tenant``) when it is not there yet; as
in the gateway, a run that belongs to another tenant is refused.

:class:`TraceAPI` reads what the gateway recorded, over HTTP: rollouts by filter (every
page), a JSONL export, a trace graph and one branch of it, and a rollout followed live::

    from flywheel.ops.client import TraceAPI

    async with TraceAPI("http://127.0.0.1:8420") as api:
        num = await api.export("sft.jsonl", run="r1", min_reward=1.0, error=False)
        async for event, data in api.follow(rollout_id):  # "node", ..., then "rollout"
            ...

Not covered: creating runs with a training config.
"""

from __future__ import annotations

import asyncio
import fnmatch
import functools
import json
import logging
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import msgspec
import nats.js.errors

from flywheel.contract import events
from flywheel.contract.bus import STREAMS, Bus, BusConfig, PayloadTooLarge
from flywheel.contract.names import check_key
from flywheel.contract.runs import consumer_row, get_run, register_run
from flywheel.contract.service import HEARTBEAT_INTERVAL_S, read_heartbeats
from flywheel.runtime.tasks import make_tasks
from flywheel.sdk import gateway

log = logging.getLogger(__name__)

def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Each ``(line number, row)`` of a JSONL file, read as it is iterated; blank lines are skipped.

    Raises ValueError naming ``file:line`` for a line that is not a JSON object, and for a
    file without rows.
    """
    path = Path(path)
    num_rows = 0
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not valid JSON: {exc}") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_no}: a task row must be a JSON object, got {type(row).__name__}")
            num_rows += 1
            yield line_no, row
    if not num_rows:
        raise ValueError(f"{path}: no task rows (the file is empty)")


@dataclass(frozen=True)
class Published:
    """What one publish did: the task ids in order, how many were new, and the runs created."""

    ids: list[str]
    num_duplicates: int
    runs_created: list[str]

    @property
    def num_new(self) -> int:
        return len(self.ids) - self.num_duplicates


class Client:
    """A connection to the bus for publishing tasks and reading state. Use as ``async with``."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    @classmethod
    async def connect(cls, url: str | None = None, *, name: str = "flywheel-client",
                      config: BusConfig | None = None, ensure: bool = True) -> Client:
        """Connect to ``url`` (default: the one settings resolve to, see flywheel.contract.settings).

        ``ensure`` creates the streams and buckets when missing (needed to publish);
        a reader such as ``flywheel status`` passes False so it changes nothing.
        """
        if url is None:
            from flywheel.contract.settings import Settings

            url = Settings.load().resolved_nats_url
        return cls(await Bus.connect(url, name=name, config=config, ensure=ensure))

    async def close(self) -> None:
        await self.bus.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # --- publishing -----------------------------------------------------------------------

    async def publish_tasks(self, *, run: str, env: str, rows: Iterable[dict[str, Any]], num_rollouts: int = 1,
                            sampling: events.Sampling | None = None, tenant: str = "default") -> list[str]:
        """Publish one task per row (see the module docstring for ids); returns the task ids."""
        tasks = make_tasks(run, env, enumerate(rows, 1), num_rollouts=num_rollouts, sampling=sampling)
        return (await self.publish(tasks, tenant=tenant)).ids

    async def publish(self, tasks: Sequence[events.Task], *, tenant: str = "default") -> Published:
        """Publish built tasks: check sizes, register their runs, then publish them all."""
        check_key("tenant", tenant)
        for i, task in enumerate(tasks, 1):  # all before anything is registered or sent
            try:
                self.bus.check_fits(task)
            except PayloadTooLarge as exc:
                raise ValueError(f"task {task.id} (number {i}) is {exc.size} bytes as published (payload and "
                                 f"headers); the NATS server accepts at most {exc.limit} (its max_payload)") from exc
        runs = dict.fromkeys(t.run for t in tasks)  # each once, in order
        runs_created = [run for run in runs if await self.register_run(run, tenant=tenant)]
        acks = await self.bus.publish_many(tasks)
        return Published(ids=[t.id for t in tasks], num_duplicates=sum(1 for a in acks if a.duplicate),
                         runs_created=runs_created)

    async def register_run(self, run: str, *, tenant: str = "default") -> bool:
        """Create the run in the runs KV bucket, owned by ``tenant``; False when it was there.

        A run belongs to the tenant that named it first (as in the gateway): a run of
        another tenant is a ValueError.
        """
        return (await register_run(self.bus, run, tenant))[1]

    async def run_state(self, run: str) -> events.RunState | None:
        return await get_run(self.bus, run)

    # --- reading state --------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        """Services (heartbeats), the embedded stack's view, Flywheel streams' depth and their
        consumers' lag.

        Plain data (JSON-ready): ``services``, ``stacks``, ``streams`` and ``consumers`` lists.
        A stream that does not exist yet is left out. ``age_s`` is the time since a service's
        last heartbeat; ``stale`` says it missed two (it has likely died: the key expires later).
        ``stacks`` has one entry per ``flywheel up`` (or ``flywheel run`` that started the
        stack): its ``processes`` as its supervisor sees them (pid, state, restarts, last exit,
        log; ``next_start_in_s`` while one backs off) and ``failing``, the names of those that
        exited and are not running again yet.
        """
        from flywheel.ops.stack import STACK_SERVICE

        now = events.utc_now()
        try:
            beats = await read_heartbeats(self.bus)
        except nats.js.errors.BucketNotFoundError:
            beats = []  # nothing has ensured the buckets yet: no service ever ran here

        services = [{"service": b.service, **_heartbeat(now, b)} for b in beats if b.service != STACK_SERVICE]
        stacks = []
        for beat in (b for b in beats if b.service == STACK_SERVICE):
            try:
                stacks.append(_stack(now, beat))
            except (msgspec.ValidationError, ValueError) as exc:  # anyone may write the bucket
                log.warning("services bucket: %s.%s is not a stack's view (%s: %s); skipped", beat.service,
                            beat.instance, type(exc).__name__, exc)
        existing = {info.config.name: info for info in await self.bus.js.streams_info()}
        streams, consumers = [], []
        for name in STREAMS:
            info = existing.get(name)
            if info is None:
                continue
            placed = info.cluster
            peers = (placed.replicas or []) if placed else []
            behind = sorted(str(p.name) for p in peers if p.offline or not p.current)
            streams.append({"stream": name, "messages": info.state.messages, "bytes": info.state.bytes,
                            "consumers": info.state.consumer_count, "replicas": info.config.num_replicas or 1,
                            "leader": placed.leader if placed else None, "replicas_behind": behind})
            for c in sorted(await self.bus.js.consumers_info(name), key=lambda c: c.name):
                row = consumer_row(name, c)
                consumers.append({**row, "last_active": row["last_active"] and row["last_active"].isoformat()})
        return {"services": services, "stacks": stacks, "streams": streams, "consumers": consumers}

    async def remove_consumers(self, stream: str, patterns: Sequence[str], force: bool = False) -> list[str]:
        """Delete the consumers of ``stream`` whose names match ``patterns`` (shell patterns:
        ``scorer-mine-*``); their names. A consumer a process reads now (:func:`consumer_row`'s
        ``pulled``) is refused unless ``force``, and so is a pattern that matches nothing: a
        ValueError naming them, before anything is deleted."""
        if stream not in STREAMS:
            raise ValueError(f"stream {stream!r}: not a Flywheel stream (one of {', '.join(STREAMS)})")
        rows = [consumer_row(stream, c) for c in await self.bus.js.consumers_info(stream)]
        unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(r["consumer"], p) for r in rows)]
        if unmatched:
            raise ValueError(f"no consumer of {stream} matches {', '.join(map(repr, unmatched))}; `flywheel status` "
                             "lists them")
        chosen = [r for r in rows if any(fnmatch.fnmatchcase(r["consumer"], p) for p in patterns)]
        busy = [r for r in chosen if r["pulled"]]
        if busy and not force:
            raise ValueError(
                "a process reads " + ", ".join(f"{r['consumer']} ({r['num_waiting']} pulls waiting, "
                                               f"{r['num_ack_pending']} delivered and not acked)" for r in busy)
                + ": stop it first (its durable would be made again), or pass --force")
        for r in chosen:
            try:
                await self.bus.retry(functools.partial(self.bus.js.delete_consumer, stream, r["consumer"]))
            except nats.js.errors.NotFoundError:  # deleted meanwhile
                pass
        return [r["consumer"] for r in chosen]


class GatewayError(ValueError):
    """The gateway refused a request; the message is its ``detail`` (naming the bad parameter)."""

    def __init__(self, status_code: int, detail: str) -> None:
        super().__init__(f"gateway answered {status_code}: {detail}")
        self.status_code = status_code


class ExportCut(GatewayError):
    """An export that did not end with its ``end`` line: the gateway's error line, or the answer
    breaking off without one (a gateway killed mid-stream, a connection cut). ``path`` holds
    the ``num_rollouts`` rollouts that arrived, and no end line, so the file says it is cut too."""

    def __init__(self, path: str | Path, num_rollouts: int, reason: str) -> None:
        ValueError.__init__(self, f"{path}: the export was cut after {num_rollouts} rollouts ({reason}); the file "
                                  "holds those, without the end line of a complete export: export again")
        self.status_code = 200  # the answer had started
        self.path = Path(path)
        self.num_rollouts = num_rollouts


def _query(filters: dict[str, Any]) -> dict[str, str]:
    """Query parameters as the gateway reads them: booleans lower case, times in RFC 3339."""
    out = {}
    for name, value in filters.items():
        if value is None:
            continue
        if isinstance(value, datetime) and value.tzinfo is None:
            raise ValueError(f"{name}={value.isoformat()}: give a time zone (e.g. datetime.now(UTC))")
        out[name] = str(value).lower() if isinstance(value, bool) else (
            value.isoformat() if isinstance(value, datetime) else str(value))
    return out


class TraceAPI:
    """The gateway's trace API (docs/api.md, "The trace API"). Use as ``async with``.

    Filters are the query parameters of ``GET /v1/rollouts`` as keyword arguments (``run``,
    ``env``, ``status``, ``error``, ``min_reward``, ``created_after``, ...); a refused one
    raises :class:`GatewayError` with the gateway's message.
    """

    def __init__(self, url: str | None = None, *, timeout_s: float = 30.0, api_key: str | None = None) -> None:
        """``url`` and ``api_key`` (a tenant's key, for a gateway that wants keys): the settings'
        ``gateway_url`` and ``api_key`` when not given."""
        self.http = gateway.async_client(url, api_key, timeout_s=timeout_s)

    async def __aenter__(self) -> TraceAPI:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.http.aclose()

    async def _get(self, path: str, **params: Any) -> Any:
        response = await self.http.get(path, params=_query(params))
        await _raise_for(response)
        return response.json()

    async def rollouts(self, *, page_size: int = 100, **filters: Any) -> AsyncIterator[dict[str, Any]]:
        """Every rollout the filters keep, newest first, following the cursor page by page."""
        cursor = None
        while True:
            page = await self._get("/v1/rollouts", limit=page_size, cursor=cursor, **filters)
            for item in page["items"]:
                yield item
            cursor = page["next_cursor"]
            if cursor is None:
                return

    async def export(self, path: str | Path, *, tokens: bool = False, **filters: Any) -> int:
        """Write ``GET /v1/rollouts/export`` to ``path`` as it streams in; returns the number of rollouts.

        The file is what the gateway sent, its last line ``{"end": {"num_rollouts": N}}``
        included: a file that ends with it is a complete export, whoever reads it later, and
        one without it is not (``flywheel sft`` skips the end line). An export that ends any
        other way raises :class:`ExportCut` (a :class:`GatewayError`) naming the file and how
        many rollouts arrived, once they are written: the gateway's ``{"error": ...}`` line (its
        reason), or the answer breaking off without the end line (the gateway killed, the
        connection cut or timing out), which writes no error line at all."""
        num_rollouts = 0
        end_line: str | None = None  # written once the answer has closed right after it, never before
        async with self.http.stream("GET", "/v1/rollouts/export", params=_query({"tokens": tokens, **filters})) as r:
            await _raise_for(r)
            # One open, then buffered writes of the lines as the network delivers them: microseconds each.
            with Path(path).open("w", encoding="utf-8") as f:  # noqa: ASYNC230 - see above
                try:
                    async for line in r.aiter_lines():
                        if not line:
                            continue
                        if end_line is not None:
                            raise ExportCut(path, num_rollouts, f"a line after the end line: {line[:100]!r}")
                        # A rollout's line starts with its id (the gateway writes it first): no need to parse it.
                        kind, value = ("rollout", None) if line.startswith('{"id"') else _line_kind(line)
                        if kind == "error":
                            raise ExportCut(path, num_rollouts, f"the gateway: {value}")
                        if kind == "unknown":
                            raise ExportCut(path, num_rollouts, "a line that is neither a rollout, the end line nor "
                                                                f"an error line: {line[:100]!r}")
                        if kind == "end":
                            if not isinstance(value, dict) or value.get("num_rollouts") != num_rollouts:
                                raise ExportCut(path, num_rollouts, f"its end line counts {value!r}")
                            end_line = line
                            continue
                        num_rollouts += 1
                        f.write(line + "\n")
                except httpx.TransportError as exc:
                    raise ExportCut(path, num_rollouts, f"the answer broke off without the end line: "
                                                        f"{type(exc).__name__}: {exc}") from exc
                if end_line is None:
                    raise ExportCut(path, num_rollouts, "the answer closed without the end line")
                f.write(end_line + "\n")
        return num_rollouts

    async def usage(self, **filters: Any) -> dict[str, Any]:
        """``GET /v1/usage``: tokens used by tenant, run and source, and their cost (filters
        ``tenant``, ``run``, ``since``, ``until``; ``recount=True`` with ``run``)."""
        return await self._get("/v1/usage", **filters)

    async def trace(self, rollout_id: str, *, tokens: bool = False) -> dict[str, Any]:
        return await self._get(f"/v1/traces/{rollout_id}", tokens=tokens)

    async def branch(self, rollout_id: str, node_id: str, *, tokens: bool = False) -> dict[str, Any]:
        return await self._get(f"/v1/traces/{rollout_id}/branches/{node_id}", tokens=tokens)

    async def follow(self, rollout_id: str, *, tokens: bool = False) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """The live stream: ``("node", node)`` for each trace node, then ``("rollout", rollout)``."""
        async with self.http.stream("GET", f"/v1/traces/{rollout_id}/stream", params=_query({"tokens": tokens}),
                                    timeout=httpx.Timeout(self.http.timeout.connect, read=None)) as r:
            await _raise_for(r)
            async for item in server_sent_events(r):
                yield item


async def server_sent_events(response: httpx.Response) -> AsyncIterator[tuple[str, Any]]:
    """``(event, data)`` for each server-sent event of ``response`` (data is JSON); comments are skipped."""
    event = ""
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: "):
            yield event, json.loads(line.removeprefix("data: "))


def _line_kind(line: str) -> tuple[str, Any]:
    """What an export line is: ``("rollout", None)``, ``("end", its counts)``, ``("error", its
    reason)``, or ``("unknown", None)`` for a line that is none of them (not JSON, cut part way)."""
    try:
        found = json.loads(line)
    except json.JSONDecodeError:
        return "unknown", None
    if not isinstance(found, dict):
        return "unknown", None
    if "id" in found:
        return "rollout", None
    for kind in ("end", "error"):
        if kind in found and len(found) == 1:
            return kind, found[kind]
    return "unknown", None


async def _raise_for(response: httpx.Response) -> None:
    if response.status_code >= 400:
        await response.aread()
        raise GatewayError(response.status_code, gateway.detail_of(response))


def _seconds(now: datetime, then: datetime) -> float:
    return round((now - then).total_seconds(), 1)


def _heartbeat(now: datetime, beat: events.ServiceHeartbeat) -> dict[str, Any]:
    # A heartbeat lingers for its TTL after its process died; two missed beats mark it stale.
    return {"instance": beat.instance, "pid": beat.pid, "host": beat.host, "status": beat.status,
            "age_s": _seconds(now, beat.updated_at), "stale": _seconds(now, beat.updated_at) > 2 * HEARTBEAT_INTERVAL_S,
            "uptime_s": _seconds(now, beat.started_at), "info": beat.info}


class _ProcessView(msgspec.Struct):
    """What status reads of one process in a stack's view (flywheel.ops.stack.Process.view)."""

    name: str
    pid: int | None
    state: str
    num_restarts: int
    num_failures: int
    last_exit: str | None
    log: str
    next_start_at: str | None = None


class _StackView(msgspec.Struct):
    """What status reads of a stack's view (flywheel.ops.stack.Stack.view), checked before use:
    anyone may write the services bucket."""

    restart_backoff_s: float
    max_backoff_s: float
    healthy_after_s: float
    processes: list[_ProcessView]


def _stack(now: datetime, beat: events.ServiceHeartbeat) -> dict[str, Any]:
    """A stack's heartbeat and its view (flywheel.ops.stack.Stack.view), with the wait until each
    next start and the names of the processes that exited and do not run again yet."""
    msgspec.convert(beat.info, _StackView)  # raises ValidationError, naming what does not fit
    processes = []
    for process in beat.info.get("processes", []):
        next_start_at = process.get("next_start_at")
        wait_s = None if next_start_at is None else max(0.0, -_seconds(now, datetime.fromisoformat(next_start_at)))
        processes.append(process | {"next_start_in_s": wait_s})
    policy = {key: value for key, value in beat.info.items() if key != "processes"}
    failing = [p["name"] for p in processes if p["state"] in ("backing off", "restarting")]
    return _heartbeat(now, beat) | policy | {"processes": processes, "failing": failing}


def publish_tasks(url: str | None = None, *, run: str, env: str, rows: Iterable[dict[str, Any]],
                  num_rollouts: int = 1, sampling: events.Sampling | None = None,
                  tenant: str = "default") -> list[str]:
    """:meth:`Client.publish_tasks` for code that runs no event loop; returns the task ids."""

    async def go() -> list[str]:
        async with await Client.connect(url) as fw:
            return await fw.publish_tasks(run=run, env=env, rows=rows, num_rollouts=num_rollouts,
                                          sampling=sampling, tenant=tenant)

    return asyncio.run(go())
