"""``python -m flywheel_sandbox``: the sandbox service (backend from setting ``sandbox_backend``).

Settings (NATS URL, backend, image, caps, warm pool, whether sandboxes may have network, log
level, and the limits of section ``sandbox``) come from FLYWHEEL_* (see
:mod:`flywheel.contract.settings`). Heavy imports wait until the arguments are parsed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from flywheel.contract.settings import Settings


def main(argv: Sequence[str] | None = None, settings: Settings | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flywheel_sandbox",
        description="Run untrusted code for tools and verifiers: NATS request/reply on sandbox.*. Settings come "
                    "from FLYWHEEL_* environment variables (sandbox_backend, sandbox_image, sandbox_max_alive, "
                    "sandbox_max_starting, sandbox_warm_pool, sandbox_allow_network: off, a spec asking for "
                    "network is refused; limits on requests, output and files: FLYWHEEL_SANDBOX__<FIELD>).")
    parser.parse_args(argv)

    from flywheel.contract.service import setup_logging, setup_telemetry
    from flywheel_sandbox import service

    # imported here: --help loads no backend (their probes and the docker client come with them)
    from flywheel_sandbox.backends import BackendUnavailable

    try:
        settings = settings or Settings.load()
    except ValueError as exc:
        parser.error(str(exc))
    setup_logging(settings.log_level)
    setup_telemetry("sandbox", settings)
    try:
        asyncio.run(service.run(settings))
    except (ConnectionError, BackendUnavailable) as exc:  # NATS unreachable, backend missing: the message says
        # what to do
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from flywheel.contract.heap import enable_heap_freeze

    enable_heap_freeze()  # this process is the service's own (not a test calling main())
    raise SystemExit(main())
