"""``python -m flywheel_trainer --run RUN``: the trainer process for one run.

The run's config comes from the runs KV bucket (``flywheel run`` writes it there);
settings (NATS URL, data folder; micro-batch size and bounds: section ``trainer``,
``FLYWHEEL_TRAINER__<FIELD>``) from FLYWHEEL_* (see :mod:`flywheel.contract.settings`). torch,
transformers and the trainer's parts are imported only once the arguments are parsed, so
``--help`` is instant. Exits 0 when the run has trained all its steps, or on SIGTERM/SIGINT
(a later start resumes from the last checkpoint).

Started by torch's launcher (``WORLD_SIZE`` above 1: the setting ``trainer.ranks``), rank 0 is
the trainer service and every other rank follows it (:mod:`flywheel_trainer.ranks`).
"""

from __future__ import annotations

import argparse
import asyncio
import os

from flywheel.contract.settings import Settings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m flywheel_trainer",
        description="Flywheel trainer: joins a run's rollouts with their scores, trains the policy and publishes "
                    "weight updates; resumes from the run's last checkpoint when restarted. Other settings come "
                    "from FLYWHEEL_* environment variables.")
    parser.add_argument("--run", required=True, help="the run id (its config is read from the runs KV bucket)")
    args = parser.parse_args(argv)
    try:
        settings = Settings.load()
    except ValueError as exc:
        parser.error(str(exc))
    if int(os.environ.get("RANK", "0")) > 0:  # a follower rank of torch's launcher: rank 0 serves the figures
        settings = settings.model_copy(update={"metrics_port": None})
    from flywheel.contract.service import setup_logging, setup_telemetry

    setup_logging(settings.log_level)
    setup_telemetry("trainer", settings)

    from flywheel_trainer import ranks, service

    team = ranks.start()
    if not team.leader:
        ranks.follow(team, service.RankWork(settings.trainer).calls())
        return
    asyncio.run(service.run(settings, args.run, ranks=team))


if __name__ == "__main__":
    from flywheel.contract.heap import enable_heap_freeze

    enable_heap_freeze()  # this process is the service's own (not a test calling main())
    main()
