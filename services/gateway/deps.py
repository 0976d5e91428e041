"""Dependencies of the API's routes, as ``Annotated`` aliases.

The composition root (:func:`flywheel_gateway.app.create_app`) puts the store, the bus and
the run registry on ``app.state`` at start; routes ask for them by type alias and never
build clients themselves.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Query, Request
from pydantic import AfterValidator

from flywheel.bus import Bus
from flywheel_gateway.models import tenant_name
from flywheel_gateway.runs import RunRegistry
from flywheel_gateway.store import MAX_PAGE_LIMIT, Store


def _store(request: Request) -> Store:
    return request.app.state.store


def _bus(request: Request) -> Bus:
    return request.app.state.bus


def _runs(request: Request) -> RunRegistry:
    return request.app.state.runs


StoreDep = Annotated[Store, Depends(_store)]
BusDep = Annotated[Bus, Depends(_bus)]
RunsDep = Annotated[RunRegistry, Depends(_runs)]
TenantDep = Annotated[str, Header(alias="Flywheel-Tenant", description="Tenant that owns new runs."),
                      AfterValidator(tenant_name)]
LimitQuery = Annotated[int, Query(ge=1, le=MAX_PAGE_LIMIT, description="Items per page.")]
CursorQuery = Annotated[str | None, Query(description="next_cursor of the previous page.")]
