"""Who calls the gateway, and what of whose they may touch.

With ``auth = "keys"`` (settings) every route but ``/healthz`` (a probe's, which shows no
data) wants an API key (``Authorization: Bearer fw_...``, :mod:`flywheel.contract.keys`; or
as the password of HTTP Basic credentials, as pip sends an index's; or, for GET alone, in the
cookie the web pages' login sets, and for the run list's stop, pause and resume buttons, a
``POST`` whose ``Origin`` is the gateway's own: :func:`page_action`):
none, a malformed, unknown or revoked one is a 401; a key without the scope a request needs
(``read`` for GET, ``write`` for the rest, ``admin`` for ``/v1/keys``) is a 403, and so is a
``Flywheel-Tenant`` header, or a listing's ``tenant``, that names another tenant than the key's.
Listings show the key's tenant's alone.

Anything of another tenant (a run, its tasks, rollouts and traces, a key, a private
environment) is a 404 exactly like one that does not exist: the same status and the same
body, so a key learns nothing of which ids other tenants use. Each check fails closed: a run
whose owner cannot be read (its state in the run-state bucket does not decode; a rollout
whose run is not known) is nobody's, and refused to every key; only the deployment's
service token and an open gateway see it (and get the 409 that names the broken key).

With ``auth = "open"`` (the embedded stack on one machine: ``flywheel run``, ``flywheel up``)
there are no keys: every request may do everything, as the tenant its ``Flywheel-Tenant``
header names (``default`` without one). The gateway refuses to start open unless it listens
on a loopback address only (:func:`flywheel.contract.keys.check_open`), and says at start that it runs open.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import AfterValidator

from flywheel.contract import runs
from flywheel.contract.bus import Bus
from flywheel.contract.keys import SCOPES, Caller, KeyCheck, KeyRefused, ScopeRefused
from flywheel.contract.names import KEY_PATTERN, MAX_NAME_CHARS, is_token
from flywheel_gateway.models import tenant_name
from flywheel_gateway.store import Store

bearer = HTTPBearer(auto_error=False, scheme_name="APIKey",
                    description="A tenant's API key, fw_<id>_<secret> (`flywheel keys create`); not needed when the "
                                "gateway runs open (auth = \"open\", loopback only).")
_ALL = frozenset(SCOPES)
# The web pages' login (flywheel_gateway.web: /login) keeps the key in this cookie, HttpOnly and
# SameSite=Strict; it is taken for reading methods alone, so no other site can make a browser
# change anything with it, and a script on a page never reads it.
KEY_COOKIE = "flywheel_key"
# The run list's buttons (stop, pause, resume): the one change the login cookie makes, from a page
# of this gateway's own (the request's Origin is the gateway's; the cookie is SameSite=Strict too).
PAGE_ACTION = re.compile(r"^/v1/runs/.+/(stop|pause|resume)$")
READING_METHODS = ("GET", "HEAD")
INDEX_PATH = "/hub/"  # the hub's package index (flywheel_gateway.api_hub): HTTP Basic too, for pip
KEYS_PATH = "/v1/keys"  # the tenant's keys (flywheel_gateway.api_keys): the admin scope, whatever the method


def page_action(request: Request) -> bool:
    """A run list button's request: ``POST /v1/runs/RUN/stop|pause|resume`` from a page of this
    gateway (its ``Origin`` header names the gateway's own scheme and host; none: refused)."""
    origin = request.headers.get("origin")
    return (request.method == "POST" and PAGE_ACTION.match(request.url.path) is not None and origin is not None
            and origin == f"{request.url.scheme}://{request.headers.get('host', '')}")


async def caller(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)] = None,
    tenant: Annotated[str | None, Header(alias="Flywheel-Tenant", max_length=MAX_NAME_CHARS,
                                         json_schema_extra={"pattern": KEY_PATTERN},
                                         description="The tenant (open API); with a key, its own or left out."),
                      AfterValidator(lambda v: v if v is None else tenant_name(v))] = None,
) -> Caller:
    """The request's caller: the key's tenant and scopes (401/403 as the module says), or,
    open, the header's tenant with every scope."""
    check: KeyCheck | None = request.app.state.keys
    if check is None:
        return Caller(tenant or "default", _ALL)
    path = request.url.path
    token = credentials.credentials if credentials is not None else basic_password(request)
    if token is None and (request.method in READING_METHODS or page_action(request)):
        token = request.cookies.get(KEY_COOKIE)  # the web pages' login: reading, and the run list's buttons
    try:
        admin = path == KEYS_PATH or path.startswith(f"{KEYS_PATH}/")
        return await check.authorize(token, request.method, path, tenant, scope="admin" if admin else None)
    except KeyRefused as exc:
        # pip reads only a Basic challenge, and then sends the credentials it has for the index.
        challenge = 'Basic realm="flywheel hub"' if path.startswith(INDEX_PATH) else "Bearer"
        raise HTTPException(401, str(exc), headers={"WWW-Authenticate": challenge}) from None
    except ScopeRefused as exc:
        raise HTTPException(403, str(exc)) from None


def basic_password(request: Request) -> str | None:
    """The password of HTTP Basic credentials (``Authorization: Basic``), where package
    installers put the key (``https://key:<KEY>@host/hub/simple``); None without them."""
    scheme, _, encoded = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        _, colon, password = base64.b64decode(encoded.strip(), validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return ""  # a malformed key: refused as one
    return password if colon else ""


CallerDep = Annotated[Caller, Depends(caller)]


def run_not_found(run: str) -> HTTPException:
    """What a run route answers for a run it does not show: one that does not exist, and (to a
    key) one of another tenant or one whose owner cannot be read, alike."""
    return HTTPException(404, f"run {run!r} not found (a run shows here once it is created, or once the recorder "
                              "has stored one of its events)")


def rollout_not_found(rollout: str) -> HTTPException:
    return HTTPException(404, f"rollout {rollout!r} not found (a rollout shows here once the recorder has stored "
                              "it, or once inference publishes its first trace node)")


def check_tenant(who: Caller, tenant: str | None, not_found: HTTPException) -> None:
    """``not_found`` unless the caller may see what ``tenant`` owns (None: an owner that cannot
    be read, nobody's: refused to every key)."""
    if not who.sees(tenant):
        raise not_found


def listing_tenant(who: Caller, asked: str | None) -> str | None:
    """The tenant a listing keeps: the keyed caller's own (403 for another asked for, whether or
    not it exists); open: the one asked."""
    if who.key_id is None or who.service:
        return asked
    if asked is not None and asked != who.tenant:
        raise HTTPException(403, f"API key {who.key_id} is tenant {who.tenant!r}'s: it lists its own tenant's "
                                 f"alone, not {asked!r}'s; leave tenant out")
    return who.tenant


async def run_tenant(store: Store, bus: Bus, run_id: str) -> str | None:
    """Who owns the run, for a tenant check: the run-state bucket's tenant (it owns it), else,
    for a run the bucket does not hold, the store's copy; None for a run neither knows, and for
    one whose entry in the bucket does not decode (the store's copy may predate the entry, so it
    is not taken instead: the check fails closed)."""
    try:
        state = await runs.get_run(bus, run_id)
    except runs.BadRunState:
        return None
    if state is not None:
        return state.tenant
    return await store.run_tenant(run_id)


async def check_run(who: Caller, store: Store, bus: Bus, run_id: str,
                    not_found: HTTPException | None = None) -> None:
    """``not_found`` (default: :func:`run_not_found`) unless the keyed caller's tenant owns the
    run; a run of another tenant, one that does not exist and one whose owner cannot be read
    are refused alike."""
    if who.key_id is not None and not who.service:
        check_tenant(who, await run_tenant(store, bus, run_id), not_found or run_not_found(run_id))


async def check_new_or_own_run(who: Caller, store: Store, bus: Bus, run_id: str) -> None:
    """For a request that creates the run when it is new (``POST /v1/tasks``): nothing when the
    run is new or the keyed caller's tenant's; a 409 when the id is taken by another tenant's run
    or by a run whose owner cannot be read. Run ids are one namespace, so that an id is taken
    shows, as a taken user name shows at a sign-up; the answer names no owner and nothing of the
    run."""
    if who.key_id is None or who.service:
        return
    try:
        state = await runs.get_run(bus, run_id)
    except runs.BadRunState:
        owner: str | None = None
    else:
        owner = state.tenant if state is not None else await store.run_tenant(run_id)
        if owner is None:
            return  # a new run: the registry creates it, the caller's
    if owner != who.tenant:
        raise HTTPException(409, f"run {run_id!r} is taken: the id is another tenant's run; name another run")


async def check_rollout(who: Caller, store: Store, bus: Bus, rollout_id: str) -> None:
    """:func:`rollout_not_found` unless the rollout (recorded, or live on the bus) is of a run of
    the keyed caller's tenant."""
    if who.key_id is None or who.service:
        return
    run = await store.rollout_run(rollout_id)
    if run is None and is_token(rollout_id):  # not recorded yet: its live trace nodes name the run
        info = await bus.js.stream_info("TRACES", subjects_filter=f"traces.*.{rollout_id}")
        subjects = list(info.state.subjects or {})
        run = subjects[0].split(".")[1] if subjects else None
    check_tenant(who, None if run is None else await run_tenant(store, bus, run), rollout_not_found(rollout_id))
