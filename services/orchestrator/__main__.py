"""``python -m flywheel_orchestrator``: the orchestrator service, which owns the training runs.

Settings (NATS URL, data folder, run lease, log level) come from FLYWHEEL_* (see
:mod:`flywheel.contract.settings`). Heavy imports wait until the arguments are parsed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flywheel_orchestrator",
        description="Own every training run registered in the run-state bucket (by `flywheel run` or the API): "
                    "start and restart its trainer, supply its tasks, keep its lease, end it. Run folders go "
                    "under the data folder (FLYWHEEL_DATA_DIR). Settings come from FLYWHEEL_* environment "
                    "variables.")
    parser.add_argument("--run-config", action="append", default=[], metavar="CONFIG.toml",
                        help="a run to own from the start (repeatable): registered under the config's own `run` "
                             "when new, resumed when it stopped, failed or was abandoned, left as it is when it "
                             "finished or runs (a deployment's runs, as compose gives them)")
    args = parser.parse_args(argv)

    from flywheel.contract.service import setup_logging, setup_telemetry
    from flywheel.contract.settings import Settings
    from flywheel_orchestrator import service

    try:
        settings = Settings.load()
    except ValueError as exc:
        parser.error(str(exc))
    setup_logging(settings.log_level)
    setup_telemetry("orchestrator", settings)
    try:
        asyncio.run(service.run(settings, run_configs=args.run_config))
    except (ConnectionError, ValueError) as exc:  # NATS unreachable, a bad run config: the message says what to do
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from flywheel.contract.heap import enable_heap_freeze

    enable_heap_freeze()  # this process is the service's own (not a test calling main())
    raise SystemExit(main())
