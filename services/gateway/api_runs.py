"""``/v1/runs``: runs, how far they got, and their training metrics step by step.

A run's detail joins two sources: the trace store (tenant copy, counts of tasks, rollouts
and scored rollouts, each step's metrics from the trainer's weight updates) and the
run-state bucket, read live (status, config, and the tenant, which the bucket owns). A run
is found when either knows it: one created in the bucket (by the gateway or ``flywheel
run``) shows before any of its events is recorded. The listing is the store's alone.

The status shown is the one :func:`flywheel.contract.runs.end_of` derives: a ``running`` run whose
owner stopped renewing its lease shows ``abandoned``, with ``ended_at`` (when the lease
expired) and ``reason``. A run whose entry in the bucket does not decode (something other
than Flywheel wrote it) is a 409 naming the key and what to do, not a run without state: its
tenant and status are unknown, and showing it like a run published straight to the bus
would hide the problem. Its metrics, which come from the store alone, are still served. Both
to the operator alone (an open gateway, the service token): a tenant's key gets the 404 of a
run that does not exist for it, as for another tenant's run (:mod:`flywheel_gateway.auth`).

Run ids may contain ``/``, so the routes take the rest of the path as the id
(``/v1/runs/team/a/metrics`` is run ``team/a``). ``POST /v1/runs/RUN/stop`` and
``.../resume`` stop and resume a run as ``flywheel runs stop`` and ``resume`` do (the
orchestrator that owns it acts on its state). Not covered: deleting runs.

``POST /v1/runs`` starts a run from a config (TOML, or a JSON object), owned by the caller's
tenant: checked as ``flywheel run`` checks it (a 422 names each bad field; an import path is
refused, a tenant's config names none), within the tenant's quotas (setting ``[quotas]``: a 429
names the limit), and registered in the run-state bucket as given (``prepared`` false). The
orchestrator that claims it loads its environments in its workers (installing hub ones),
writes the config as registered and runs it; a config whose environments do not load fails
the run, and its status says why (``GET /v1/runs/RUN``, its stream).

``GET /v1/runs/RUN/stream`` follows a run over server-sent events (:mod:`flywheel_gateway.sse`):
its status, its steps as the recorder stores them, and its end. It reads the store and the
run-state bucket every ``STREAM_POLL_S`` on the server (the store is what the recorder
writes; a step is there once it is recorded), so a client holds one connection instead of
polling ``/metrics`` with ``since_step`` (which still works). A stream lasts ``STREAM_MAX_S``
at most (a run that is created and never runs would hold it forever).
"""

from __future__ import annotations

import asyncio
import json
import time
import tomllib
from collections.abc import Awaitable
from datetime import UTC, datetime
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import StreamingResponse

from flywheel.contract import events, runs
from flywheel.contract.bus import Bus
from flywheel.contract.config import RunConfig
from flywheel.contract.keys import Caller
from flywheel.contract.settings import QuotaSettings
from flywheel.sdk.environment import available
from flywheel_gateway import sse
from flywheel_gateway.auth import CallerDep, check_run, listing_tenant, run_not_found
from flywheel_gateway.deps import BusDep, CursorQuery, LimitQuery, RunIdPath, StoreDep, TenantQuery
from flywheel_gateway.models import INT32_MAX, RunDetail, RunMetricsPublic, RunPage, StepMetricsPublic
from flywheel_gateway.responses import CONFLICT_RESPONSE, ERROR_RESPONSES
from flywheel_gateway.store import MAX_PAGE_LIMIT, Store

router = APIRouter(prefix="/v1/runs", tags=["runs"], responses=ERROR_RESPONSES)
SinceStepQuery = Annotated[int | None, Query(ge=-1, le=INT32_MAX, description="Only steps after this one (-1: from "
                                                                              "the first, as leaving it out).")]
STREAM_POLL_S = 1.0  # how often a run's stream reads the store for new steps and the bucket for its status
STREAM_MAX_S = 3600.0  # a run's stream closes after this long (no end event): the client goes on with since_step


@router.get("", response_model=RunPage)
async def list_runs(store: StoreDep, who: CallerDep, limit: LimitQuery = 50, cursor: CursorQuery = None,
                    tenant: TenantQuery = None) -> RunPage:
    """Runs the trace store knows, newest first; ``tenant`` keeps one tenant's (with an API key:
    its own, always)."""
    page = await store.list_runs(tenant=listing_tenant(who, tenant), cursor=cursor, limit=limit)
    return RunPage.model_validate(page, from_attributes=True)


CONFIG_TYPES = ("application/toml", "application/json", "text/plain")
MAX_CONFIG_BYTES = 256 * 1024


@router.post("", response_model=RunDetail, status_code=201,
             responses={409: CONFLICT_RESPONSE, 413: {"description": "A config over 256 KiB."},
                        415: {"description": "A body of another type than TOML or JSON."},
                        422: {"description": "A config that does not validate: each bad field named."},
                        429: {"description": "Over one of the tenant's quotas, named."}},
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/toml": {"schema": {"type": "string"}},
                 "application/json": {"schema": {"type": "object"}}}}})
async def create_run(request: Request, store: StoreDep, bus: BusDep, who: CallerDep) -> RunDetail:
    """Start a training run from its config (the body: TOML, or a JSON object), as ``flywheel run``
    does, owned by the caller's tenant. The config's ``tenant``, when it names one, must be
    the caller's. 201 with the run (status ``created``: an orchestrator takes it within seconds,
    loads its environments and starts its trainer; a run whose environments do not load fails,
    saying why); 409 when a run of that id exists."""
    config = _config_of(request.headers.get("content-type", ""), await request.body())
    named = config.get("tenant")
    if named is not None and named != who.tenant:
        raise HTTPException(403, f"the config's tenant is {named!r}, but this request is tenant {who.tenant!r}'s: "
                                 "leave tenant out (a run is its caller's tenant's)")
    config["tenant"] = who.tenant
    try:
        cfg = RunConfig.parse(config, source="the run config")
    except ValueError as exc:
        raise HTTPException(422, str(exc)) from None
    await _check_environments(cfg, store, who)
    await _check_quotas(request.app.state.quotas, store, bus, who.tenant)
    state, created = await runs.get_or_create_run(bus, cfg.run, who.tenant, config=cfg.model_dump(), prepared=False)
    if not created:  # another tenant's learns nothing of it but that the id is taken
        said = f"exists already ({state.status})" if state.tenant == who.tenant else "is taken"
        raise HTTPException(409, f"run {cfg.run!r} {said}; name another run (`run` in the config)")
    await store.upsert_runs([state])
    return await get_run(cfg.run, store, bus, who)


def _config_of(content_type: str, body: bytes) -> dict[str, Any]:
    """The config a request's body holds; 413/415/422 saying what is wrong with it."""
    kind = content_type.split(";", 1)[0].strip().lower()
    if kind not in CONFIG_TYPES:
        raise HTTPException(415, f"Content-Type {kind or '(none)'}: send the run config as application/toml (a TOML "
                                 "file's text) or application/json (an object)")
    if len(body) > MAX_CONFIG_BYTES:
        raise HTTPException(413, f"the config is {len(body)} bytes, over {MAX_CONFIG_BYTES}: a run config is a few "
                                 "lines; data goes in files its environments read")
    try:
        text = body.decode()
        parsed = json.loads(text) if kind == "application/json" else tomllib.loads(text)
    except (UnicodeDecodeError, ValueError) as exc:
        what = "JSON" if kind == "application/json" else "TOML"
        raise HTTPException(422, f"the config is not valid {what}: {exc}") from None
    if not isinstance(parsed, dict):
        raise HTTPException(422, f"the config is a JSON {type(parsed).__name__}, not an object of settings")
    return parsed


async def _check_environments(cfg: RunConfig, store: Store, who: Caller) -> None:
    """422 for an environment a tenant may not run: one named by hub id (owner/name) must be one
    the services have installed, or one of the hub's that the caller sees (public, or its
    tenant's). An orchestrator installs what a run names with the deployment's own access, so
    another tenant's private environment is refused here, with the message an id nobody pushed
    gets (nothing tells the two apart)."""
    named = [("env" if not cfg.envs else f"envs.{i}.id", env.id) for i, env in enumerate(cfg.environments)]
    named += [(f"evals.{i}.id", spec.id) for i, spec in enumerate(cfg.evals)]
    installed = available()
    for where, env_id in named:
        name = env_id.partition("@")[0]
        if "/" not in name or ":" in name or name in installed:  # a module, a path, another format, the platform's
            continue
        found = await store.hub_environment(name)
        if found is None or (found["private"] and not who.sees(found["owner"])):
            raise HTTPException(422, f"{where}: {env_id!r} is no environment this tenant may run: neither installed "
                                     "with the services nor on the hub where it sees it (GET /v1/hub/environments)")


async def _check_quotas(quotas: QuotaSettings, store: Store, bus: Bus, tenant: str) -> None:
    """429 naming the quota a new run of ``tenant`` would go over (``[quotas]``; 0: none)."""
    if quotas.runs:
        live = [s.id for s in await runs.list_runs(bus) if s.tenant == tenant and s.kind == "train"
                and runs.end_of(s) is None]
        if len(live) >= quotas.runs:
            raise HTTPException(429, f"quota runs: tenant {tenant!r} has {len(live)} runs not ended "
                                     f"({', '.join(sorted(live)[:5])}), its limit (setting quotas.runs = "
                                     f"{quotas.runs}); stop one (POST /v1/runs/RUN/stop) or wait for one to end")
    if quotas.trained_tokens_per_day:
        today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        trained = sum(row["trained_tokens"] + row["sft_tokens"] for row in await store.usage(tenant=tenant,
                                                                                            since=today))
        if trained >= quotas.trained_tokens_per_day:
            raise HTTPException(429, f"quota trained_tokens_per_day: tenant {tenant!r}'s runs trained on {trained} "
                                     f"tokens since 00:00 UTC, its limit (setting quotas.trained_tokens_per_day = "
                                     f"{quotas.trained_tokens_per_day}); new runs start tomorrow")


@router.get("/{run_id:path}/metrics", response_model=RunMetricsPublic)
async def get_run_metrics(
    run_id: RunIdPath,
    store: StoreDep,
    bus: BusDep,
    who: CallerDep,
    since_step: SinceStepQuery = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_LIMIT, description="Steps at most.")] = 100,
) -> RunMetricsPublic:
    """The run's recorded steps in ascending order, each with the trainer's metrics."""
    await check_run(who, store, bus, run_id)
    if not await store.has_run(run_id) and not await _in_bucket(bus, run_id):
        raise run_not_found(run_id)
    steps = await store.list_run_metrics(run_id, since_step=since_step, limit=limit)
    return RunMetricsPublic(run=run_id, items=[StepMetricsPublic.model_validate(step) for step in steps])


@router.get("/{run_id:path}/stream", response_class=StreamingResponse,
            responses={**sse.responses("status, evals, steps..., end."), 409: CONFLICT_RESPONSE})
async def stream_run(run_id: RunIdPath, store: StoreDep, bus: BusDep, who: CallerDep,
                     since_step: SinceStepQuery = None) -> StreamingResponse:
    """Follow a run: ``status`` (``status``, ``reason``) first and whenever it changes; ``evals``
    (``items``: every eval its owner ran during training, as ``GET /v1/runs/RUN`` has them)
    whenever one is added;
    ``steps`` (as /metrics answers them) with every recorded step after ``since_step``, then
    with each new one as the recorder stores it; once the run has ended (finished, failed,
    stopped, abandoned; or a run the run-state bucket does not know) and its steps are sent,
    ``end`` (its last status) and the end of the stream. A stream closes without ``end`` after
    an hour: ask again with ``since_step``, the last step received. 409 when the run's entry
    in the bucket does not decode."""
    await check_run(who, store, bus, run_id)
    state = await runs.get_run(bus, run_id)  # BadRunState: a 409 naming the key
    if state is None and not await store.has_run(run_id):
        raise run_not_found(run_id)
    return sse.event_stream(_follow(store, bus, run_id, since_step))


async def _follow(store: Store, bus: Bus, run_id: str, since_step: int | None) -> sse.Events:
    """The run's stream: the store read for new steps, and the bucket for the run's status, every
    ``STREAM_POLL_S`` (the status first: once it says ended, the steps read after it are the last)."""
    last = -1 if since_step is None else since_step
    shown: dict[str, Any] | None = None
    quiet_s = 0.0
    deadline = time.monotonic() + STREAM_MAX_S
    evals_shown: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        try:
            state = await runs.get_run(bus, run_id)
            status = _status(state)
        except runs.BadRunState as exc:  # rewritten by something else meanwhile: nothing more to follow
            state, status = None, {"status": "unreadable", "reason": str(exc), "ended": True}
        sent = False
        if status != shown:
            shown = status
            sent = True
            yield "status", {k: status[k] for k in ("status", "reason")}
        if (evals := _evals(state)) != evals_shown:
            evals_shown = evals
            sent = True
            yield "evals", {"run": run_id, "items": evals}
        while steps := await store.list_run_metrics(run_id, since_step=last, limit=MAX_PAGE_LIMIT):
            last = steps[-1]["step"]
            sent = True
            yield "steps", RunMetricsPublic(run=run_id, items=[StepMetricsPublic.model_validate(s) for s in steps]
                                            ).model_dump(mode="json")
        if status["ended"]:
            yield "end", {k: status[k] for k in ("status", "reason")}
            return
        quiet_s = 0.0 if sent else quiet_s + STREAM_POLL_S
        if quiet_s >= sse.KEEPALIVE_S:
            quiet_s = 0.0
            yield None
        await asyncio.sleep(STREAM_POLL_S)


def _evals(state: events.RunState | None) -> list[dict[str, Any]]:
    """The evals the run's owner ran during training, as plain data (none for no state)."""
    return [msgspec.structs.asdict(point) for point in state.evals] if state is not None else []


def _status(state: events.RunState | None) -> dict[str, Any]:
    """A run's live status and why (paused, ended), and whether it ended; a run the bucket does
    not know (its events published straight to the bus) has no status and is not followed."""
    if state is None:
        return {"status": None, "reason": None, "ended": True}
    end = runs.end_of(state)
    if end is not None:
        return {"status": end.status, "reason": end.reason, "ended": True}
    return {"status": state.status, "reason": state.reason if state.status == "paused" else None, "ended": False}


async def _in_bucket(bus: Bus, run_id: str) -> bool:
    try:
        return await runs.get_run(bus, run_id) is not None
    except runs.BadRunState:
        return True  # the key is there; its value is another matter


async def _change(run_id: str, store: Store, bus: Bus, change: Awaitable[object], who: Caller) -> RunDetail:
    """Await ``change`` of the run's state, then the run as it is: 404 for a run the bucket does
    not know, 409 for one the change refuses (another tenant's, open: RunConflict, mapped by the app;
    a ValueError naming why)."""
    try:
        await change
    except runs.RunNotFound:
        raise run_not_found(run_id) from None
    except runs.RunConflict:
        raise
    except ValueError as exc:
        raise HTTPException(409, str(exc)) from None
    return await get_run(run_id, store, bus, who)


@router.post("/{run_id:path}/stop", response_model=RunDetail, responses={409: CONFLICT_RESPONSE})
async def stop_run(run_id: RunIdPath, store: StoreDep, bus: BusDep, who: CallerDep) -> RunDetail:
    """Stop the run: it takes no more tasks, and its owner stops its trainer (which checkpoints
    first) within seconds; ``flywheel runs resume RUN`` goes on from there. A run that ended
    already is left as it is. 404 for a run the bucket does not know (and, to a key, another
tenant's); 409 for another tenant's on an open gateway."""
    await check_run(who, store, bus, run_id)
    by = f"the gateway's API (tenant {who.tenant!r})"
    return await _change(run_id, store, bus, runs.stop_run(bus, run_id, by=by, tenant=who.tenant), who)


@router.post("/{run_id:path}/pause", response_model=RunDetail, responses={409: CONFLICT_RESPONSE})
async def pause_run(run_id: RunIdPath, store: StoreDep, bus: BusDep, who: CallerDep) -> RunDetail:
    """Pause the run: its owner stops its trainer (which checkpoints first) within seconds and
    holds the run, its queued tasks kept; ``POST /v1/runs/RUN/resume`` goes on. A paused run is
    left as it is. 404 for a run the bucket does not know (and, to a key, another tenant's);
    409 for another tenant's on an open gateway, and for one that ended (the detail says how)."""
    await check_run(who, store, bus, run_id)
    by = f"the gateway's API (tenant {who.tenant!r})"
    return await _change(run_id, store, bus, runs.pause_run(bus, run_id, by=by, tenant=who.tenant), who)


@router.post("/{run_id:path}/resume", response_model=RunDetail, responses={409: CONFLICT_RESPONSE})
async def resume_run(run_id: RunIdPath, store: StoreDep, bus: BusDep, who: CallerDep) -> RunDetail:
    """Resume a paused, stopped, failed or abandoned run: an orchestrator takes it (a paused one's
    owner keeps it) and goes on from its last checkpoint. 404 for a run the bucket does not
    know; 409 for another tenant's, and for one that finished, is still running, or is no
    training run (the detail says which); to a key, another tenant's run is a 404."""
    await check_run(who, store, bus, run_id)
    return await _change(run_id, store, bus, runs.resume_run(bus, run_id, tenant=who.tenant), who)


@router.get("/{run_id:path}", response_model=RunDetail, responses={409: CONFLICT_RESPONSE})
async def get_run(run_id: RunIdPath, store: StoreDep, bus: BusDep, who: CallerDep) -> RunDetail:
    """The run: tenant, live status (``abandoned`` when its owner's lease expired) and config,
    when and why it ended, its owner and lease, latest step and version, counts, latest
    reward mean, the evals run during training, the dropped rollouts' errors by kind. 409
    when the run's entry in the run-state bucket does not decode."""
    await check_run(who, store, bus, run_id)
    recorded = await store.get_run(run_id)
    state = await runs.get_run(bus, run_id)  # BadRunState: a 409 naming the key
    if state is None:
        if recorded is None:
            raise run_not_found(run_id)
        return RunDetail.model_validate({**recorded, "status": None, "config": None})
    if recorded is None:  # created in the bucket, nothing of it recorded yet
        recorded = {"id": run_id, "created_at": state.created_at, "num_tasks": 0, "num_rollouts": 0,
                    "num_scored_rollouts": 0, "latest_step": None, "latest_version": None, "reward_mean": None}
    end = runs.end_of(state)
    status = _status(state)
    live: dict[str, Any] = {
        "status": status["status"], "reason": status["reason"], "config": state.config,
        "ended_at": end.since if end is not None else None, "owner": state.owner,
        "lease_expires_at": state.lease_expires_at, "evals": _evals(state),
        "errors": [msgspec.structs.asdict(group) for group in state.errors],
    }
    # The bucket owns the tenant: the store's copy may predate it (an event recorded first).
    return RunDetail.model_validate({**recorded, "tenant": state.tenant, "kind": state.kind, **live})
