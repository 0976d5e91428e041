"""NATS users: one a service, each allowed to publish only what that service publishes.

A scorer cannot publish weights, a sandbox service cannot publish tasks, no service but the
gateway writes API keys. ``flywheel up`` (and ``flywheel run`` when it starts the stack) runs
its nats-server with these users: their passwords are made once and kept in
``<data_dir>/nats-users.json`` (readable by its owner alone), each service it starts logs in
as its own user (``nats_user``, ``nats_password``), and every command run with the same
``data_dir`` (``flywheel status``, ``runs``, ``tasks publish``, ``run``) as ``operator``, which
may do everything. On one machine the services run as one OS user, who can read that file:
there the users keep a service's mistakes off other services' subjects. The compose
deployment gives each container its own password alone: its nats container writes
:func:`server_config` at start from the ``NATS_<USER>_PASSWORD`` variables of its environment
(``python -m flywheel.contract.natsusers FILE``), each a quoted literal. Not the server's own
``$VARIABLE`` references: nats-server reads such a variable's value as a config value, so a
password such as ``12-ab`` is taken for a date and refused, and ``5Kb`` becomes a number.

What a user may publish is the table below (:data:`PUBLISH`), and every user but ``operator``
and ``orchestrator`` is denied deleting or purging streams. Subscriptions are not restricted:
the bus's consumers are JetStream's, whose API each service needs. The trainers a run's
orchestrator starts log in as the orchestrator (they publish weights; it publishes tasks).

Not closed by subject permissions: the server sends a JetStream API reply to whatever reply
subject the request names, so a service allowed that API can have the server's JSON answer
stored on a stream's subject. Its content is the server's, never a valid event: the consumer
dead-letters it, as any message that does not decode.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

USERS_FILE = "nats-users.json"
OPERATOR = "operator"  # the stack itself and the command line: no restriction
RUNS_KV, SERVICES_KV, KEYS_KV = "$KV.flywheel-runs.>", "$KV.flywheel-services.>", "$KV.flywheel-keys.>"
ADMISSION_KV = "$KV.flywheel-admission.>"  # each run's issued rollouts, shared by the inference replicas
PARTITIONS_KV = "$KV.flywheel-partitions.>"  # which scorer replica consumes which rollout partition
# What every service publishes: JetStream API requests (its consumers, the KV reads), acks and
# flow control, its heartbeat, dead letters, replies to requests.
COMMON = ("$JS.API.>", "$JS.ACK.>", "$JS.FC.>", SERVICES_KV, "dead.>", "_INBOX.>")
PUBLISH: dict[str, tuple[str, ...]] = {
    # the runs it owns, their tasks, evals (rollouts, traces, scores) and trainers (weights, usage)
    "orchestrator": (">",),
    "gateway": (*COMMON, "tasks.>", RUNS_KV, KEYS_KV),  # published tasks, runs' stop/pause/resume, API keys
    "recorder": COMMON,  # reads every stream into the trace store
    "inference": (*COMMON, "rollouts.>", "traces.>", "signals.>", "usage.>", "sandbox.>", ADMISSION_KV),
    "scorer": (*COMMON, "scores.>", "sandbox.>", PARTITIONS_KV),  # custom scorers too
    "sandbox": (*COMMON, "usage.>"),
}
DENY: dict[str, tuple[str, ...]] = {
    "orchestrator": (KEYS_KV,),
    **{user: ("$JS.API.STREAM.DELETE.>", "$JS.API.STREAM.PURGE.>")
       for user in ("gateway", "recorder", "inference", "scorer", "sandbox")},
}
USERS = (OPERATOR, *PUBLISH)


def password_variable(user: str) -> str:
    """The environment variable of ``user``'s password in the compose deployment."""
    return f"NATS_{user.upper()}_PASSWORD"


def server_config(passwords: Mapping[str, str]) -> str:
    """nats-server's ``authorization`` block for every user of :data:`USERS` with its password,
    each a quoted literal (what nats-server reads as the string it is, whatever its characters)."""
    lines = ["authorization {", "  users = ["]
    for user in USERS:
        shown = json.dumps(passwords[user])
        if user == OPERATOR:
            lines.append(f"    {{user: {user}, password: {shown}}}")
            continue
        allow = ", ".join(json.dumps(s) for s in PUBLISH[user])
        deny = ", ".join(json.dumps(s) for s in DENY.get(user, ()))
        lines.append(f"    {{user: {user}, password: {shown}, permissions: {{"
                     f"publish: {{allow: [{allow}], deny: [{deny}]}}, subscribe: {{allow: [\">\"]}}}}}}")
    return "\n".join([*lines, "  ]", "}"])


def read(data_dir: str | Path) -> dict[str, str] | None:
    """The passwords ``flywheel up`` made for ``data_dir`` (None when it made none there)."""
    path = Path(data_dir) / USERS_FILE
    try:
        passwords = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} does not read as the NATS users' passwords ({exc}); delete it and restart "
                         "`flywheel up`, which makes new ones") from exc
    missing = [u for u in USERS if not isinstance(passwords.get(u), str)]
    if missing:
        raise ValueError(f"{path} has no password for NATS user(s) {', '.join(missing)}; delete it and restart "
                         "`flywheel up`, which makes new ones")
    return dict(passwords)


def load_or_create(data_dir: str | Path) -> dict[str, str]:
    """The passwords of ``data_dir``'s stack, made now (random, file mode 0600) the first time."""
    found = read(data_dir)
    if found is not None:
        return found
    path = Path(data_dir) / USERS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    passwords = {user: secrets.token_urlsafe(24) for user in USERS}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(passwords, f, indent=2)
    return passwords


def split_login(url: str) -> tuple[str, str | None, str | None]:
    """``url`` without its login, and the user and password it carried (unquoted; None: none).
    A cluster's comma-separated URLs each lose theirs; the first login given is the one."""
    if "," in url:
        split = [split_login(part.strip()) for part in url.split(",") if part.strip()]
        user, password = next(((u, p) for _, u, p in split if u is not None), (None, None))
        return ",".join(server for server, _, _ in split), user, password
    parts = urlsplit(url if "://" in url else f"nats://{url}")
    if parts.username is None:
        return url, None, None
    netloc = (parts.hostname or "127.0.0.1") + (f":{parts.port}" if parts.port else "")
    server = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return server, unquote(parts.username), unquote(parts.password or "")


def with_user(url: str, user: str, password: str) -> str:
    """``url`` (or each of a cluster's comma-separated URLs) logging in as ``user``."""
    if "," in url:
        return ",".join(with_user(part.strip(), user, password) for part in url.split(",") if part.strip())
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme or "nats", netloc, parts.path, parts.query, parts.fragment))


def redacted(url: str) -> str:
    """``url`` (each of a cluster's comma-separated URLs) without its password, to be shown."""
    if "," in url:
        return ",".join(redacted(part.strip()) for part in url.split(","))
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def environment_passwords(environ: Mapping[str, str]) -> dict[str, str]:
    """Every user's password from its ``NATS_<USER>_PASSWORD`` variable in ``environ``; a
    ValueError naming each one missing or empty."""
    missing = [password_variable(user) for user in USERS if not environ.get(password_variable(user))]
    if missing:
        raise ValueError(f"set {', '.join(missing)} (in compose/.env): the NATS password of each user; "
                         "compose/.env.example shows a line that makes them")
    return {user: environ[password_variable(user)] for user in USERS}


def main(argv: list[str] | None = None) -> int:
    """``python -m flywheel.contract.natsusers FILE``: nats-server's users with the passwords of
    this environment, written to FILE (mode 0600), for a deployment's nats container."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m flywheel.contract.natsusers FILE", file=sys.stderr)
        return 2
    try:
        config = server_config(environment_passwords(os.environ))
    except ValueError as exc:
        print(f"nats users: {exc}", file=sys.stderr)
        return 1
    fd = os.open(args[0], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(config + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
