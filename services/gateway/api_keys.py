"""``/v1/keys``: a tenant's API keys over HTTP, for keys with the ``admin`` scope.

``POST /v1/keys`` makes a key of the caller's tenant (its scopes and name in the body) and
answers with the key itself, once: the keys bucket keeps its sha256 alone. ``GET /v1/keys``
lists the tenant's keys (ids, scopes, names, when made and revoked; never a secret) and
``DELETE /v1/keys/{id}`` revokes one (kept, marked revoked; services that check keys see it
within 5 s). Every route wants the ``admin`` scope, whatever its method; a key id of another
tenant is a 404, exactly as an id no tenant has; making a key of another tenant is a 403. The
deployment's service token, and an open gateway, name the tenant in the body or the query
(``tenant``); the first key of a deployment comes from ``flywheel keys create``, run where
NATS is reached.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path

from flywheel.contract import keys
from flywheel.contract.keys import Caller
from flywheel_gateway.auth import CallerDep, check_tenant, listing_tenant
from flywheel_gateway.deps import BusDep, TenantQuery
from flywheel_gateway.models import ApiKeyCreate, ApiKeyCreated, ApiKeyPage, ApiKeyPublic
from flywheel_gateway.responses import ERROR_RESPONSES

router = APIRouter(prefix="/v1/keys", tags=["keys"], responses=ERROR_RESPONSES)
KeyIdPath = Annotated[str, Path(description="A key's id (16 hex digits).", pattern=r"^[0-9a-f]{16}$")]


def _tenant_of(who: Caller, asked: str | None) -> str:
    """Whose key is made: the keyed caller's tenant (a 403 for another), else the one asked for."""
    if who.key_id is not None and not who.service:
        if asked is not None and asked != who.tenant:
            raise HTTPException(403, f"API key {who.key_id} is tenant {who.tenant!r}'s: it makes keys of "
                                     f"{who.tenant!r} alone, not of another tenant ({asked!r})")
        return who.tenant
    if asked is None and who.service:
        raise HTTPException(422, "tenant: the service token belongs to no tenant; name the key's tenant")
    return asked or who.tenant


@router.post("", response_model=ApiKeyCreated, status_code=201)
async def create_key(body: ApiKeyCreate, bus: BusDep, who: CallerDep) -> ApiKeyCreated:
    """A new key of the tenant; ``key`` is shown this once."""
    token, record = await keys.create_key(bus, _tenant_of(who, body.tenant), body.scopes, body.name)
    return ApiKeyCreated(key=token, **ApiKeyPublic.of(record).model_dump())


@router.get("", response_model=ApiKeyPage)
async def list_keys(bus: BusDep, who: CallerDep, tenant: TenantQuery = None) -> ApiKeyPage:
    """The tenant's keys (a key's: its own), oldest first, revoked ones too."""
    chosen = listing_tenant(who, tenant)
    return ApiKeyPage(items=[ApiKeyPublic.of(r) for r in await keys.list_keys(bus, chosen)])


@router.delete("/{key_id}", response_model=ApiKeyPublic)
async def revoke_key(key_id: KeyIdPath, bus: BusDep, who: CallerDep) -> ApiKeyPublic:
    """Revoke a key of the tenant (revoking one twice changes nothing)."""
    not_found = HTTPException(404, f"no API key with id {key_id!r}; GET /v1/keys lists the tenant's")
    record = await keys.get_key(bus, key_id)
    if record is None:
        raise not_found
    check_tenant(who, record.tenant, not_found)  # another tenant's key: as one that does not exist
    return ApiKeyPublic.of(await keys.revoke_key(bus, key_id))
