"""Dependencies of the API's routes, as ``Annotated`` aliases.

The composition root (:func:`flywheel_gateway.app.create_app`) puts the store, the bus and
the run registry on ``app.state`` at start; routes ask for them by type alias and never
build clients themselves.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Query, Request
from pydantic import AfterValidator

from flywheel.contract.bus import Bus
from flywheel.contract.names import KEY_PATTERN, MAX_NAME_CHARS, RUN_ID_PATTERN
from flywheel_gateway.auth import CallerDep
from flywheel_gateway.models import (
    MAX_CURSOR_CHARS,
    MAX_ID_CHARS,
    TOKEN_PATTERN,
    run_id,
    subject_token,
    tenant_name,
)
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
# Each constraint is stated twice on purpose: in the schema (pattern, lengths, for generated
# clients) and by the validator, whose message says what is allowed.
_RUN_ID = {"max_length": MAX_NAME_CHARS, "json_schema_extra": {"pattern": RUN_ID_PATTERN}}
_TOKEN = {"max_length": MAX_NAME_CHARS, "json_schema_extra": {"pattern": TOKEN_PATTERN}}
_TENANT = {"max_length": MAX_NAME_CHARS, "json_schema_extra": {"pattern": KEY_PATTERN}}
_ID = {"min_length": 1, "max_length": MAX_ID_CHARS}



def _tenant(who: CallerDep) -> str:
    return who.tenant


# The caller's tenant: the API key's, or (open) the Flywheel-Tenant header's (flywheel_gateway.auth).
TenantDep = Annotated[str, Depends(_tenant)]
TenantQuery = Annotated[str | None, Query(description="Only this tenant's runs.", **_TENANT),
                        AfterValidator(lambda v: v if v is None else tenant_name(v))]
LimitQuery = Annotated[int, Query(ge=1, le=MAX_PAGE_LIMIT, description="Items per page.")]
CursorQuery = Annotated[str | None, Query(max_length=MAX_CURSOR_CHARS, description="next_cursor of the previous page.")]
RunQuery = Annotated[str | None, Query(description="Only this run's.", **_TOKEN),
                     AfterValidator(lambda v: v if v is None else subject_token(v))]
EnvQuery = Annotated[str | None, Query(description="Only this environment's: the name in the tasks' subjects "
                                                 "(reverse_text) or an installed package's id "
                                                 "(flywheel/reverse-text).", **_TOKEN),
                     AfterValidator(lambda v: v if v is None else subject_token(v))]
RunIdPath = Annotated[str, Path(description="Run id (letters, digits, - _).", **_RUN_ID), AfterValidator(run_id)]
TaskIdPath = Annotated[str, Path(description="A task id.", **_ID)]
RolloutIdPath = Annotated[str, Path(description="A rollout id.", **_ID)]
NodeIdPath = Annotated[str, Path(description="A node id of the rollout's graph.", **_ID)]
# The live stream subscribes to traces.<run>.<rollout>: the id must be a subject token.
StreamedRolloutIdPath = Annotated[str, Path(description="A rollout id (a NATS subject token).", **_TOKEN),
                                  AfterValidator(subject_token)]
