"""Web pages of the gateway: the runs, a run's live reward curve, a rollout's trace.

Server-rendered HTML (Jinja2 templates in ``templates/``) and one hand-written script,
``static/web.js``, with its stylesheet: no npm, nothing to build, and nothing fetched from
outside, so the pages work offline and ship inside the package. The script draws what
changes (the reward curve, the token layer) from the JSON API, with the page's own
credentials.

- ``/runs``: the runs a caller sees, as ``GET /v1/runs`` lists them, newest first, ``NUM_RUNS``
  a page (``?before=``: the older ones, the cursor the page links to), each with its status,
  environment(s), latest step and reward.
- ``/runs/{run}``: the run, its figures, its latest rollouts; the script draws the reward per
  environment (and ``eval.<label>.reward_mean`` points where the metrics have them) and
  follows ``GET /v1/runs/{run}/stream`` (server-sent events: new steps, the status, the end);
  where the stream fails (a proxy that buffers it) it polls ``GET /v1/runs/{run}/metrics``
  every ``POLL_S`` seconds instead.
- ``/rollouts/{rollout}``: each branch of the trace graph with its messages, tool calls and
  results, the rewards by scorer; on demand the token layer of each branch
  (``GET /v1/traces/{rollout}/branches/{leaf}?tokens=true``): every token id with its text
  (as inference decoded it; model output, so set as text, its control characters escaped),
  shaded by its logprob, its loss mask and policy version. A rollout still running follows its live trace
  stream (``/v1/traces/{rollout}/stream``): a node that extends a branch is drawn into it in
  place; one that starts a branch, or the rollout landing, reloads the page.

Who may see what is the API's: every page has the ``caller`` dependency
(:mod:`flywheel_gateway.auth`), so with ``auth = "keys"`` the browser sends the key as
``Authorization: Bearer`` like any client, and the script's calls carry it the same way; a page
of another tenant's run, rollout or private environment is the 404 of one that does not exist.
The pages stay out of the OpenAPI schema (they are not API). Every error a page meets (no key,
another tenant's, a malformed id, not found) is a page that says what is wrong, with the API's
status code, never a 500.

- ``/environments``: the hub's environments the caller sees; ``/environments/{owner}/{name}``:
  one with its README, versions (sha256, files), lineage and forks, and its leaderboard. A
  README is anyone's Markdown: rendered with its raw HTML shown as text, and links and images
  kept only with http(s) or relative URLs, so none can run script in the page; an image from
  elsewhere is a link to it, so that opening the page fetches nothing from a stranger's server.
- ``/usage``: the caller's tenant's tokens (prompt, sampled, trained) and cost over time, a bar
  chart each by time bucket (``GET /v1/usage/over-time``, embedded in the page and drawn by the
  script), and by run and source, with its cost by the price table; ``since``, ``until`` and
  ``bucket`` in the query string (a form) choose the range (the last 7 days by default).

A person signs in at ``/login`` with an API key: it is checked, then kept in an HttpOnly,
SameSite=Strict cookie (Secure over HTTPS) that the gateway takes for reading (GET) and for the
run list's stop, pause and resume buttons, whose requests must come from a page of the gateway
(their ``Origin`` is its own), so the pages and their script's calls carry it and nothing
another site makes a browser send can change anything; ``/logout`` forgets it. Clients send
the key as a bearer header as before.

Not covered: filters of the rollouts listing.
"""

from __future__ import annotations

import functools
import urllib.parse
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import nats.js.errors
from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from markdown_it import MarkdownIt
from markdown_it.common.utils import escapeHtml
from markdown_it.renderer import RendererHTML
from markdown_it.token import Token
from markdown_it.utils import EnvType, OptionsDict
from markupsafe import Markup
from pydantic import BaseModel, ValidationError

from flywheel.contract import events, runs
from flywheel.contract.bus import Bus
from flywheel.contract.keys import KeyCheck, KeyRefused, ScopeRefused
from flywheel.contract.service import HEARTBEAT_INTERVAL_S, read_heartbeats
from flywheel_gateway import api_hub, api_rollouts, api_runs, api_traces, api_usage
from flywheel_gateway.api_hub import NamePath, OwnerPath
from flywheel_gateway.auth import KEY_COOKIE, CallerDep, listing_tenant
from flywheel_gateway.deps import BusDep, CursorQuery, RolloutIdPath, RunIdPath, StoreDep
from flywheel_gateway.models import NodePublic, RolloutFilters, UsageOverTimeQuery, UsageQuery
from flywheel_gateway.responses import field_message, field_path, refuse_field
from flywheel_gateway.runs import RunConflict
from flywheel_gateway.store import InvalidCursor

HERE = Path(__file__).parent
POLL_S = 2.0  # how often the run page asks for new steps where its stream fails
NUM_RUNS = 100  # runs on the list page
NUM_ROLLOUTS = 50  # latest rollouts on a run page
Query = TypeVar("Query", bound=BaseModel)


@functools.cache
def _templates() -> Jinja2Templates:
    templates = Jinja2Templates(directory=HERE / "templates")
    templates.env.filters["markdown"] = markdown_html
    return templates


SAFE_SCHEMES = ("", "http", "https")  # "": relative, or a fragment


class _StrangersMarkdown(MarkdownIt):
    """CommonMark (and tables) for text anyone may push: raw HTML stays text, and a link or
    image is one only when its URL is http(s) or relative; any other (``javascript:``,
    ``data:``, ...) stays text too."""

    def __init__(self) -> None:
        super().__init__("commonmark", {"html": False})
        self.enable("table")
        self.add_render_rule("image", _local_image)

    def validateLink(self, url: str) -> bool:  # markdown-it's name, overridden
        """``url`` as markdown-it hands it: entities decoded, then percent-encoded, so no control
        character or space can hide a scheme from this check (nor from the browser's)."""
        return urllib.parse.urlsplit(url.strip()).scheme.lower() in SAFE_SCHEMES


def _local_image(self: RendererHTML, tokens: Sequence[Token], idx: int, options: OptionsDict,
                 env: EnvType) -> str:
    """An image whose URL is this gateway's (relative) as an image; one elsewhere as a link to
    it: each viewer's browser would fetch a remote image as the page opened, telling its owner
    who read the README and when (a tracking pixel)."""
    token = tokens[idx]
    src = str(token.attrGet("src") or "")
    if not urllib.parse.urlsplit(src).netloc:
        return self.image(tokens, idx, options, env)
    alt = self.renderInlineAsText(token.children or [], options, env)
    return f'<a href="{escapeHtml(src)}" rel="nofollow noopener">{escapeHtml(alt or src)} (image)</a>'


@functools.cache
def _markdown() -> _StrangersMarkdown:
    return _StrangersMarkdown()


def markdown_html(text: str) -> Markup:
    """A hub README (Markdown, a stranger's) as HTML that runs nothing: see :class:`_StrangersMarkdown`."""
    return Markup(_markdown().render(text))  # markdown-it escapes every text and attribute


def static_files() -> StaticFiles:
    """The script and stylesheet, mounted by the app at ``/static``."""
    return StaticFiles(directory=HERE / "static")


def message_page(request: Request, status: int, message: str, headers: Mapping[str, str] | None = None) -> Response:
    return _templates().TemplateResponse(request, "message.html", {"status": status, "message": message},
                                         status_code=status, headers=headers)


class PageRoute(APIRoute):
    """A route whose errors (its dependencies' too: the key, the path) are pages, not JSON."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def page(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                detail = "; ".join(f"{field_path(e['loc'])}: {field_message(e)}" for e in exc.errors())
                return message_page(request, 422, detail)
            except HTTPException as exc:
                return message_page(request, exc.status_code, str(exc.detail), headers=exc.headers)
            except (RunConflict, runs.BadRunState) as exc:
                return message_page(request, 409, str(exc))

        return page


router = APIRouter(route_class=PageRoute, include_in_schema=False, default_response_class=HTMLResponse)
# The login: the one page without the caller dependency (it takes the key).
login_router = APIRouter(route_class=PageRoute, include_in_schema=False, default_response_class=HTMLResponse)
LOGIN_S = 8 * 3600  # how long a login lasts


def env_ids(config: Mapping[str, Any] | None, env: str | None) -> list[str]:
    """A run's environment ids: its config's ``[[envs]]``, else its one environment."""
    envs = (config or {}).get("envs") or []
    if envs:
        return [str(e.get("id")) for e in envs if isinstance(e, dict)]
    return [env] if env else []


@router.get("/")
async def home() -> Response:
    return RedirectResponse("/runs")


@router.get("/runs")
async def runs_page(request: Request, store: StoreDep, bus: BusDep, who: CallerDep,
                    before: CursorQuery = None) -> Response:
    """The newest ``NUM_RUNS`` runs, or those older than ``before`` (the cursor the page links
    to), each with its live status (the run-state bucket) and latest step (one query for all
    of them: the page does not count each run's rollouts)."""
    try:
        page = await store.list_runs(tenant=listing_tenant(who, None), cursor=before or None, limit=NUM_RUNS)
    except InvalidCursor as exc:
        raise refuse_field("query", "before", f"{exc}; follow the page's link to older runs") from None
    latest = await store.latest_steps([listed["id"] for listed in page.items])
    rows = []
    for listed in page.items:
        step = latest.get(listed["id"], {})
        row = {"id": listed["id"], "envs": env_ids(None, listed["env"]), "step": step.get("step"),
               "reward": step.get("reward_mean"), "status": "unknown", "why": None}
        try:
            state = await runs.get_run(bus, listed["id"])
        except runs.BadRunState as exc:  # one unreadable run does not hide the others
            row.update(status="unreadable", why=str(exc))
        else:
            if state is not None:
                end = runs.end_of(state)
                row.update(envs=env_ids(state.config, listed["env"]) or row["envs"],
                           status=end.status if end is not None else state.status,
                           why=end.reason if end is not None else state.reason if state.status == "paused" else None)
        row["actions"] = ACTIONS.get(str(row["status"]), ())
        rows.append(row)
    return _templates().TemplateResponse(request, "runs.html", {"runs": rows, "older": page.next_cursor,
                                                                "paged": bool(before)})


# The run list's buttons by a run's status: what POST /v1/runs/RUN/<action> does to it.
ACTIONS = {"created": ("pause", "stop"), "running": ("pause", "stop"), "paused": ("resume", "stop"),
           "stopped": ("resume",), "failed": ("resume",), "abandoned": ("resume",)}


FILTERS = ("env", "status", "error", "flagged", "min_reward", "max_reward", "min_policy_version", "max_policy_version")


def page_query(request: Request, model: type[Query], names: tuple[str, ...], **fixed: Any) -> Query:
    """A page's query parameters ``names`` as ``model`` takes them (as its form sends them: an
    empty field is none; parameters the page does not read are left alone), with ``fixed``;
    a bad value is a 422 page naming it."""
    given = {name: request.query_params[name] for name in names if request.query_params.get(name, "") != ""}
    try:
        return model.model_validate({**given, **fixed})
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("query", *e["loc"])} for e in exc.errors()]) from None


@router.get("/runs/{run_id:path}")
async def run_page(request: Request, run_id: RunIdPath, store: StoreDep, bus: BusDep, who: CallerDep) -> Response:
    run = await api_runs.get_run(run_id, store, bus, who)
    filters = page_query(request, RolloutFilters, FILTERS, run=run_id)
    rollouts = await store.list_rollouts(api_rollouts.to_filter(filters, who), limit=NUM_ROLLOUTS)
    chosen = filters.model_dump(include=set(FILTERS), exclude_none=True)
    envs = env_ids(run.config, run.env)
    services, consumers, workers = await health_of(bus, run.id, envs, run.tenant)
    return _templates().TemplateResponse(request, "run.html", {
        "run": run, "envs": envs, "rollouts": rollouts.items,
        "more": rollouts.next_cursor is not None, "poll_ms": int(POLL_S * 1000), "filters": chosen,
        "services": services, "consumers": consumers, "workers": workers})


async def health_of(bus: Bus, run: str, envs: list[str], tenant: str
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """The services beating now (each instance's heartbeat age; stale after two missed), the
    consumers of the streams ``run``'s events pass through (its own and those of every run, not
    other runs'), with their lag and whether a process reads them, and the environment workers
    the live services hold for ``tenant``'s ``envs`` (any version): what a run waits on."""
    now = events.utc_now()
    try:
        beats = await read_heartbeats(bus)
    except nats.js.errors.BucketNotFoundError:
        beats = []
    beats.sort(key=lambda b: (b.service, b.instance))
    services = [{"service": b.service, "instance": b.instance, "age_s": (now - b.updated_at).total_seconds(),
                 "stale": (now - b.updated_at).total_seconds() > 2 * HEARTBEAT_INTERVAL_S} for b in beats]
    names = {env.partition("@")[0] for env in envs}
    workers = [{"instance": b.instance, **w} for b, seen in zip(beats, services, strict=True) if not seen["stale"]
               for w in b.info.get("workers") or [] if isinstance(w, dict)
               and str(w.get("environment", "")).partition("@")[0] in names and w.get("tenant") in (tenant, "")]
    consumers = []
    for stream in runs.RUN_STREAMS:
        try:
            infos = await bus.js.consumers_info(stream)
        except nats.js.errors.NotFoundError:
            continue
        rows = (runs.consumer_row(stream, c) for c in sorted(infos, key=lambda c: c.name))
        consumers += [row for row in rows if row["run"] in (run, None)]
    return services, consumers, workers


@router.get("/rollouts/{rollout_id}")
async def trace_page(request: Request, rollout_id: RolloutIdPath, store: StoreDep, bus: BusDep,
                     who: CallerDep) -> Response:
    trace = await api_traces.get_trace(rollout_id, store, bus, who)
    rollout = await store.get_rollout(rollout_id)
    by_id = {n.id: n for n in trace.nodes}
    final = trace.final_leaf
    branches = []
    seen: set[str] = set()
    for number, leaf in enumerate(sorted(trace.leaves, key=lambda leaf: leaf != final), start=1):
        path: list[NodePublic] = []
        at: str | None = leaf
        while at is not None and at in by_id:
            path.append(by_id[at])
            at = by_id[at].parent_id
        path.reverse()
        shared = sum(1 for n in path if n.id in seen)  # leading nodes an earlier branch already showed
        seen.update(n.id for n in path)
        branches.append({"number": number, "leaf": leaf, "final": leaf == final, "nodes": path, "shared": shared,
                         "complete": at is None})
    return _templates().TemplateResponse(request, "trace.html", {
        "trace": trace, "rollout": rollout, "branches": branches})


@router.get("/environments")
async def environments_page(request: Request, store: StoreDep, who: CallerDep) -> Response:
    listed = await api_hub.list_environments(store, who)
    return _templates().TemplateResponse(request, "environments.html", {"environments": listed.items})


@router.get("/environments/{owner}/{name}")
async def environment_page(request: Request, owner: OwnerPath, name: NamePath, store: StoreDep,
                           who: CallerDep) -> Response:
    env = await api_hub.visible_env(owner, name, store, who)
    detail = api_hub.get_environment_detail(request, env, who)
    board = await api_hub.list_evals(env, store)
    return _templates().TemplateResponse(request, "environment.html", {"env": detail, "evals": board.items})


USAGE_FIELDS = ("since", "until", "bucket")


@router.get("/usage")
async def usage_page(request: Request, store: StoreDep, bus: BusDep, who: CallerDep) -> Response:
    """The tenant's usage over a range (``since``, ``until``, RFC 3339; default the last 7 days)
    by ``bucket`` (15m, 1h, 1d) for the charts, and by run and source for the table."""
    query = page_query(request, UsageOverTimeQuery, USAGE_FIELDS)
    since, until = query.resolved()
    over_time = await api_usage.usage_over_time(request, store, bus, who,
                                                query.model_copy(update={"since": since, "until": until}))
    report = await api_usage.usage(request, store, bus, who, UsageQuery(since=since, until=until))
    given = {name: request.query_params.get(name, "") for name in USAGE_FIELDS}
    return _templates().TemplateResponse(request, "usage.html", {
        "report": report, "over_time": over_time.model_dump(mode="json"), "given": given})


@login_router.get("/login")
async def login_page(request: Request) -> Response:
    return _templates().TemplateResponse(request, "login.html", {"open": request.app.state.keys is None,
                                                                 "message": None})


@login_router.post("/login")
async def login(request: Request) -> Response:
    """Check the key, then keep it in the login cookie and go to the runs."""
    check: KeyCheck | None = request.app.state.keys
    if check is None:
        return RedirectResponse("/runs", status_code=303)
    form = await request.form()
    key = str(form.get("key") or "").strip()
    try:
        await check.authorize(key, "GET", "/runs")
    except (KeyRefused, ScopeRefused) as exc:
        return _templates().TemplateResponse(request, "login.html", {"open": False, "message": str(exc)},
                                             status_code=401)
    response = RedirectResponse("/runs", status_code=303)
    response.set_cookie(KEY_COOKIE, key, httponly=True, samesite="strict", secure=request.url.scheme == "https",
                        path="/", max_age=LOGIN_S)
    return response


@login_router.get("/logout")
async def logout() -> Response:
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(KEY_COOKIE, path="/")
    return response
