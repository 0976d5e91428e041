"""``flywheel keys``: tenants' API keys in the keys bucket (:mod:`flywheel.contract.keys`).

    flywheel keys create --tenant T [--scope read --scope write ...] [--name NAME]
    flywheel keys list [--tenant T]
    flywheel keys revoke ID

They talk to the bus straight away (whoever reaches the bus runs the deployment): this is
how the first key of a deployment is made. ``create`` prints the key once; only its hash is
kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO

from flywheel.contract import keys
from flywheel.contract.settings import Settings
from flywheel.ops.runs import connect
from flywheel.ops.tables import table


async def create_command(settings: Settings, tenant: str, scopes: Sequence[str], name: str, out: TextIO) -> str:
    bus = await connect(settings, "making an API key")
    try:
        token, record = await keys.create_key(bus, tenant, scopes, name)
    finally:
        await bus.close()
    print(f"API key {record.id} of tenant {record.tenant!r} ({', '.join(record.scopes)}); it is shown this once, "
          "keep it (send it as 'Authorization: Bearer KEY'):", file=out)
    print(token, file=out)
    return token


async def list_command(settings: Settings, tenant: str | None, out: TextIO) -> None:
    bus = await connect(settings, "listing API keys")
    try:
        records = await keys.list_keys(bus, tenant)
    finally:
        await bus.close()
    if not records:
        print("no API keys (`flywheel keys create --tenant T` makes one)", file=out)
        return
    rows = [[r.id, r.tenant, ",".join(r.scopes), r.name or "-", r.created_at.strftime("%Y-%m-%d %H:%M"),
             r.revoked_at.strftime("%Y-%m-%d %H:%M") if r.revoked_at else "-"] for r in records]
    print(table(rows, ["id", "tenant", "scopes", "name", "created", "revoked"]), file=out)


async def revoke_command(settings: Settings, key_id: str, out: TextIO) -> None:
    bus = await connect(settings, "revoking an API key")
    try:
        record = await keys.revoke_key(bus, key_id)
    finally:
        await bus.close()
    print(f"API key {record.id} of tenant {record.tenant!r} is revoked (services refuse it within "
          f"{keys.CACHE_S:.0f} s)", file=out)
