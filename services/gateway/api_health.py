"""``/healthz``: whether the gateway can reach its database and NATS (JetStream)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from flywheel_gateway.deps import BusDep, StoreDep
from flywheel_gateway.models import HealthPublic

router = APIRouter(tags=["health"])
CHECK_TIMEOUT_S = 2.0


async def _check(probe: Awaitable[object]) -> str:
    try:
        await asyncio.wait_for(probe, CHECK_TIMEOUT_S)
    except Exception as exc:
        return f"down: {type(exc).__name__}: {exc}".rstrip(": ")
    return "ok"


@router.get("/healthz", response_model=HealthPublic, responses={503: {"model": HealthPublic}})
async def healthz(store: StoreDep, bus: BusDep) -> JSONResponse:
    """200 when both answer; 503 with the reason when either does not."""
    checks = {
        "database": await _check(store.ping()),
        "nats": await _check(bus.js.account_info()) if bus.nc.is_connected else "down: not connected to NATS",
    }
    healthy = all(v == "ok" for v in checks.values())
    body = HealthPublic(status="ok" if healthy else "unavailable", checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if healthy else 503)
