"""``python -m flywheel_scorer``: the built-in scorer, or a custom one.

    python -m flywheel_scorer                     every environment's own rewards, every run
    python -m flywheel_scorer --function MODULE:FUNCTION --env ENV [--name NAME] [--weight W] [--group]
                                                  [--run RUN ... | --backfill]

A custom scorer's function takes any of ``completion``, ``messages``, ``task``, ``state`` and
``rollout`` by name (as an environment's rewards do), may be ``async``, and returns a number
or a dict of numbers (components); with ``--group`` it is a group reward, which takes the
plural names (``completions``, ``tasks``, ``states``, ...) and returns one value per rollout. ``flywheel scorer
MODULE:FUNCTION --env ENV`` calls :func:`main` with these arguments. Settings (NATS URL, log
level, and the bounds: section ``scorer``, e.g. ``FLYWHEEL_SCORER__MAX_HELD``) come from
FLYWHEEL_* (see :mod:`flywheel.contract.settings`) unless the caller passes its own; the
bounds' options below win over them.

Heavy imports wait until the arguments are parsed, so ``--help`` is instant; a custom
scorer's options are checked before connecting, and its function and environment are loaded
(in an environment worker, never in this process) before anything is scored, so a mistake in
either fails at once with a message naming the option.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from flywheel.contract.settings import ScorerSettings, Settings

# option -> the field of the settings' scorer section it overrides
BOUNDS = {"max_in_flight": "max_in_flight", "threads": "num_threads", "max_held": "max_held",
          "group_timeout": "group_timeout_s"}


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flywheel_scorer",
        description="Score rollouts and publish one Score per reward. Without --function: every environment's "
                    "own rewards, on every run (durable consumer 'scorer'). With --function: a custom scorer "
                    "for one environment (durable consumer 'scorer-NAME'). Settings come from FLYWHEEL_* "
                    "environment variables.")
    custom = parser.add_argument_group("custom scorer")
    custom.add_argument("--function", metavar="MODULE:FUNCTION",
                        help="the function to score with: takes any of completion, messages, task, state, rollout "
                             "by name, returns a number (or a dict of numbers); sync or async")
    custom.add_argument("--env", metavar="ENV",
                        help="the environment whose rollouts it scores, as named in their subjects "
                             "(rollouts.RUN.ENV.PARTITION)")
    custom.add_argument("--name", help="scorer name in Scores and subjects (default: the function's name)")
    custom.add_argument("--weight", type=float,
                        help="weight of its scores where the run's config does not set one (default 1.0)")
    custom.add_argument("--group", action="store_true",
                        help="a group reward: sees every rollout of a group at once, returns one value per rollout "
                             "(replicas split the rollout partitions, never a group)")
    custom.add_argument("--run", action="append", default=[], metavar="RUN",
                        help="a run whose rollouts it scores, all of them (repeat for more); default: rollouts from "
                             "now on, and those of runs still going whose reward names this scorer (when its "
                             "durable is new)")
    custom.add_argument("--backfill", action="store_true",
                        help="score every stored rollout of the environment, finished runs included, then new "
                             "ones (when its durable is new)")
    bounds = parser.add_argument_group("bounds (default: the settings' scorer section, FLYWHEEL_SCORER__<FIELD>)")
    bounds.add_argument("--max-in-flight", type=_at_least_one, metavar="N",
                        help="rollouts scored at once (setting scorer.max_in_flight)")
    bounds.add_argument("--threads", type=_at_least_one, metavar="N",
                        help="threads that run sync reward functions in each environment worker (setting "
                             "scorer.num_threads)")
    bounds.add_argument("--max-held", type=_at_least_one, metavar="N",
                        help="rollouts held waiting for the rest of their group; beyond it the oldest group is "
                             "scored with what arrived (setting scorer.max_held)")
    bounds.add_argument("--group-timeout", type=float, metavar="SECONDS",
                        help="a group incomplete this long is scored with what arrived, with an error naming the "
                             "missing rollouts (setting scorer.group_timeout_s)")
    return parser


def scorer_bounds(args: argparse.Namespace, settings: Settings) -> ScorerSettings:
    """The settings' scorer section with the options given on top; a bad value is a ValueError naming the option."""
    given = {field: getattr(args, option) for option, field in BOUNDS.items() if getattr(args, option) is not None}
    try:
        return ScorerSettings.model_validate(settings.scorer.model_dump() | given)
    except ValidationError as exc:
        options = {field: option for option, field in BOUNDS.items()}
        raise ValueError("; ".join(f"--{options[e['loc'][0]].replace('_', '-')}: {e['msg']}" for e in exc.errors()
                                   if e["loc"] and e["loc"][0] in options)) from exc


def main(argv: Sequence[str] | None = None, settings: Settings | None = None) -> int:
    """Run a scorer until SIGTERM or SIGINT; returns the exit status (0 after a clean stop)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.function is None:
        stray = [flag for flag in ("env", "name", "weight") if getattr(args, flag) is not None]
        stray += ["group"] if args.group else []
        stray += ["run"] if args.run else []
        stray += ["backfill"] if args.backfill else []
        if stray:
            parser.error(f"{', '.join('--' + f for f in stray)}: only for a custom scorer; add "
                         "--function MODULE:FUNCTION")
    elif args.env is None:
        parser.error("--function needs --env ENV: the environment whose rollouts it scores")

    from flywheel.contract.service import setup_logging, setup_telemetry
    from flywheel_scorer import scorer

    try:
        settings = settings or Settings.load()
    except ValueError as exc:
        parser.error(str(exc))
    setup_logging(settings.log_level)
    try:
        settings = settings.model_copy(update={"scorer": scorer_bounds(args, settings)})
        if args.function is None:
            rewards: scorer.RewardSource = scorer.EnvironmentRewards()
        else:
            weight = 1.0 if args.weight is None else args.weight
            rewards = scorer.custom_reward(args.function, args.env, args.name, weight, group=args.group,
                                           runs=args.run, backfill=args.backfill)
    except ValueError as exc:
        parser.error(str(exc))
    setup_telemetry(rewards.durable, settings)
    try:
        asyncio.run(scorer.run(settings, rewards))
    except ConnectionError as exc:  # NATS unreachable: the message says what to check
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a custom scorer's function or environment that does not load, in its worker
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    from flywheel.contract.heap import enable_heap_freeze

    enable_heap_freeze()  # this process is the service's own (not a test calling main())
    raise SystemExit(main())
