"""``flywheel eval ENV --model NAME``: any model, served for the eval by the local stack's inference.

``--model`` without ``--base-url`` names what the local inference service serves: a run
(``RUN``, ``RUN@STEP``: the run's weights), or a model no training run trained: a name that a
run config's ``model.name`` takes (``tiny``, ``tiny-long``, ``smollm2``:
:data:`flywheel.sdk.models.BUILDERS`) or a Hugging Face model folder. A run of that id wins, as
before. For a model, the eval registers a run of kind ``eval`` of its own in the runs bucket
(``model-NAME-TIME``; its config names the model as a training run's would, the folder made
absolute), under the eval's tenant (the tenant of the API key it calls inference with, where
inference wants keys), so inference's tenancy applies unchanged: only keys of that
tenant may sample from it. Inference hosts such a run as any run named on its API, from the
run's config, but serves the model's own weights as version 0 (no trainer publishes any for an
eval) and unloads it once the eval run has ended and nothing asked for it for a while
(:class:`flywheel_inference.worker.Worker`). The eval asks for one token first, saying on
the screen while inference loads the model (a first request builds ``tiny`` or converts
``smollm2`` once into the data folder), then runs with the run id as the model sent; the
summary names the model as given and the run it was served as (``served_as``). The eval holds
the run with a lease it renews (``LEASE_S``) and marks it finished when it ends, however it ends;
an eval that dies leaves the lease to lapse, and inference unloads the model then too.

All this once the environment loaded (an environment that does not load is said first).
No NATS at the settings' URL: for a model, the eval starts the embedded stack's nats-server,
inference and sandbox itself (as ``flywheel run`` starts the whole stack), and stops them at the
end; for a run there is nothing to serve it from, which it says.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import re
import secrets
import socket
import sys
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from flywheel.contract import events
from flywheel.contract.names import is_run_id
from flywheel.contract.natsusers import redacted
from flywheel.runtime.evaluation import EvalConfig, Serving, run_eval

if TYPE_CHECKING:
    from flywheel.contract.bus import Bus
    from flywheel.contract.settings import Settings

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # inference starting and loading the model, at most (smollm2's first conversion included)
FINISH_TIMEOUT_S = 5.0  # marking the model's run finished, and closing the bus, at most
SAY_EVERY_S = 5.0  # how often a wait says it still waits
# The eval holds its model's run with a lease this long, renewed every third of it: an eval that
# dies (kill -9) leaves a run whose lease lapses, and inference unloads its model.
LEASE_S = 60.0
EVAL_SERVICES = ("sandbox", "inference")  # what an eval of a model needs of the embedded stack


def model_name(given: str) -> str | None:
    """What a run config's ``model.name`` would say for ``--model given``: a model name it takes
    (``tiny``, ``smollm2``, ...) as it is, a Hugging Face folder (one with a ``config.json``) as
    an absolute path, as every service reads it; None for anything else (a run id)."""
    from flywheel.sdk.models import BUILDERS

    if given in BUILDERS:
        return given
    path = Path(given).expanduser()
    if (path / "config.json").is_file():
        return str(path.resolve())
    return None


def served_run_id(name: str) -> str:
    """A new run id to serve model ``name`` as: ``model-<its name or folder's name>-<UTC time>-<hex>``."""
    slug = re.sub(r"[^-_a-zA-Z0-9]+", "_", Path(name).name or name).strip("_")[:64] or "model"
    return f"model-{slug}-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(2)}"


async def register_model(bus: Bus, run: str, name: str, env: str, tenant: str) -> None:
    """Register ``run``, of kind eval and of ``tenant``, whose config has inference serve model ``name``."""
    from flywheel.contract.config import ModelConfig, RunConfig
    from flywheel.contract.runs import register_run

    config = RunConfig(run=run, env=env, tenant=tenant, model=ModelConfig(name=name))
    await register_run(bus, run, tenant, config=config.model_dump(), kind="eval")


async def wait_until_served(base_url: str, run: str, label: str, api_key: str | None, out: TextIO,
                            timeout_s: float = READY_TIMEOUT_S) -> float:
    """Wait for inference at ``base_url`` to answer, then ask it for one token of ``run`` (its
    first request makes inference load the model) until it answers, saying every few seconds
    what it waits for; returns the seconds it waited. ValueError with inference's answer when
    it refuses the model (400, 404), TimeoutError naming what it waited for after ``timeout_s``."""
    import httpx

    root = base_url.rstrip("/").removesuffix("/v1")
    body = {"model": run, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    started = time.monotonic()
    said_at = started
    print(f"inference loads model {label} for this eval (served as {run})...", file=out, flush=True)

    async def waited_for(what: str, call: Coroutine[Any, Any, httpx.Response]) -> httpx.Response:
        nonlocal said_at
        request = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait([request], timeout=1.0)
                now = time.monotonic()
                if done:
                    return request.result()
                if now - started > timeout_s:
                    raise TimeoutError(f"--model {label}: waited {timeout_s:.0f}s for {what}; see inference's log "
                                       "(DATA_DIR/logs/inference.log under flywheel up)")
                if now - said_at >= SAY_EVERY_S:
                    said_at = now
                    print(f"  waiting for {what}: {now - started:.0f}s", file=out, flush=True)
        finally:
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await request

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0)) as client:
        while True:
            try:
                await waited_for(f"inference at {root} to start", client.get(root + "/healthz"))
                response = await waited_for("inference to load the model",
                                            client.post(base_url.rstrip("/") + "/chat/completions", json=body,
                                                        headers=headers))
            except httpx.TransportError:  # not listening yet (the stack is starting), or restarted
                now = time.monotonic()
                if now - started > timeout_s:
                    raise TimeoutError(f"--model {label}: waited {timeout_s:.0f}s for inference at {root} to "
                                       "start; see its log (DATA_DIR/logs/inference.log under flywheel up)") from None
                if now - said_at >= SAY_EVERY_S:
                    said_at = now
                    print(f"  waiting for inference at {root} to start: {now - started:.0f}s", file=out, flush=True)
                await asyncio.sleep(1.0)
                continue
            if response.status_code == 200:
                waited_s = time.monotonic() - started
                print(f"model {label} is served ({waited_s:.0f}s)", file=out, flush=True)
                return waited_s
            if response.status_code in (502, 503, 504):  # a proxy in front, or no weights yet: wait
                await asyncio.sleep(1.0)
                continue
            raise ValueError(f"--model {label}: inference at {base_url} refused to serve it as {run} "
                             f"({response.status_code}: {_message(response)})")


def _message(response: Any) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return str(response.text)[:500]


@contextlib.asynccontextmanager
async def embedded_stack(settings: Settings, out: TextIO, results: Path) -> AsyncIterator[None]:
    """The embedded stack's nats-server and :data:`EVAL_SERVICES`, started on entry (the body runs
    once the bus answers; inference may still be starting), stopped on exit. The stack takes
    Ctrl-C (and SIGTERM): the stack asked to stop (so, or failing) stops the body at once, while
    NATS still runs (it stops last), with a StackError saying where the eval's complete groups
    are (``results``)."""
    from flywheel.ops.stack import SERVICES, Stack, StackError, start_until_bus

    stack = Stack(settings, out=out, services={name: SERVICES[name] for name in EVAL_SERVICES})
    stack_task = await start_until_bus(stack)
    body = asyncio.current_task()
    assert body is not None
    stopped = False

    def stop_the_body(waited: asyncio.Future[Any]) -> None:
        nonlocal stopped
        if not waited.cancelled():
            stopped = True
            body.cancel()

    watcher = asyncio.ensure_future(stack.stopping.wait())
    watcher.add_done_callback(stop_the_body)
    try:
        yield
    except asyncio.CancelledError:
        if not stopped:
            raise
        body.uncancel()
        stack.stopping.set()
        await stack_task  # raises StackError with the reason, when it failed
        raise StackError(f"the embedded stack stopped (Ctrl-C or SIGTERM) before the eval ended: its complete "
                         f"groups are in {results}; run it again with --resume to go on") from None
    finally:
        watcher.cancel()
        stack.stopping.set()
        await stack_task


async def run_local_eval(cfg: EvalConfig, settings: Settings, progress_out: TextIO = sys.stderr) -> dict[str, Any]:
    """``flywheel eval`` against the local stack's inference (``cfg.base_url``): of a run as
    ever, or of a model no training run trained, served for it (the module's rules), once the
    environment loaded."""
    return await run_eval(cfg, settings.resolved_nats_url, progress_out, serving=local_serving(settings, progress_out),
                          settings=settings)


def local_serving(settings: Settings, progress_out: TextIO = sys.stderr) -> Serving:
    """What serves an eval's model on the local stack (:func:`flywheel.runtime.evaluation.run_eval`'s ``serving``)."""
    return lambda given: _served(given, settings, progress_out)


@contextlib.asynccontextmanager
async def _served(cfg: EvalConfig, settings: Settings,
                  progress_out: TextIO) -> AsyncIterator[tuple[EvalConfig, str | None]]:
    from flywheel.ops.run import nats_answers

    name = model_name(cfg.model)
    run = cfg.model.partition("@")[0]
    url = settings.resolved_nats_url
    if not await nats_answers(url):
        if name is None:
            raise ValueError(f"--model {cfg.model}: no NATS at {redacted(url)}, so no local inference serves the "
                             "run: start the stack (flywheel up), or give --base-url for another endpoint")
        print(f"no NATS at {redacted(url)}: starting the embedded stack's nats-server, inference and sandbox for "
              "this eval (they stop with it)", file=progress_out, flush=True)
        async with embedded_stack(settings, progress_out, cfg.out), _model(cfg, settings, name,
                                                                            progress_out) as served:
            yield served, settings.resolved_nats_url  # with the login the stack made (a new data folder's)
        return
    if await _is_run(url, run):
        yield cfg, url
        return
    if name is None:
        from flywheel.sdk.models import BUILDERS

        raise ValueError(f"--model {cfg.model}: no run {run!r} in the runs bucket, no model of that name "
                         f"({', '.join(BUILDERS)}) and no Hugging Face folder there (a folder with a config.json): "
                         "give a run id (RUN or RUN@STEP; `flywheel runs list` lists them), a model name or "
                         "folder, or --base-url for another endpoint")
    async with _model(cfg, settings, name, progress_out) as served:
        yield served, url


async def _is_run(nats_url: str, run: str) -> bool:
    """Whether the runs bucket has a run ``run`` (a model's name that is also a run's id means the run)."""
    from flywheel.contract.bus import Bus
    from flywheel.contract.runs import get_run

    if not is_run_id(run):
        return False
    bus = await Bus.connect(nats_url, "flywheel-eval")
    try:
        return await get_run(bus, run) is not None
    finally:
        await bus.close()


async def eval_tenant(bus: Bus, cfg: EvalConfig) -> str:
    """The tenant a model is served for: the eval's (``cfg.tenant``), else that of the API key it
    calls inference with (a tenant's key, ``fw_<id>_<secret>``, that the keys bucket holds), so
    that key may sample from it; else ``default`` (inference runs open)."""
    from flywheel.contract import keys

    if cfg.tenant is not None:
        return cfg.tenant
    match = re.fullmatch(r"fw_([0-9a-f]{16})_[A-Za-z0-9_-]{20,}", cfg.api_key or "")
    record = await keys.get_key(bus, match.group(1)) if match else None
    if record is not None and cfg.api_key and hmac.compare_digest(keys.digest(cfg.api_key), record.sha256):
        return record.tenant
    return "default"


async def _renew(bus: Bus, run: str, owner: str) -> None:
    """Renew ``owner``'s lease on the model's run every third of it, until cancelled; a renewal
    that fails is tried again at the next (the lease lapsing unloads the model, which the next
    request loads again)."""
    from flywheel.contract.runs import renew_lease

    while True:
        await asyncio.sleep(LEASE_S / 3)  # a deliberate sleep - the lease's pace
        try:
            await asyncio.wait_for(renew_lease(bus, run, owner, LEASE_S), LEASE_S / 3)
        except Exception as exc:
            log.warning("run %s: its lease could not be renewed (%s: %s)", run, type(exc).__name__, exc)


@contextlib.asynccontextmanager
async def _model(cfg: EvalConfig, settings: Settings, name: str, progress_out: TextIO) -> AsyncIterator[EvalConfig]:
    """Model ``name`` served by inference as a run of kind eval of the eval's tenant while the
    eval runs (the config it runs with names the run), the run marked finished after."""
    from flywheel.contract.bus import Bus
    from flywheel.contract.runs import update_run

    run = served_run_id(name)
    bus = await Bus.connect(settings.resolved_nats_url, "flywheel-eval")
    try:
        await register_model(bus, run, name, cfg.env, await eval_tenant(bus, cfg))
        owner = f"flywheel-eval pid {os.getpid()} on {socket.gethostname()}"
        await update_run(bus, run, owner=owner, lease_expires_at=events.utc_now() + timedelta(seconds=LEASE_S))
        renewing = asyncio.ensure_future(_renew(bus, run, owner))
        try:
            await wait_until_served(cfg.base_url, run, cfg.model, cfg.api_key, progress_out)
            yield replace(cfg, served_as=run)
        finally:
            renewing.cancel()
            await asyncio.gather(renewing, return_exceptions=True)
            try:  # bounded: NATS may be gone (the embedded stack stopped), and the bus would retry
                await asyncio.wait_for(update_run(bus, run, status="finished", ended_at=events.utc_now(), owner=None,
                                                  lease_expires_at=None), FINISH_TIMEOUT_S)
            except Exception as exc:
                print(f"the run {run} that served {cfg.model} could not be marked finished ({type(exc).__name__}: "
                      f"{exc}): inference keeps its model loaded until it restarts", file=progress_out, flush=True)
    finally:
        try:
            await asyncio.wait_for(bus.close(), FINISH_TIMEOUT_S)
        except Exception:  # NATS is gone: nothing is left to flush
            await bus.nc.close()
