"""``python -m flywheel_gateway {api,recorder}``: the gateway's two processes.

``api`` serves the HTTP API with uvicorn on gateway_host:gateway_port (migrating the store
first); on SIGTERM, requests still open after ``GRACEFUL_SHUTDOWN_S`` (a live trace stream
never ends by itself) are cut. ``recorder`` records every stream into the store. Both read
their settings from FLYWHEEL_* (see :mod:`flywheel.contract.settings`). Heavy imports wait until the
arguments are parsed, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable

from flywheel.contract.settings import Settings

GRACEFUL_SHUTDOWN_S = 5  # whole seconds: uvicorn's timeout_graceful_shutdown is an int


def _api(settings: Settings) -> None:
    import uvicorn

    from flywheel_gateway.app import create_app

    uvicorn.run(create_app(settings), host=settings.gateway_host, port=settings.gateway_port,
                log_level=settings.log_level.lower(), timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)


def _recorder(settings: Settings) -> None:
    from flywheel_gateway import recorder

    asyncio.run(recorder.run(settings))


COMMANDS: dict[str, tuple[Callable[[Settings], None], str]] = {
    "api": (_api, "serve the HTTP API (migrates the trace store first)"),
    "recorder": (_recorder, "record every stream into the trace store"),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flywheel_gateway",
                                     description="Flywheel gateway: HTTP API and stream recorder. "
                                                 "Settings come from FLYWHEEL_* environment variables.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        commands.add_parser(name, help=help_text)
    args = parser.parse_args(argv)
    try:
        settings = Settings.load()
    except ValueError as exc:
        parser.error(str(exc))
    from flywheel.contract.service import setup_logging, setup_telemetry

    setup_logging(settings.log_level)
    setup_telemetry(f"gateway-{args.command}", settings)
    COMMANDS[args.command][0](settings)


if __name__ == "__main__":
    from flywheel.contract.heap import enable_heap_freeze

    enable_heap_freeze()  # this process is the service's own (not a test calling main())
    main()
