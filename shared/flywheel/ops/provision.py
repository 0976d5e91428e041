"""``python -m flywheel.ops.provision``: make the bus's streams, KV buckets and weights object store.

Only the operator may (:mod:`flywheel.contract.natsusers`): the services find them made, and
stop naming one that is missing. ``flywheel up`` does this itself at start; a deployment runs it
once before its services, logged in as the operator (compose's ``nats-init`` service). Settings
as every command reads them (``FLYWHEEL_NATS_URL``, ``FLYWHEEL_NATS_USER=operator``,
``FLYWHEEL_NATS_PASSWORD``, ``FLYWHEEL_NATS_CLUSTER`` for the replicas). Idempotent: a stream
there already is brought to its configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from flywheel.contract.bus import Bus, BusConfig
from flywheel.contract.natsusers import OPERATOR, redacted, split_login
from flywheel.contract.settings import Settings


async def provision(settings: Settings) -> str:
    """Make (or update) every stream and bucket as ``settings``' login; what it did, for people."""
    url = settings.resolved_nats_url
    user = split_login(url)[1]
    if user is not None and user != OPERATOR:
        raise ValueError(f"NATS user {user!r} may not make streams: provision as {OPERATOR!r} "
                         "(FLYWHEEL_NATS_USER=operator and its FLYWHEEL_NATS_PASSWORD)")
    replicas = settings.nats_cluster if settings.nats_cluster > 1 else None
    bus = await Bus.connect(url, "flywheel-provision", BusConfig(replicas=replicas))
    try:
        return f"the bus's streams and buckets are there, {bus.replicas} copies each, on {redacted(url)}"
    finally:
        await bus.close()


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m flywheel.ops.provision", description=__doc__.split("\n\n")[0],
                            epilog="Settings from FLYWHEEL_* (the NATS URL and the operator's login).").parse_args(argv)
    try:
        print(asyncio.run(provision(Settings.load())))
    except (ConnectionError, ValueError) as exc:
        print(f"provision: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
