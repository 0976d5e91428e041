"""The HTTP APIs' figures: each request counted and timed under its route's template."""

from __future__ import annotations

import httpx
from fastapi import FastAPI
from prometheus_client import REGISTRY

from flywheel.contract.metrics import ObservedHTTP


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_requests_are_counted_by_route_template_method_and_status() -> None:
    app = FastAPI()

    @app.get("/v1/things/{thing_id}")
    async def thing(thing_id: int) -> dict[str, int]:
        return {"id": thing_id}

    app.add_middleware(ObservedHTTP)
    route = {"route": "/v1/things/{thing_id}", "method": "GET"}
    before = {status: sample("flywheel_http_requests_total", **route, status=status) for status in ("200", "422")}
    timed = sample("flywheel_http_request_seconds_count", **route)
    unmatched = sample("flywheel_http_requests_total", route="unmatched", method="GET", status="404")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        assert (await client.get("/v1/things/1")).status_code == 200
        assert (await client.get("/v1/things/2")).status_code == 200
        assert (await client.get("/v1/things/two")).status_code == 422  # a path, never a label of its own
        assert (await client.get("/elsewhere")).status_code == 404
    assert sample("flywheel_http_requests_total", **route, status="200") == before["200"] + 2
    assert sample("flywheel_http_requests_total", **route, status="422") == before["422"] + 1
    assert sample("flywheel_http_request_seconds_count", **route) == timed + 3
    assert sample("flywheel_http_requests_total", route="unmatched", method="GET", status="404") == unmatched + 1
