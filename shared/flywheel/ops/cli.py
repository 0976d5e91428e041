"""The ``flywheel`` command: a thin entry point over the shared package.

    flywheel up                                   the embedded stack (flywheel.ops.stack)
    flywheel status [--json]                      services, the stack's processes, streams, consumers
    flywheel tasks publish ENV --run RUN --file rows.jsonl [--num-rollouts N]
    flywheel schema [--out FILE]                  JSON Schema of every event
    flywheel run CONFIG.toml                      a training run, start to finish (flywheel.ops.run)
    flywheel run --help-config                    every run config field, generated from the config model
    flywheel runs list | follow RUN | pause RUN | stop RUN | resume RUN   the stack's runs (flywheel.ops.runs)
    flywheel keys create --tenant T [--scope S ...] | list | revoke ID   tenants' API keys (flywheel.ops.keys)
    flywheel export RUN [--step N] DIR            a run's checkpoint as a Hugging Face folder (flywheel.ops.export)
    flywheel model tiny|smollm2 DIR               build or convert a model into an HF folder
    flywheel scorer MODULE:FUNCTION --env ENV     a custom scorer, as its own consumer
    flywheel eval ENV --model NAME [-n N -r R -c C]   an environment against an OpenAI-compatible endpoint
    flywheel env init NAME | flywheel env list    scaffold an environment package; installed environments
    flywheel env push | install | fork | show     the environment hub: upload, install by id, fork, leaderboard
    flywheel env import harbor SRC OWNER/NAME     Harbor task folders as an environment package

Settings come from :class:`flywheel.contract.settings.Settings` (``FLYWHEEL_*`` variables, the TOML
file named by ``FLYWHEEL_CONFIG``); an option such as ``--nats-url`` overrides the setting of
the same name. Each group of commands is a module of :mod:`flywheel.ops.commands` (stack,
tasks, runs, keys, evals, envs: its parsers and handlers); this one puts them together. At
import time they load only the standard library and a few small modules of their own, so
``--help`` is fast (a test holds it to that); each command imports what else it needs when
it runs.

Not covered: reading traces over the gateway's HTTP API from here: use the API or flywheel.ops.client.TraceAPI.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from flywheel.ops.commands import envs, evals, keys, runs, stack, tasks
from flywheel.ops.commands.options import GATEWAY_SETTINGS, NATS_SETTINGS, SETTING_OPTIONS, settings_from

__all__ = ["GATEWAY_SETTINGS", "NATS_SETTINGS", "SETTING_OPTIONS", "build_parser", "main", "settings_from"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flywheel",
        description="Flywheel: post-training over NATS JetStream. Settings: FLYWHEEL_* variables, "
                    "a TOML file named by FLYWHEEL_CONFIG, or a command's options (which win). "
                    "`flywheel COMMAND --help` tells more.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for group in (stack, tasks, runs, keys, evals, envs):
        group.add(commands)
    return parser


# --- entry point --------------------------------------------------------------------------


def _is_user_error(exc: Exception) -> bool:
    """Errors whose message says what to fix: shown without a traceback."""
    from flywheel.ops.stack import StackError
    from flywheel.sdk.hub import HubError

    return isinstance(exc, (ValueError, ConnectionError, FileNotFoundError, IsADirectoryError,
                            PermissionError, StackError, HubError))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if not _is_user_error(exc):
            raise
        print(f"flywheel: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
