"""``python -m flywheel_scorer``: the built-in scorer, or a custom one.

    python -m flywheel_scorer                     every environment's own rewards, every run
    python -m flywheel_scorer --function MODULE:FUNCTION --env ENV [--name NAME] [--weight W] [--group]

A custom scorer's function takes any of ``completion``, ``messages``, ``task``, ``state`` and
``rollout`` by name (as an environment's rewards do), may be ``async``, and returns a number
or a dict of numbers (components); with ``--group`` it is a group reward, which takes the
plural names (``completions``, ``tasks``, ``states``, ...) and returns one value per rollout. ``flywheel scorer
MODULE:FUNCTION --env ENV`` calls :func:`main` with these arguments. Settings (NATS URL, log
level) come from FLYWHEEL_* (see :mod:`flywheel.contract.settings`) unless the caller passes its own.

Heavy imports wait until the arguments are parsed, so ``--help`` is instant; a custom
scorer's function and environment are loaded before connecting, so a mistake in either
fails at once with a message naming the option.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flywheel.contract.settings import Settings


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
                             "(rollouts.RUN.ENV)")
    custom.add_argument("--name", help="scorer name in Scores and subjects (default: the function's name)")
    custom.add_argument("--weight", type=float,
                        help="weight of its scores where the run's config does not set one (default 1.0)")
    custom.add_argument("--group", action="store_true",
                        help="a group reward: sees every rollout of a group at once, returns one value per rollout "
                             "(run one process per durable: replicas would split groups)")
    bounds = parser.add_argument_group("bounds")
    bounds.add_argument("--max-in-flight", type=_at_least_one, default=64, metavar="N",
                        help="rollouts scored at once (default 64)")
    bounds.add_argument("--threads", type=_at_least_one, default=8, metavar="N",
                        help="threads that run sync reward functions (default 8)")
    bounds.add_argument("--max-held", type=_at_least_one, default=1024, metavar="N",
                        help="rollouts held waiting for the rest of their group (default 1024); beyond it the "
                             "oldest group is scored with what arrived")
    bounds.add_argument("--group-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="a group incomplete this long is scored with what arrived, with an error naming the "
                             "missing rollouts (default 300)")
    return parser


def main(argv: Sequence[str] | None = None, settings: Settings | None = None) -> int:
    """Run a scorer until SIGTERM or SIGINT; returns the exit status (0 after a clean stop)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.function is None:
        stray = [flag for flag in ("env", "name", "weight") if getattr(args, flag) is not None]
        stray += ["group"] if args.group else []
        if stray:
            parser.error(f"{', '.join('--' + f for f in stray)}: only for a custom scorer; add "
                         "--function MODULE:FUNCTION")
    elif args.env is None:
        parser.error("--function needs --env ENV: the environment whose rollouts it scores")

    import asyncio

    from flywheel.contract.service import setup_logging, setup_tracing
    from flywheel.contract.settings import Settings
    from flywheel_scorer import scorer

    settings = settings or Settings()
    setup_logging(settings.log_level)
    try:
        config = scorer.ScorerConfig(max_in_flight=args.max_in_flight, num_threads=args.threads,
                                     max_held=args.max_held, group_timeout_s=args.group_timeout)
        if args.function is None:
            rewards: scorer.RewardSource = scorer.EnvironmentRewards()
        else:
            weight = 1.0 if args.weight is None else args.weight
            rewards = scorer.custom_reward(args.function, args.env, args.name, weight, group=args.group)
    except ValueError as exc:
        parser.error(str(exc))
    setup_tracing(rewards.durable)
    try:
        asyncio.run(scorer.run(settings, rewards, config))
    except ConnectionError as exc:  # NATS unreachable: the message says what to check
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
