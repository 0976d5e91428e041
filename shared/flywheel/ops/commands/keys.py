"""``flywheel keys create | list | revoke``: tenants' API keys."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from flywheel.ops.commands.options import NATS_SETTINGS, add_settings, settings_from


def add(commands: Any) -> None:
    """Add this module's commands to ``commands`` (the parser's subparsers)."""
    keys = commands.add_parser("keys", help="tenants' API keys: create, list, revoke",
                               description="API keys of the gateway's and inference's HTTP APIs (settings: auth = "
                                           "\"keys\"), kept hashed in the keys bucket on the bus.")
    keys_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    create = keys_commands.add_parser("create", help="make a key; it is printed once",
                                      description="Make an API key of TENANT and print it (once: only its hash is "
                                                  "kept). Scopes: read (GET), write (tasks, run changes, sampling), "
                                                  "admin (the tenant's keys); read and write without --scope.")
    create.add_argument("--tenant", required=True)
    create.add_argument("--scope", action="append", dest="scopes", choices=("read", "write", "admin"),
                        help="a scope of the key (repeat for more)")
    create.add_argument("--name", default="", help="what the key is for, shown by `flywheel keys list`")
    add_settings(create, NATS_SETTINGS)
    create.set_defaults(func=cmd_keys_create)
    keys_list = keys_commands.add_parser("list", help="every key: id, tenant, scopes, revoked",
                                         description="Every API key (never the key itself): id, tenant, scopes, "
                                                     "name, when made and revoked.")
    keys_list.add_argument("--tenant", help="only this tenant's keys")
    add_settings(keys_list, NATS_SETTINGS)
    keys_list.set_defaults(func=cmd_keys_list)
    revoke = keys_commands.add_parser("revoke", help="revoke a key by its id",
                                      description="Revoke the key with id ID (`flywheel keys list`): the gateway "
                                                  "and inference refuse it within seconds.")
    revoke.add_argument("key_id", metavar="ID")
    add_settings(revoke, NATS_SETTINGS)
    revoke.set_defaults(func=cmd_keys_revoke)



def cmd_keys_create(args: argparse.Namespace) -> int:
    from flywheel.ops.keys import create_command

    asyncio.run(create_command(settings_from(args), args.tenant, args.scopes or ["read", "write"], args.name,
                               sys.stdout))
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    from flywheel.ops.keys import list_command

    asyncio.run(list_command(settings_from(args), args.tenant, sys.stdout))
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from flywheel.ops.keys import revoke_command

    asyncio.run(revoke_command(settings_from(args), args.key_id, sys.stdout))
    return 0
