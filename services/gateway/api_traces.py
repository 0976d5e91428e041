"""``/v1/traces``: a rollout's trace graph, message layer and (on request) token layer."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from flywheel_gateway.deps import StoreDep
from flywheel_gateway.models import NodePublic, TracePublic
from flywheel_gateway.responses import ERROR_RESPONSES

router = APIRouter(prefix="/v1/traces", tags=["traces"], responses=ERROR_RESPONSES)


@router.get("/{rollout_id}", response_model=TracePublic)
async def get_trace(rollout_id: str, store: StoreDep, tokens: bool = False) -> TracePublic:
    """The nodes of the rollout's graph in order, each with its parent; live nodes show before
    the rollout finishes. ``?tokens=true`` adds each node's token ids, logprobs and loss mask."""
    nodes = await store.get_trace(rollout_id, tokens=tokens)
    if nodes is None:
        raise HTTPException(404, f"no trace recorded for rollout {rollout_id!r}")
    return TracePublic(rollout_id=rollout_id, nodes=[NodePublic.model_validate(n) for n in nodes])
