"""``/v1/rollouts``: recorded rollouts, filtered and paged, each with its scores; bulk export.

The listing and the export take the same filters (:class:`~flywheel_gateway.models.RolloutFilters`),
applied in the database. The export streams JSON Lines, one rollout a line, read from the
store a page at a time, so its memory does not grow with the number of rollouts. Its
filters are checked, and its first page read, before the first byte is sent, so a bad
filter is a 422 and a database that is down a 503. The last line is always one object without
``id`` (a rollout line always has one): ``{"end": {"num_rollouts": N}}`` once every rollout
is sent (an empty export is that line alone), or ``{"error": "..."}`` when an error after the
200 cut it. An export is complete only when its last line is the ``end`` line: a gateway that
dies mid-stream (SIGKILL, out of memory) or a connection cut on the way writes neither, so a
missing end line is as much a cut as an error line, and a reader must check for it rather
than for an error line alone (``flywheel.ops.client.TraceAPI.export`` and ``flywheel sft``
do).
Not covered: exporting other formats (Parquet, a chat template applied), resuming an
export part way.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from flywheel.contract.keys import Caller
from flywheel.sdk.environment import other_ids
from flywheel_gateway.auth import CallerDep, check_rollout, listing_tenant, rollout_not_found
from flywheel_gateway.deps import BusDep, RolloutIdPath, StoreDep
from flywheel_gateway.models import RolloutDetail, RolloutExportQuery, RolloutFilters, RolloutListQuery, RolloutPage
from flywheel_gateway.responses import ERROR_RESPONSES, refuse_inverted_range
from flywheel_gateway.store import RolloutFilter

router = APIRouter(prefix="/v1/rollouts", tags=["rollouts"], responses=ERROR_RESPONSES)

JSONL = "application/jsonl"
log = logging.getLogger(__name__)


def to_filter(query: RolloutFilters, who: Caller) -> RolloutFilter:
    """The store's filter for ``query`` (with an API key: its tenant's runs alone); a 422 naming
    the parameter for an inverted range. ``env`` takes the environment's other ids too
    (``flywheel/reverse-text`` and ``reverse_text``): a run config may name either."""
    refuse_inverted_range("min_reward", query.min_reward, "max_reward", query.max_reward)
    refuse_inverted_range("min_policy_version", query.min_policy_version, "max_policy_version",
                          query.max_policy_version)
    refuse_inverted_range("created_after", query.created_after, "created_before", query.created_before)
    aliases = tuple(other_ids(query.env)) if query.env is not None else ()
    return RolloutFilter(**query.model_dump(include=set(RolloutFilters.model_fields)), env_aliases=aliases or None,
                         tenant=listing_tenant(who, None))


@router.get("", response_model=RolloutPage)
async def list_rollouts(store: StoreDep, who: CallerDep, query: Annotated[RolloutListQuery, Query()]) -> RolloutPage:
    """Recorded rollouts, newest first (in recording order). A cursor continues only the
    listing it came from: pass the same filters with it. Rollouts recorded while you page
    never shift a page; they show at the head of a new listing."""
    page = await store.list_rollouts(to_filter(query, who), cursor=query.cursor, limit=query.limit)
    return RolloutPage.model_validate(page, from_attributes=True)


@router.get("/export", response_class=StreamingResponse,
            responses={200: {"content": {JSONL: {}}, "description": "One JSON object a line."}})
async def export_rollouts(store: StoreDep, who: CallerDep,
                          query: Annotated[RolloutExportQuery, Query()]) -> StreamingResponse:
    """Every rollout the filters keep, newest first, as JSON Lines: its fields, ``reward`` and
    ``scores``, ``task_data``, ``metrics``, ``state``, and ``messages``, the messages of its
    final branch (root to its last node, the branch rewards read: the whole conversation
    unless it branches; other branches are in /v1/traces). ``?tokens=true`` adds ``tokens``:
    that branch's token ids, logprobs and loss mask, concatenated. E.g. an SFT set:
    ``?run=R&min_reward=1&error=false``.

    Filters are checked and the first page is read before the answer starts: a bad filter is
    a 422, an unreachable database a 503. The last line has no ``id``: ``{"end":
    {"num_rollouts": N}}`` when every rollout was sent (the one line of an empty export), or
    ``{"error": "..."}`` naming what failed after the answer started (the database going away
    part way) and how many rollouts were sent. An export is complete only when its last line
    is the ``end`` line; an ``error`` line, or no end line at all (the gateway killed, the
    connection cut), means it was cut: export again."""
    filters = to_filter(query, who)
    records = aiter(store.export_rollouts(filters, tokens=query.tokens))
    first = await anext(records, None)  # a database that is down fails here: a 503, not a cut 200
    return StreamingResponse(_lines(first, records), media_type=JSONL)


async def _lines(first: dict[str, Any] | None, records: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """The export's lines: ``first`` and the rest of ``records``, then the end line, or the
    error line where reading them failed. The end line is written last and only here, so no
    way of dying part way (an exception, a kill) can leave one behind."""
    encoder = msgspec.json.Encoder()
    num_sent = 0
    if first is not None:
        yield encoder.encode(first) + b"\n"
        num_sent = 1
        try:
            async for record in records:
                yield encoder.encode(record) + b"\n"
                num_sent += 1
        except Exception as exc:
            log.exception("export cut after %d rollouts", num_sent)
            cause = getattr(exc, "orig", None) or exc
            error = (f"export cut after {num_sent} rollouts: {type(cause).__name__}: {cause}; the lines above are "
                     "complete rollouts, the rest is missing: export again")
            yield encoder.encode({"error": error}) + b"\n"
            return
    yield encoder.encode({"end": {"num_rollouts": num_sent}}) + b"\n"


@router.get("/{rollout_id}", response_model=RolloutDetail)
async def get_rollout(rollout_id: RolloutIdPath, store: StoreDep, bus: BusDep, who: CallerDep) -> RolloutDetail:
    """One rollout with its scores (its trace graph is at /v1/traces/{rollout_id}); another
    tenant's, to a key, is a 404 as one not recorded is."""
    await check_rollout(who, store, bus, rollout_id)
    rollout = await store.get_rollout(rollout_id)
    if rollout is None:
        raise rollout_not_found(rollout_id)
    return RolloutDetail.model_validate(rollout)
