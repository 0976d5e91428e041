"""The environment hub over HTTP: ``/v1/hub`` (push, list, read, visibility, evals) and a
standard package index at ``/hub/simple`` (PEP 503 HTML and PEP 691 JSON) with its files at
``/hub/files``.

An environment is ``owner/name``; its owner is a tenant. Pushing a version
(``POST /v1/hub/environments/{owner}/{name}/versions``, multipart: ``version``, the wheel and
the sdist as ``files``) wants the ``write`` scope and a key of the owner (an open gateway:
any owner); :func:`flywheel_gateway.hub.inspect_package` checks the files and the store keeps
them in one transaction, so a refused push (422), a version that exists (409) or an owner
other than the key's tenant (403, whether or not the environment exists) stores nothing.
Private environments are seen, downloaded and evaluated by their owner's keys alone: to
another tenant's key each of its routes, the package index's pages and its files answer the
404 of one that does not exist, the same body, and listings leave them out; public ones are
seen by every key. ``PATCH`` switches one (its owner's keys: another owner's is a 403, whether
or not it exists).
Evals (``flywheel eval --push``) attach an eval's summary to a version; ``GET .../evals`` is
the environment's leaderboard.

The index serves what pip asks for: ``pip install --only-binary :all: --index-url
<gateway>/hub/simple owner-name`` (with a key in the URL, ``https://key:<KEY>@host/hub/simple``,
for a gateway that wants keys: the index takes HTTP Basic credentials, the key as the password,
and answers a missing one with a Basic challenge). It lists each version's wheel alone, never
its sdist, so pip cannot fall back to building one; links carry each file's sha256, so pip
checks what it downloads.
"""

from __future__ import annotations

import asyncio
import html
from typing import Annotated, Any

from fastapi import APIRouter, Depends, File, Form, HTTPException, Path, Query, Request, UploadFile
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from packaging.utils import canonicalize_name

from flywheel.contract.hub import ENV_PART, SEMVER, HubRefused
from flywheel.contract.keys import Caller
from flywheel_gateway.auth import CallerDep
from flywheel_gateway.deps import StoreDep
from flywheel_gateway.hub import inspect_package
from flywheel_gateway.models import (
    HubEnvironmentDetail,
    HubEnvironmentPage,
    HubEnvironmentPublic,
    HubEvalCreate,
    HubEvalPage,
    HubEvalPublic,
    HubFilePublic,
    HubVersionDetail,
    HubVersionPublic,
    HubVisibility,
)
from flywheel_gateway.responses import CONFLICT_RESPONSE, ERROR_RESPONSES, TOO_LARGE_RESPONSE, refuse_field
from flywheel_gateway.store import HubConflict, Store

router = APIRouter(prefix="/v1/hub", tags=["hub"], responses=ERROR_RESPONSES)
index = APIRouter(prefix="/hub", tags=["hub index"], responses=ERROR_RESPONSES)

_PART = {"json_schema_extra": {"pattern": f"^{ENV_PART.pattern}$"}, "max_length": 64}
OwnerPath = Annotated[str, Path(description="The owner: a tenant.", **_PART)]
NamePath = Annotated[str, Path(description="The environment's name.", **_PART)]
VersionQuery = Annotated[str | None, Query(description="Only this version's.", max_length=64,
                                           pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$")]
FilenamePath = Annotated[str, Path(description="A package file's name.", max_length=300,
                                   pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")]
ProjectPath = Annotated[str, Path(description="A project (distribution) name.", max_length=200,
                                  pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
PEP691_JSON = "application/vnd.pypi.simple.v1+json"
PEP691_HTML = "application/vnd.pypi.simple.v1+html"


def _env_id(owner: str, name: str) -> str:
    for what, part in (("owner", owner), ("name", name)):
        if not ENV_PART.fullmatch(part):
            raise refuse_field("path", what, f"{part!r}: lower-case letters, digits, '-' and '_', starting with a "
                                             "letter (at most 64 characters)")
    return f"{owner}/{name}"


def _viewer(who: Caller) -> str | None:
    """Whose private environments a caller sees besides the public ones (None: every one)."""
    return None if who.key_id is None or who.service else who.tenant


def _env_not_found(env_id: str) -> HTTPException:
    return HTTPException(404, f"no environment {env_id!r} on the hub; GET /v1/hub/environments lists them")


async def _visible(env_id: str, store: Store, who: Caller) -> dict[str, Any]:
    """The environment, when the caller may see it: 404 when there is none, and the same 404
    when it is another tenant's private one."""
    env = await store.hub_environment(env_id)
    if env is None or (env["private"] and not who.sees(env["owner"])):
        raise _env_not_found(env_id)
    return env


async def visible_env(owner: OwnerPath, name: NamePath, store: StoreDep, who: CallerDep) -> dict[str, Any]:
    return await _visible(_env_id(owner, name), store, who)


def owned_env_id(owner: OwnerPath, name: NamePath, who: CallerDep) -> str:
    """The id of an environment the caller may change: a keyed tenant its own alone. Another
    owner is a 403 by the name alone, the same whether or not that environment exists."""
    env_id = _env_id(owner, name)
    if not who.sees(owner):
        raise HTTPException(403, f"owner {owner!r} is not API key {who.key_id}'s tenant ({who.tenant!r}): a key "
                                 f"changes its own tenant's environments alone; push under your own owner "
                                 f"({who.tenant}/{name}), or fork it")
    return env_id


VisibleEnv = Annotated[dict[str, Any], Depends(visible_env)]
OwnedEnvId = Annotated[str, Depends(owned_env_id)]


def _files(request: Request, rows: list[dict[str, Any]]) -> list[HubFilePublic]:
    return [HubFilePublic(**{k: row[k] for k in ("filename", "kind", "sha256", "size_bytes")},
                          url=str(request.url_for("download", filename=row["filename"])) + f"#sha256={row['sha256']}")
            for row in rows]


def get_environment_detail(request: Request, env: dict[str, Any], who: Caller) -> HubEnvironmentDetail:
    versions = [HubVersionDetail(env_id=env["id"], **{k: v for k, v in row.items() if k != "files"},
                                 files=_files(request, row["files"])) for row in env["versions"]]
    newest = versions[0] if versions else None
    forks = [fork for fork in env["forks"] if not fork["private"] or who.sees(fork["owner"])]
    return HubEnvironmentDetail(**{k: env[k] for k in ("id", "owner", "project", "private", "forked_from",
                                                        "created_at")},
                                latest_version=newest.version if newest else None,
                                summary=newest.summary if newest else "", readme=newest.readme if newest else "",
                                versions=versions, forks=forks)


@router.get("/environments", response_model=HubEnvironmentPage)
async def list_environments(store: StoreDep, who: CallerDep) -> HubEnvironmentPage:
    """Every environment the caller may see (the public ones and its tenant's), by id."""
    return HubEnvironmentPage(items=[HubEnvironmentPublic(**row) for row in await store.hub_environments(
        _viewer(who))])


@router.get("/environments/{owner}/{name}", response_model=HubEnvironmentDetail)
async def get_environment(request: Request, env: VisibleEnv, who: CallerDep) -> HubEnvironmentDetail:
    """The environment with its versions (newest first), each with its files and README, its
    lineage (``forked_from``) and its forks."""
    return get_environment_detail(request, env, who)


@router.patch("/environments/{owner}/{name}", response_model=HubEnvironmentDetail)
async def set_visibility(request: Request, body: HubVisibility, env_id: OwnedEnvId, store: StoreDep,
                         who: CallerDep) -> HubEnvironmentDetail:
    """Make the environment private or public (its owner's keys)."""
    if not await store.hub_set_private(env_id, body.private):
        raise HTTPException(404, f"no environment {env_id!r} on the hub; push a version first")
    return get_environment_detail(request, await _visible(env_id, store, who), who)


@router.post("/environments/{owner}/{name}/versions", response_model=HubVersionPublic, status_code=201,
             responses={403: CONFLICT_RESPONSE, 409: CONFLICT_RESPONSE, 413: TOO_LARGE_RESPONSE})
async def push_version(
    request: Request,
    env_id: OwnedEnvId,
    store: StoreDep,
    who: CallerDep,
    version: Annotated[str, Form(max_length=64, description="MAJOR.MINOR.PATCH, the package's own version.")],
    files: Annotated[list[UploadFile], File(description="The wheel and (optional) the sdist `python -m build` "
                                                        "writes.")],
    private: Annotated[bool, Form(description="A new environment: private (its owner's keys alone) or public. "
                                              "Ignored for one that exists (PATCH switches it).")] = False,
    forked_from: Annotated[str | None, Form(max_length=200, description="owner/name@version this environment was "
                                                                         "forked from (its first push).")] = None,
) -> HubVersionPublic:
    """Push a version: checked (names, version, archives, what the wheel installs, sizes: the
    hub's rules, docs/tenants-and-hub.md, "The environment hub"), then stored with its content hash, immutable
    from then on. Refused, naming the file and the fix, with nothing stored: a package that
    does not check (422), a version or file that exists (409)."""
    if forked_from is not None:
        parent, at, parent_version = forked_from.partition("@")
        owner_of, _, name_of = parent.partition("/")
        if not at or not SEMVER.fullmatch(parent_version) or not ENV_PART.fullmatch(owner_of) \
                or not ENV_PART.fullmatch(name_of):
            raise refuse_field("body", "forked_from", f"{forked_from!r}: give owner/name@MAJOR.MINOR.PATCH")
        await _visible(parent, store, who)  # one cannot claim a lineage one cannot see
    contents: dict[str, bytes] = {}
    for upload in files:
        name = upload.filename or ""
        if name in contents:
            raise refuse_field("body", "files", f"{name!r} is given twice")
        contents[name] = await upload.read()
    try:
        # In a thread: inflating and hashing a package's members takes a while (up to the hub's
        # size limits), and the event loop serves every other request meanwhile.
        package = await asyncio.to_thread(inspect_package, env_id, version, contents,
                                          request.app.state.hub_max_file_bytes)
        stored = await store.hub_push(package, env_id.partition("/")[0], private, who.key_id, forked_from)
    except HubConflict as exc:
        raise HTTPException(409, str(exc)) from None
    except HubRefused as exc:
        raise refuse_field("body", "files", str(exc)) from None
    rows = [{"filename": f.filename, "kind": f.kind, "sha256": f.sha256, "size_bytes": len(f.data)}
            for f in package.files]
    return HubVersionPublic(**stored, summary=package.summary, pushed_by=who.key_id, files=_files(request, rows))


@router.get("/environments/{owner}/{name}/evals", response_model=HubEvalPage)
async def list_evals(env: VisibleEnv, store: StoreDep, version: VersionQuery = None) -> HubEvalPage:
    """The environment's leaderboard: every eval pushed to it (or to one version), best reward first."""
    return HubEvalPage(items=[HubEvalPublic(**row) for row in await store.hub_evals(env["id"], version)])


@router.post("/environments/{owner}/{name}/evals", response_model=HubEvalPublic, status_code=201)
async def push_eval(body: HubEvalCreate, env: VisibleEnv, store: StoreDep, who: CallerDep) -> HubEvalPublic:
    """Attach an eval's summary to a version of the environment (anyone who sees it may)."""
    figures = body.model_dump(exclude={"version"})
    try:
        row = await store.hub_add_eval(env["id"], body.version, figures, who.tenant, who.key_id)
    except LookupError as exc:
        known = ", ".join(v["version"] for v in env["versions"]) or "none"
        raise HTTPException(404, f"{exc} (its versions: {known}); evaluate a pushed version") from None
    return HubEvalPublic(**row)


# --- the package index ---------------------------------------------------------------------


def _wants_json(request: Request) -> bool:
    """PEP 691 content negotiation: JSON when the client ranks it at least as high as HTML."""
    ranks: dict[str, float] = {}
    for part in request.headers.get("accept", "").split(","):
        kind, *params = (p.strip() for p in part.split(";"))
        q = 1.0
        for param in params:
            if param.startswith("q="):
                try:
                    q = float(param[2:])
                except ValueError:
                    q = 0.0
        ranks[kind.lower()] = max(q, ranks.get(kind.lower(), 0.0))
    json_q = ranks.get(PEP691_JSON, 0.0)
    html_q = max(ranks.get(PEP691_HTML, 0.0), ranks.get("text/html", 0.0), ranks.get("*/*", 0.0))
    return json_q > 0 and json_q >= html_q


def _page(title: str, links: list[tuple[str, str]]) -> str:
    body = "\n".join(f'    <a href="{html.escape(href)}">{html.escape(text)}</a><br/>' for href, text in links)
    return (f"<!DOCTYPE html>\n<html>\n  <head>\n    <meta name=\"pypi:repository-version\" content=\"1.0\">\n"
            f"    <title>{html.escape(title)}</title>\n  </head>\n  <body>\n{body}\n  </body>\n</html>\n")


_INDEX_PAGE: dict[int | str, dict[str, Any]] = {200: {
    "content": {PEP691_HTML: {"schema": {"type": "string"}}, PEP691_JSON: {"schema": {"type": "object"}}},
    "description": "PEP 503 HTML, or PEP 691 JSON when the Accept header ranks it first."}}


@index.get("/simple/", response_class=Response, responses=_INDEX_PAGE)
async def simple_projects(request: Request, store: StoreDep, who: CallerDep) -> Response:
    """The projects the caller may install (PEP 503 HTML, or PEP 691 JSON when asked for)."""
    projects = sorted(env["project"] for env in await store.hub_environments(_viewer(who)))
    if _wants_json(request):
        return JSONResponse({"meta": {"api-version": "1.0"}, "projects": [{"name": p} for p in projects]},
                            media_type=PEP691_JSON)
    return HTMLResponse(_page("Flywheel hub", [(f"{p}/", p) for p in projects]), media_type=PEP691_HTML)


@index.get("/simple/{project}/", response_class=Response, responses={**_INDEX_PAGE, 301: {
    "description": "The project's normalized name (PEP 503)."}})
async def simple_project(request: Request, project: ProjectPath, store: StoreDep, who: CallerDep) -> Response:
    """One project's wheels, each linked with its sha256 (PEP 503 HTML, or PEP 691 JSON); sdists
    are not listed (they are kept for reading: the API and /hub/files serve them)."""
    normal = canonicalize_name(project)
    if normal != project:  # PEP 503: redirect to the normalized name
        return RedirectResponse(str(request.url_for("simple_project", project=normal)), status_code=301)
    env = await store.hub_project(project)
    if env is None or (env["private"] and not who.sees(env["owner"])):  # another tenant's private: as none
        raise HTTPException(404, f"no project {project!r} on the hub (an environment owner/name is project "
                                 "owner-name)")
    # Wheels alone: pip never sees an sdist here, so no install from this index builds one (and
    # runs its build backend) when it cannot take the wheel.
    links = [(str(request.url_for("download", filename=row["filename"])), row) for row in env["files"]
             if row["kind"] == "wheel"]
    if _wants_json(request):
        return JSONResponse({"meta": {"api-version": "1.0"}, "name": project, "files": [
            {"filename": row["filename"], "url": url, "hashes": {"sha256": row["sha256"]}, "size": row["size_bytes"]}
            for url, row in links]}, media_type=PEP691_JSON)
    return HTMLResponse(_page(f"Links for {project}", [(f"{url}#sha256={row['sha256']}", row["filename"])
                                                       for url, row in links]), media_type=PEP691_HTML)


@index.get("/files/{filename}", response_class=Response, name="download",
           responses={200: {"content": {"application/octet-stream": {}}, "description": "The file's bytes."}})
async def download(filename: FilenamePath, store: StoreDep, who: CallerDep) -> Response:
    """A package file, as pushed."""
    row = await store.hub_file(filename)
    if row is None or (row["private"] and not who.sees(row["owner"])):  # another tenant's private: as none
        raise HTTPException(404, f"no file {filename!r} on the hub")
    return Response(row["data"], media_type="application/octet-stream",
                    headers={"Content-Disposition": f'attachment; filename="{filename}"'})
