"""``flywheel tasks publish`` (task rows straight to the bus) and ``flywheel schema`` (the events' JSON Schema)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from flywheel.ops.commands.options import NATS_SETTINGS, add_settings, settings_from


def add(commands: Any) -> None:
    """Add this module's commands to ``commands`` (the parser's subparsers)."""
    tasks = commands.add_parser("tasks", help="publish tasks straight to the bus",
                                description="Work with tasks on the bus, without the gateway.")
    tasks_commands = tasks.add_subparsers(dest="tasks_command", required=True, metavar="COMMAND")
    publish = tasks_commands.add_parser(
        "publish", help="publish the rows of a JSONL file as tasks",
        description="Publish each line of a JSONL file (a JSON object: the task's data row) as a task on "
                    "tasks.RUN.ENV. A row's string \"id\" is its task id; other rows get a deterministic id, "
                    "so the server drops the same file published again within its duplicate window (2 minutes "
                    "by default). Every line is checked before anything is published.")
    publish.add_argument("env", metavar="ENV", help="environment name (a NATS subject token)")
    publish.add_argument("--run", required=True, help="run id (a NATS subject token); registered if new")
    publish.add_argument("--file", required=True, help="JSONL file, one task row (JSON object) per line")
    publish.add_argument("--num-rollouts", type=int, default=1, metavar="N",
                         help="rollouts per task, one group (default 1)")
    publish.add_argument("--tenant", default="default", help="tenant that owns a newly registered run")
    add_settings(publish, NATS_SETTINGS)
    publish.set_defaults(func=cmd_tasks_publish)

    schema = commands.add_parser("schema", help="print the JSON Schema of every event",
                                 description="Print (or write) the JSON Schema of every event on the bus.")
    schema.add_argument("--out", metavar="FILE", help="write to FILE instead of standard output")
    schema.set_defaults(func=cmd_schema)



def cmd_tasks_publish(args: argparse.Namespace) -> int:
    from flywheel.ops.client import Client, read_jsonl
    from flywheel.runtime.tasks import make_tasks  # imported here: msgspec (the events), kept out of --help

    settings = settings_from(args)
    tasks = make_tasks(args.run, args.env, read_jsonl(args.file), num_rollouts=args.num_rollouts, source=args.file)

    async def publish() -> Any:
        async with await Client.connect(settings.resolved_nats_url, name="flywheel-cli") as fw:
            return await fw.publish(tasks, tenant=args.tenant)

    published = asyncio.run(publish())
    registered = f"registered run {args.run}" if published.runs_created else f"run {args.run} already registered"
    print(f"published {published.num_new} tasks to tasks.{args.run}.{args.env}, "
          f"{published.num_duplicates} duplicates (dropped by the server); {registered}")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    # imported here: --help loads no msgspec, pydantic or nats (tests/unit/test_cli.py)
    from flywheel.contract import events

    text = json.dumps(events.json_schema(), indent=2) + "\n"
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote the event schema to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
