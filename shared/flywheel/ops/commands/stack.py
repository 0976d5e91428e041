"""``flywheel up`` (the embedded stack), ``flywheel status`` (services, processes, streams, lag) and
``flywheel consumers rm`` (durables no process reads)."""

from __future__ import annotations

import argparse
import asyncio
import json
from datetime import datetime
from typing import Any

from flywheel.contract import natsusers
from flywheel.ops.commands.options import GATEWAY_SETTINGS, NATS_SETTINGS, SETTING_OPTIONS, add_settings, settings_from
from flywheel.ops.tables import size, table

STATUS_CONNECT_TIMEOUT_S = 3.0


def add(commands: Any) -> None:
    """Add this module's commands to ``commands`` (the parser's subparsers)."""
    up = commands.add_parser("up", help="run NATS and every service on this machine until Ctrl-C",
                             description="Start the embedded stack: a nats-server (unless --nats-url names one) "
                                         "and every service as a local process; supervise them until Ctrl-C.")
    up.add_argument("--training-api", action="store_true",
                    help="also serve the Tinker-compatible training API (settings training_api_host, "
                         "training_api_port; docs/training-api.md)")
    add_settings(up, tuple(SETTING_OPTIONS))
    up.set_defaults(func=cmd_up)

    status = commands.add_parser("status", help="services, stream depths and consumer lag",
                                 description="Show each service's heartbeat, the gateway's health, the processes "
                                             "`flywheel up` supervises (state, restarts, last exit, next try, log), "
                                             "each stream's depth and each consumer's lag. Exits 1 when NATS cannot "
                                             "be reached.")
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    add_settings(status, NATS_SETTINGS + GATEWAY_SETTINGS)
    status.set_defaults(func=cmd_status)

    consumers = commands.add_parser("consumers", help="remove the durable consumers no process reads",
                                    description="Durable consumers on the bus: `flywheel status` lists them with "
                                                "their lag and whether a process reads them.")
    consumer_commands = consumers.add_subparsers(dest="consumers_command", required=True, metavar="COMMAND")
    remove = consumer_commands.add_parser(
        "rm", help="delete durable consumers of a stream by name (shell patterns allowed)",
        description="Delete the durable consumers NAME of STREAM (shell patterns: 'scorer-mine-*' takes a "
                    "custom scorer's partitions), such as a custom scorer that will not run again: what it had not "
                    "read is not read by it. One a process reads now is refused (it would make it again) unless "
                    "--force.")
    remove.add_argument("stream", metavar="STREAM")
    remove.add_argument("names", metavar="NAME", nargs="+")
    remove.add_argument("--force", action="store_true", help="delete consumers a process reads now too")
    add_settings(remove, NATS_SETTINGS)
    remove.set_defaults(func=cmd_consumers_rm)



def cmd_up(args: argparse.Namespace) -> int:
    from flywheel.ops import stack

    stack.run(settings_from(args), training_api=args.training_api)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    report = asyncio.run(collect_status(settings.resolved_nats_url, settings.resolved_gateway_url))
    print(json.dumps(report, indent=2) if args.json else format_status(report))
    return 0


def cmd_consumers_rm(args: argparse.Namespace) -> int:
    from flywheel.ops.client import Client

    async def remove() -> list[str]:
        async with await Client.connect(settings_from(args).resolved_nats_url, name="flywheel-consumers",
                                        ensure=False) as fw:
            return await fw.remove_consumers(args.stream, args.names, force=args.force)

    for name in asyncio.run(remove()):
        print(f"deleted {args.stream}/{name}")
    return 0


def _replicas(stream: dict[str, Any]) -> str:
    """A stream's copies as the status table shows them: ``1``, or ``3 (leader n2)``, naming
    the nodes that are offline or not caught up."""
    if stream["replicas"] == 1 or stream["leader"] is None:
        return str(stream["replicas"])
    behind = f"; behind: {', '.join(stream['replicas_behind'])}" if stream["replicas_behind"] else ""
    return f"{stream['replicas']} (leader {stream['leader']}{behind})"


def format_status(report: dict[str, Any]) -> str:
    """The status report as readable tables (``--json`` prints ``report`` itself)."""
    gateway = report["gateway"]
    if gateway["ok"]:
        gateway_state = "ok"
    elif "error" in gateway:
        gateway_state = f"unreachable ({gateway['error']})"
    else:
        gateway_state = f"unhealthy (HTTP {gateway['status_code']}: {gateway['detail']})"
    parts = [table([["NATS", report["nats_url"], "ok"], ["gateway", gateway["url"], gateway_state]])]
    services = [[s["service"], s["instance"], s["pid"], "stale" if s["stale"] else s["status"], f"{s['age_s']:.1f}s",
                 _duration(s["uptime_s"]), _metrics_at(s)] for s in report["services"]]
    parts.append(table(services, ["SERVICE", "INSTANCE", "PID", "STATUS", "LAST BEAT", "UP", "METRICS"])
                 if services else "no services running (no heartbeats in the services KV bucket)")
    workers = [[s["instance"], w["environment"], w["tenant"] or "-", w["pid"], w["in_flight"], w["calls"]]
               for s in report["services"] if not s["stale"]
               for w in (s.get("info") or {}).get("workers") or []]
    if workers:  # where environment code runs: each service's workers, by environment and tenant
        parts.append(table(workers, ["HOST SERVICE", "ENVIRONMENT", "TENANT", "WORKER PID", "IN FLIGHT", "CALLS"]))
    parts += [format_stack(stack) for stack in report["stacks"]]
    streams = [[s["stream"], s["messages"], size(s["bytes"]), s["consumers"], _replicas(s)] for s in report["streams"]]
    parts.append(table(streams, ["STREAM", "MESSAGES", "SIZE", "CONSUMERS", "REPLICAS"])
                 if streams else "no Flywheel streams yet (nothing has connected with `flywheel up` or a service)")
    consumers = [[c["stream"], c["consumer"], c["num_pending"], c["num_ack_pending"], c["num_redelivered"],
                  _reader(c)] for c in report["consumers"]]
    parts.append(table(consumers, ["STREAM", "CONSUMER", "PENDING", "ACK PENDING", "REDELIVERED", "READ BY"])
                 if consumers else "no consumers")
    idle = [c for c in report["consumers"] if not c["pulled"]]
    if idle:
        parts.append(f"{len(idle)} consumer(s) no process reads now (READ BY: idle): between two pulls, or of a "
                     "process that stopped. A stopped custom scorer's durable keeps its place for its return; "
                     "a run's own go when it ends. `flywheel consumers rm STREAM NAME` removes one.")
    return "\n\n".join(parts)


def _reader(consumer: dict[str, Any]) -> str:
    """Whether a process reads the consumer now, or when it last delivered."""
    if consumer["pulled"]:
        return "a process"
    last = consumer["last_active"]
    return f"idle (last delivery {_local_time(last)})" if last else "idle (nothing delivered)"


def format_stack(stack: dict[str, Any]) -> str:
    """What one ``flywheel up`` supervises: a line on the stack, a table of its processes, then a
    line for each failing one: why it exited, how often, when it is tried next, its log."""
    beat = "stale: it has likely died" if stack["stale"] else f"last beat {stack['age_s']:.1f}s ago"
    lines = [(f"stack pid {stack['pid']} on {stack['host']} ({beat}): a crash loop waits "
              f"{stack['restart_backoff_s']:g}s, doubling up to {stack['max_backoff_s']:g}s; a process healthy "
              f"{stack['healthy_after_s']:g}s is restarted at once")]
    rows = [[p["name"], "-" if p["pid"] is None else p["pid"], _process_state(p), p["num_restarts"],
             p["last_exit"] or "-", p["log"]] for p in stack["processes"]]
    lines.append(table(rows, ["PROCESS", "PID", "STATE", "RESTARTS", "LAST EXIT", "LOG"]))
    for p in stack["processes"]:
        if p["name"] in stack["failing"]:
            lines.append(f"{p['name']} is failing: last exit {p['last_exit']}, {p['num_failures']} exits in a row, "
                         f"{p['num_restarts']} restarts; {_next_try(p)}; see {p['log']}")
    return "\n".join(lines)


def _metrics_at(service: dict[str, Any]) -> str:
    """Where a service instance serves its Prometheus figures (setting metrics_port), or "-"."""
    port = (service.get("info") or {}).get("metrics_port")
    return "-" if port is None else f"{service.get('host') or '?'}:{port}/metrics"


def _process_state(process: dict[str, Any]) -> str:
    if process["state"] != "backing off":
        return process["state"]
    return f"backing off until {_local_time(process['next_start_at'])} (in {process['next_start_in_s']:.0f}s)"


def _next_try(process: dict[str, Any]) -> str:
    if process["state"] != "backing off":
        return "started again, not healthy yet"
    return f"next try in {process['next_start_in_s']:.0f}s, at {_local_time(process['next_start_at'])}"


def _local_time(iso: str) -> str:
    return datetime.fromisoformat(iso).astimezone().strftime("%H:%M:%S")


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


async def collect_status(nats_url: str, gateway_url: str) -> dict[str, Any]:
    """The status report as plain data: NATS and gateway endpoints plus the client's view."""
    from flywheel.contract.bus import BusConfig
    from flywheel.ops.client import Client
    from flywheel.sdk.gateway import health

    config = BusConfig(connect_timeout_s=STATUS_CONNECT_TIMEOUT_S)
    async with await Client.connect(nats_url, name="flywheel-status", config=config, ensure=False) as fw:
        report = await fw.status()
    return {"nats_url": natsusers.redacted(nats_url), "gateway": await health(gateway_url), **report}
