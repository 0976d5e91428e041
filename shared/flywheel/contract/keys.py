"""API keys: what a tenant shows the gateway's and inference's HTTP APIs.

A key reads ``fw_<id>_<secret>``: ``id`` (16 hex digits) names it and is no secret (it is
listed, and revoked by); ``secret`` is 32 random bytes, shown once when the key is made. The
keys KV bucket (``flywheel-keys``) holds one :class:`flywheel.contract.events.ApiKey` per id:
its tenant, scopes, name and the sha256 of the whole key, never the key itself, so whoever
reads the bucket cannot call the APIs with what they read.

Scopes: ``read`` (GET: runs, tasks, rollouts, traces, models), ``write`` (publish tasks,
stop, pause and resume runs, sample from inference) and ``admin`` (the tenant's keys). A
revoked key keeps its entry (``revoked_at``) and is refused from then on; a service that
checks keys (:class:`KeyCheck`) holds what it read for at most ``ttl_s`` (5 s), so a
revocation takes hold within that.

Who makes keys: an operator, with access to the bus (``flywheel keys create --tenant T``),
and a tenant's ``admin`` keys over the gateway (``/v1/keys``: make, list, revoke its own); the
first key of a deployment comes from the operator.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec
import nats.js.errors

from flywheel.contract import events
from flywheel.contract.bus import KEYS_BUCKET, Bus
from flywheel.contract.names import is_key

Scope = Literal["read", "write", "admin"]
SCOPES: tuple[Scope, ...] = ("read", "write", "admin")
_TOKEN = re.compile(r"fw_([0-9a-f]{16})_([A-Za-z0-9_-]{20,})")
_decoder = events.Decoder(events.ApiKey)
CACHE_S = 5.0  # how long a service may go on trusting what it read of a key
READ_METHODS = ("GET", "HEAD", "OPTIONS")  # need the read scope; every other method needs write


class KeyRefused(PermissionError):
    """The key is missing, malformed, unknown or revoked; the message says which (never the key)."""


class ScopeRefused(PermissionError):
    """The key is good, and lacks the scope the request needs (or names another tenant)."""


def is_loopback(host: str) -> bool:
    """Whether a listening address reaches this machine alone (an open API may listen only there)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_open(service: str, host: str) -> None:
    """ValueError unless an API that runs open (no keys) listens on a loopback address only."""
    if not is_loopback(host):
        raise ValueError(f"{service}: auth = \"open\" (no API keys) while listening on {host!r}, which is not a "
                         f"loopback address: anyone who reaches it could read, change and sample every tenant's "
                         f"runs. Set FLYWHEEL_AUTH=keys (and make keys with `flywheel keys create --tenant T`), or "
                         f"listen on 127.0.0.1")


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def check_scopes(scopes: Sequence[str]) -> list[Scope]:
    bad = [s for s in scopes if s not in SCOPES]
    if bad or not scopes:
        raise ValueError(f"scopes: {', '.join(map(repr, bad)) or 'none given'}; give one or more of "
                         f"{', '.join(SCOPES)}")
    return [s for s in SCOPES if s in scopes]


async def create_key(bus: Bus, tenant: str, scopes: Sequence[str], name: str = "") -> tuple[str, events.ApiKey]:
    """A new key of ``tenant``: the key itself (shown once, stored nowhere) and its record."""
    if not is_key(tenant):
        raise ValueError(f"tenant {tenant!r}: give 1 to 128 letters, digits, '-', '_', '=' or '/'")
    key_id = secrets.token_hex(8)
    token = f"fw_{key_id}_{secrets.token_urlsafe(32)}"
    record = events.ApiKey(id=key_id, tenant=tenant, scopes=check_scopes(scopes), sha256=digest(token), name=name)
    await (await bus.keys_kv()).create(key_id, events.encode(record))
    return token, record


async def get_key(bus: Bus, key_id: str) -> events.ApiKey | None:
    try:
        entry = await (await bus.keys_kv()).get(key_id)
    except nats.js.errors.KeyNotFoundError:
        return None
    return _decoder.decode(entry.value) if entry.value else None


async def list_keys(bus: Bus, tenant: str | None = None) -> list[events.ApiKey]:
    """Every key's record (``tenant``'s only, when given), oldest first."""
    found = []
    for key_id in await bus.kv_keys(KEYS_BUCKET):
        record = await get_key(bus, key_id)
        if record is not None and (tenant is None or record.tenant == tenant):
            found.append(record)
    return sorted(found, key=lambda r: r.created_at)


async def revoke_key(bus: Bus, key_id: str, tenant: str | None = None) -> events.ApiKey:
    """Mark the key revoked (kept, so it is listed as such); LookupError for an id the bucket
    does not hold (or, with ``tenant``, one of another tenant)."""
    record = await get_key(bus, key_id)
    if record is None or (tenant is not None and record.tenant != tenant):
        raise LookupError(f"no key with id {key_id!r}" + (f" of tenant {tenant!r}" if tenant else "")
                          + "; `flywheel keys list` shows the ids")
    if record.revoked_at is None:
        record = msgspec.structs.replace(record, revoked_at=events.utc_now())
        await (await bus.keys_kv()).put(key_id, events.encode(record))
    return record


@dataclass(frozen=True)
class Caller:
    """Who a request comes from: the tenant and what it may do."""

    tenant: str
    scopes: frozenset[str]
    key_id: str | None = None  # None: the API runs open (no keys)
    service: bool = False  # the deployment's own services (settings.service_token): every tenant's

    def allows(self, scope: str) -> bool:
        return scope in self.scopes

    def sees(self, tenant: str | None) -> bool:
        """Whether this caller may touch what ``tenant`` owns. None is an owner that could not be
        read (or a thing nobody owns): nobody's, so no tenant's key may touch it (a check that
        cannot tell the owner refuses); open and the service token see everything."""
        return self.key_id is None or self.service or (tenant is not None and tenant == self.tenant)


class KeyCheck:
    """Turns a request's key into its :class:`Caller`, reading the keys bucket at most every
    ``ttl_s`` per key. ``service_token`` (the settings' ``service_token``, when set) is the
    deployment's own services' credential: it sees every tenant's runs."""

    def __init__(self, bus: Bus, ttl_s: float = CACHE_S, service_token: str | None = None) -> None:
        self.bus = bus
        self.ttl_s = ttl_s
        self._service_digest = digest(service_token) if service_token else None
        self._seen: dict[str, tuple[float, events.ApiKey | None]] = {}

    async def authorize(self, token: str | None, method: str, what: str, tenant: str | None = None,
                        scope: Scope | None = None) -> Caller:
        """The caller of a request (``method`` on ``what``, with the ``Flywheel-Tenant`` header
        ``tenant`` if it had one), which needs ``scope`` (None: ``read`` for reading methods,
        ``write`` for the rest): KeyRefused (a 401) or ScopeRefused (a 403) saying why."""
        found = await self.caller(token)
        if tenant is not None and tenant != found.tenant and not found.service:
            raise ScopeRefused(f"Flywheel-Tenant names {tenant!r}, and API key {found.key_id} is tenant "
                               f"{found.tenant!r}'s: leave the header out, or use a key of {tenant!r}")
        scope = scope or ("read" if method in READ_METHODS else "write")
        if not found.allows(scope):
            raise ScopeRefused(f"API key {found.key_id} has the scopes {', '.join(sorted(found.scopes))}; "
                               f"{method} {what} needs {scope!r}")
        return found

    async def caller(self, token: str | None) -> Caller:
        if token and self._service_digest is not None and hmac.compare_digest(digest(token), self._service_digest):
            return Caller("*", frozenset(SCOPES), "service", service=True)
        if not token:
            raise KeyRefused("no API key: send it as 'Authorization: Bearer fw_...' (`flywheel keys create` makes one)")
        match = _TOKEN.fullmatch(token)
        if match is None:
            raise KeyRefused("the API key is malformed: a key reads fw_<16 hex digits>_<secret>")
        key_id = match.group(1)
        now = time.monotonic()
        seen = self._seen.get(key_id)
        if seen is None or now - seen[0] > self.ttl_s:
            seen = self._seen[key_id] = (now, await get_key(self.bus, key_id))
        record = seen[1]
        if record is None or not hmac.compare_digest(record.sha256, digest(token)):
            raise KeyRefused(f"API key {key_id}: unknown (or its secret does not match)")
        if record.revoked_at is not None:
            raise KeyRefused(f"API key {key_id} was revoked at {record.revoked_at.isoformat()}")
        return Caller(record.tenant, frozenset(record.scopes), key_id)
