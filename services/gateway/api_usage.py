"""``GET /v1/usage``: what each tenant's runs used, and what it costs by the price table.

Metering counts are made where the work happens and travel on the bus: a rollout's model
calls in the rollout itself (inference counts each call's whole prompt and its sampled
tokens), a training step's trained tokens and an API request's tokens as ``usage`` events
(:class:`flywheel.contract.events.Usage`). The recorder keeps them in the trace store; this
route sums them by tenant, run and source over a time range (``/v1/usage/over-time``: by time
bucket, for a chart), and turns tokens into cost by
the settings' ``[prices]`` (per million tokens, per sandbox hour). ``recount=true`` with a run counts the
run's tokens again from its stored traces (every model call of its rollouts, the sampled
tokens of the rollouts its steps trained), beside the metered figures: they are equal when
nothing was lost or counted twice on the way. With an API key, a tenant sees its own usage
alone. Sandbox seconds (a rollout's sandbox, and those its rewards start in the scorer) are
metered by the sandbox service (the run is a label of the sandbox); the trace store has
nothing to recount them from.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query, Request

from flywheel.contract.settings import PriceSettings
from flywheel_gateway.auth import CallerDep, check_run, listing_tenant
from flywheel_gateway.deps import BusDep, StoreDep
from flywheel_gateway.models import (
    PricesPublic,
    UsageBucketPublic,
    UsageOverTimeQuery,
    UsageOverTimeReport,
    UsageQuery,
    UsageRecountPublic,
    UsageReport,
    UsageRowPublic,
    UsageTotalsPublic,
    bucket_seconds,
)
from flywheel_gateway.responses import ERROR_RESPONSES

router = APIRouter(prefix="/v1/usage", tags=["usage"], responses=ERROR_RESPONSES)
_SUMMED = ("num_calls", "prompt_tokens", "sampled_tokens", "trained_tokens", "sft_tokens", "sandbox_s")


def cost(prices: PriceSettings, prompt_tokens: int, sampled_tokens: int, trained_tokens: int,
         sandbox_s: float) -> float:
    """Tokens and sandbox time in the price table's currency (per million tokens, per hour)."""
    return (prompt_tokens * prices.prompt_per_mtok + sampled_tokens * prices.sampled_per_mtok
            + trained_tokens * prices.trained_per_mtok) / 1e6 + sandbox_s / 3600 * prices.sandbox_per_hour


@router.get("", response_model=UsageReport)
async def usage(request: Request, store: StoreDep, bus: BusDep, who: CallerDep,
                query: Annotated[UsageQuery, Query()]) -> UsageReport:
    """Tokens used, summed by tenant, run and source, with their cost; ``since`` inclusive,
    ``until`` exclusive."""
    tenant = listing_tenant(who, query.tenant)
    if query.run is not None:
        await check_run(who, store, bus, query.run)
    prices: PriceSettings = request.app.state.prices
    rows = await store.usage(tenant=tenant, run=query.run, since=query.since, until=query.until)
    items = [UsageRowPublic(**row, cost=cost(prices, row["prompt_tokens"], row["sampled_tokens"],
                                             row["trained_tokens"] + row["sft_tokens"], row["sandbox_s"]))
             for row in rows]
    sums = {name: sum(getattr(item, name) for item in items) for name in _SUMMED}
    totals = UsageTotalsPublic(**sums, cost=sum(item.cost for item in items))
    recount = None
    if query.recount and query.run is not None:
        again = await store.recount_usage(query.run)
        metered = {name: sum(getattr(item, name) for item in items if item.source == "rollout")
                   for name in ("num_calls", "prompt_tokens", "sampled_tokens")}
        metered["trained_tokens"] = sum(item.trained_tokens for item in items if item.source == "trainer")
        recount = UsageRecountPublic(**again, matches=again == metered)
    return UsageReport(tenant=tenant, run=query.run, since=query.since, until=query.until,
                       prices=PricesPublic(**prices.model_dump()), items=items, totals=totals, recount=recount)


@router.get("/over-time", response_model=UsageOverTimeReport)
async def usage_over_time(request: Request, store: StoreDep, bus: BusDep, who: CallerDep,
                          query: Annotated[UsageOverTimeQuery, Query()]) -> UsageOverTimeReport:
    """Tokens used and their cost by time bucket: every bucket from ``since`` (default: 7 days
    before ``until``) to ``until`` (default: now), in time order, a bucket without counts as
    zeros; tenants, runs and sources together."""
    tenant = listing_tenant(who, query.tenant)
    if query.run is not None:
        await check_run(who, store, bus, query.run)
    prices: PriceSettings = request.app.state.prices
    since, until = query.resolved()
    seconds = bucket_seconds(query.bucket)
    rows = {row["start"]: row for row in await store.usage_over_time(seconds, tenant=tenant, run=query.run,
                                                                      since=since, until=until)}
    zero = dict.fromkeys(("num_counts", *_SUMMED), 0)
    items = []
    start = datetime.fromtimestamp(int(since.timestamp()) // seconds * seconds, UTC)
    while start < until:
        row = rows.get(start, zero)
        summed = {name: row[name] for name in ("num_counts", *_SUMMED)}
        items.append(UsageBucketPublic(**summed, start=start, end=start + timedelta(seconds=seconds),
                                       cost=cost(prices, row["prompt_tokens"], row["sampled_tokens"],
                                                 row["trained_tokens"] + row["sft_tokens"], row["sandbox_s"])))
        start += timedelta(seconds=seconds)
    return UsageOverTimeReport(tenant=tenant, run=query.run, since=since, until=until, bucket=query.bucket,
                               bucket_s=seconds, prices=PricesPublic(**prices.model_dump()), items=items)
