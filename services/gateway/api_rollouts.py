"""``/v1/rollouts``: recorded rollouts, filtered and paged, each with its scores."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, HTTPException

from flywheel_gateway.deps import CursorQuery, LimitQuery, StoreDep
from flywheel_gateway.models import RolloutDetail, RolloutPage
from flywheel_gateway.responses import ERROR_RESPONSES, refuse_inverted_range
from flywheel_gateway.store import RolloutFilter

router = APIRouter(prefix="/v1/rollouts", tags=["rollouts"], responses=ERROR_RESPONSES)


@router.get("", response_model=RolloutPage)
async def list_rollouts(
    store: StoreDep,
    limit: LimitQuery = 50,
    cursor: CursorQuery = None,
    run: str | None = None,
    env: str | None = None,
    status: Literal["completed", "truncated", "error"] | None = None,
    policy_version: int | None = None,
    min_policy_version: int | None = None,
    max_policy_version: int | None = None,
    min_reward: float | None = None,
    max_reward: float | None = None,
) -> RolloutPage:
    """Recorded rollouts, newest first. Reward bounds are inclusive and leave out unscored rollouts."""
    refuse_inverted_range("min_reward", min_reward, "max_reward", max_reward)
    refuse_inverted_range("min_policy_version", min_policy_version, "max_policy_version", max_policy_version)
    filters = RolloutFilter(run=run, env=env, status=status, policy_version=policy_version,
                            min_policy_version=min_policy_version, max_policy_version=max_policy_version,
                            min_reward=min_reward, max_reward=max_reward)
    page = await store.list_rollouts(filters, cursor=cursor, limit=limit)
    return RolloutPage.model_validate(page, from_attributes=True)


@router.get("/{rollout_id}", response_model=RolloutDetail)
async def get_rollout(rollout_id: str, store: StoreDep) -> RolloutDetail:
    """One rollout with its scores (its trace graph is at /v1/traces/{rollout_id})."""
    rollout = await store.get_rollout(rollout_id)
    if rollout is None:
        raise HTTPException(404, f"rollout {rollout_id!r} not found (a rollout shows here once the recorder has "
                                 "stored it)")
    return RolloutDetail.model_validate(rollout)
