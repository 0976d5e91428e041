"""``/v1/rollouts``: recorded rollouts, filtered and paged, each with its scores; bulk export.

The listing and the export take the same filters (:class:`~flywheel_gateway.models.RolloutFilters`),
applied in the database. The export streams JSON Lines, one rollout a line, read from the
store a page at a time, so its memory does not grow with the number of rollouts.
Not covered: exporting other formats (Parquet, a chat template applied), resuming an
export part way.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

import msgspec
from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import StreamingResponse

from flywheel_gateway.deps import StoreDep
from flywheel_gateway.models import RolloutDetail, RolloutExportQuery, RolloutFilters, RolloutListQuery, RolloutPage
from flywheel_gateway.responses import ERROR_RESPONSES, refuse_inverted_range
from flywheel_gateway.store import RolloutFilter

router = APIRouter(prefix="/v1/rollouts", tags=["rollouts"], responses=ERROR_RESPONSES)

JSONL = "application/jsonl"


def to_filter(query: RolloutFilters) -> RolloutFilter:
    """The store's filter for ``query``; a 422 naming the parameter for an inverted range."""
    refuse_inverted_range("min_reward", query.min_reward, "max_reward", query.max_reward)
    refuse_inverted_range("min_policy_version", query.min_policy_version, "max_policy_version",
                          query.max_policy_version)
    refuse_inverted_range("created_after", query.created_after, "created_before", query.created_before)
    return RolloutFilter(**query.model_dump(include=set(RolloutFilters.model_fields)))


@router.get("", response_model=RolloutPage)
async def list_rollouts(store: StoreDep, query: Annotated[RolloutListQuery, Query()]) -> RolloutPage:
    """Recorded rollouts, newest first (in recording order). A cursor continues only the
    listing it came from: pass the same filters with it. Rollouts recorded while you page
    never shift a page; they show at the head of a new listing."""
    page = await store.list_rollouts(to_filter(query), cursor=query.cursor, limit=query.limit)
    return RolloutPage.model_validate(page, from_attributes=True)


@router.get("/export", response_class=StreamingResponse,
            responses={200: {"content": {JSONL: {}}, "description": "One JSON object a line."}})
async def export_rollouts(store: StoreDep, query: Annotated[RolloutExportQuery, Query()]) -> StreamingResponse:
    """Every rollout the filters keep, newest first, as JSON Lines: its fields, ``reward`` and
    ``scores``, ``task_data``, ``metrics``, ``state``, and ``messages``, the messages of its
    final branch (root to its last node, the branch rewards read: the whole conversation
    unless it branches; other branches are in /v1/traces). ``?tokens=true`` adds ``tokens``:
    that branch's token ids, logprobs and loss mask, concatenated. E.g. an SFT set:
    ``?run=R&min_reward=1&error=false``."""
    filters = to_filter(query)
    encoder = msgspec.json.Encoder()

    async def lines() -> AsyncIterator[bytes]:
        async for record in store.export_rollouts(filters, tokens=query.tokens):
            yield encoder.encode(record) + b"\n"

    return StreamingResponse(lines(), media_type=JSONL)


@router.get("/{rollout_id}", response_model=RolloutDetail)
async def get_rollout(rollout_id: str, store: StoreDep) -> RolloutDetail:
    """One rollout with its scores (its trace graph is at /v1/traces/{rollout_id})."""
    rollout = await store.get_rollout(rollout_id)
    if rollout is None:
        raise HTTPException(404, f"rollout {rollout_id!r} not found (a rollout shows here once the recorder has "
                                 "stored it)")
    return RolloutDetail.model_validate(rollout)
