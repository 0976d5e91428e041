"""NATS users: one a service, each allowed exactly what that service does on the bus.

``flywheel up`` (and ``flywheel run`` when it starts the stack) runs its nats-server with these
users: their passwords are made once and kept in ``<data_dir>/nats-users.json`` (readable by
its owner alone), each service it starts logs in as its own user (``nats_user``,
``nats_password``), the trainers an orchestrator starts as ``trainer`` (the orchestrator hands
them that login, ``nats_trainer_password``, never its own), and only the stack itself (which
makes the streams) and the command line run with the same ``data_dir`` (``flywheel status``,
``runs``, ``tasks publish``, ``run``) as ``operator``. On one machine the services run as one
OS user, who can read that file: there the users keep a service's mistakes off other
services' subjects. The compose deployment gives each container its own password alone: its
nats container writes :func:`server_config` at start from the ``NATS_<USER>_PASSWORD``
variables of its environment (``python -m flywheel.contract.natsusers FILE``), each a quoted
literal. Not the server's own ``$VARIABLE`` references: nats-server reads such a variable's
value as a config value, so a password such as ``12-ab`` is taken for a date and refused, and
``5Kb`` becomes a number.

The shape, one NATS account a user:

- ``operator`` is in account ``FLYWHEEL`` (:data:`ACCOUNT`), which holds JetStream: every
  stream, KV bucket and the weights object store. Only it creates, updates, purges or deletes
  them (:meth:`flywheel.contract.bus.Bus.ensure`); a service finds them made, or stops saying
  which one is missing.
- Every other user is alone in an account of its own, which reaches ``FLYWHEEL`` only through
  imports of the exact subjects in :data:`GRANTS`: the events it publishes, the KV keys it
  writes, and the JetStream API requests of the streams, consumers and buckets it uses
  (``$JS.API.CONSUMER.MSG.NEXT.<stream>.<durable>``, not ``$JS.API.>``). Its user permissions
  allow the same subjects, so what else it publishes is refused at once, naming the subject.
- Why accounts: nats-server sends the answer of a request (a JetStream API reply, a publish's
  ack) to whatever reply subject the request names, checked against no permission of the
  requester (``nc.publish("$JS.API.INFO", b"", reply="$KV.flywheel-runs.RUN")`` stores the
  server's JSON as that run's state, whatever the user's publish and subscribe permissions).
  Here such an answer is published in the requester's own account, where no stream is, and
  goes no further (measured: not even on a subject that user may publish to ``FLYWHEEL``).
- Messages a JetStream consumer pushes (the watches of a KV bucket, of WEIGHTS, a live trace)
  go to the user's own inbox prefix (:func:`inbox_prefix`, ``_INBOX_<user>``), which ``FLYWHEEL``
  exports to that account alone: no service sees another's deliveries or replies. A client of
  another language logging in as a service's user sets that inbox prefix too.
- The sandbox service answers ``sandbox.>`` from its account, exported to the accounts that
  call it (:data:`SANDBOX_CALLERS`); its replies go back through the import
  (``allow_responses``), never onto a subject of the caller's choosing in ``FLYWHEEL``.

Not closed by these permissions, because NATS matches whole subject tokens and a consumer's
name is one token: a user that creates consumers whose names are made at run time (a run's
trainer ``trainer-<run>-rollouts``, a scorer ``scorer-<name>-p<k>``, inference's teacher
``teacher-<run>-<name>`` and run's task consumer ``inference-<run>``) may create, pull from and
acknowledge any consumer of those streams (inference also delete one of TASKS) but the ones
with fixed names, which are denied to it (:func:`denied`); and the
request that makes an ordered consumer (``$JS.API.CONSUMER.CREATE.<stream>``, which every
watch needs) names its consumer in the body, where a name of an existing consumer updates that
one. ``tests/security/test_nats_permissions.py`` prints what each user may do.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

USERS_FILE = "nats-users.json"
OPERATOR = "operator"  # the stack's provisioning and the command line: no restriction
TRAINER = "trainer"  # a run's trainer, started by an orchestrator with this login
ACCOUNT = "FLYWHEEL"  # the account of JetStream (every stream and bucket) and the operator
STREAMS = ("TASKS", "ROLLOUTS", "TRACES", "SCORES", "SIGNALS", "WEIGHTS", "USAGE", "DEAD")  # as flywheel.contract.bus
RUNS, SERVICES, KEYS = "flywheel-runs", "flywheel-services", "flywheel-keys"
ADMISSION = "flywheel-admission"  # each run's issued rollouts, shared by the inference replicas
PARTITIONS = "flywheel-partitions"  # which scorer replica consumes which rollout partition
WEIGHTS = "flywheel-weights"  # the object store of every run's weight versions
SANDBOX_SUBJECTS = "sandbox.>"  # the sandbox service's requests (flywheel.sdk.sandbox)
API = "$JS.API"


def reads(stream: str) -> tuple[str, ...]:
    """Read a stream: its info (subjects, counts) and a stored message by sequence or subject."""
    return f"{API}.STREAM.INFO.{stream}", f"{API}.STREAM.MSG.GET.{stream}"


def watches(stream: str) -> tuple[str, ...]:
    """Ordered consumers on a stream (a watch, a replay): made, asked about, flow-controlled."""
    return f"{API}.CONSUMER.CREATE.{stream}", f"{API}.CONSUMER.INFO.{stream}.*", f"$JS.FC.{stream}.>"


def consumes(stream: str, durable: str) -> tuple[str, ...]:
    """A durable pull consumer (``*``: any name, for names made at run time): made, pulled, acked,
    and its messages dead-lettered."""
    return (f"{API}.STREAM.INFO.{stream}", f"{API}.CONSUMER.INFO.{stream}.{durable}",
            f"{API}.CONSUMER.DURABLE.CREATE.{stream}.{durable}", f"{API}.CONSUMER.MSG.NEXT.{stream}.{durable}",
            f"$JS.ACK.{stream}.{durable}.>", f"dead.{stream}")


def publishes(stream: str, subject: str) -> tuple[str, ...]:
    """Events published on ``subject`` of ``stream`` (its info: the stream is checked to exist)."""
    return f"{API}.STREAM.INFO.{stream}", subject


def kv(bucket: str, *, writes: str | None = None, watch: bool = False) -> tuple[str, ...]:
    """A KV bucket: read (keys, values), keys matching ``writes`` written, watched."""
    return (*reads(f"KV_{bucket}"), *((f"$KV.{bucket}.{writes}",) if writes else ()),
            *(watches(f"KV_{bucket}") if watch else ()))


def objects(bucket: str, *, write: bool = False) -> tuple[str, ...]:
    """An object store: objects read (and listed); ``write``: put, and purged (old versions)."""
    stream = f"OBJ_{bucket}"
    return (*reads(stream), f"{API}.DIRECT.GET.{stream}", f"{API}.DIRECT.GET.{stream}.>", *watches(stream),
            f"{API}.STREAM.NAMES", *((f"$O.{bucket}.>", f"{API}.STREAM.PURGE.{stream}") if write else ()))


def beats(service: str) -> tuple[str, ...]:
    """Its heartbeat in the services bucket (``*``: under any service name), and reading others'."""
    return kv(SERVICES, writes=f"{service}.*")


# What each user may do, subject by subject (each a service import from ACCOUNT).
GRANTS: dict[str, tuple[str, ...]] = {
    # Owns runs: their state, task supply, the evals it runs (rollouts, scores), the weight
    # versions kept for them (purged at a run's end).
    "orchestrator": (*beats("orchestrator"), *kv(RUNS, writes=">", watch=True), *publishes("TASKS", "tasks.>"),
                     *publishes("ROLLOUTS", "rollouts.>"), *publishes("SCORES", "scores.>"), *reads("WEIGHTS"),
                     *watches("WEIGHTS"), "dead.WEIGHTS", *objects(WEIGHTS), f"{API}.STREAM.PURGE.OBJ_{WEIGHTS}",
                     f"{API}.CONSUMER.INFO.TASKS.*"),  # whether a run's tasks wait or are being rolled out
    # A run's trainer: its consumers, weights (events and blobs), usage, its run's state.
    "trainer": (*beats("trainer"), *kv(RUNS, writes=">"), *consumes("ROLLOUTS", "*"), *consumes("SCORES", "*"),
                *consumes("SIGNALS", "*"), *reads("WEIGHTS"), *publishes("WEIGHTS", "weights.>"),
                *objects(WEIGHTS, write=True), *publishes("USAGE", "usage.>")),
    # The HTTP API: published tasks, runs' stop/pause/resume, API keys, traces and live views,
    # the consumers' lag on a run's page.
    "gateway": (*beats("gateway"), *kv(RUNS, writes=">"), *kv(KEYS, writes=">"), *publishes("TASKS", "tasks.>"),
                *reads("TRACES"), *watches("TRACES"), *reads("ROLLOUTS"), *watches("ROLLOUTS"),
                *(f"{API}.CONSUMER.LIST.{s}" for s in ("TASKS", "ROLLOUTS", "SCORES", "SIGNALS"))),
    # Reads every stream into the trace store (a dead letter's own is never dead-lettered), and the runs.
    "recorder": (*beats("recorder"), *kv(RUNS, watch=True),
                 *(g for s in STREAMS for g in consumes(s, f"recorder-{s.lower()}") if g != "dead.DEAD")),
    # Its screen of every task (durable inference) and each run's (inference-<run>, deleted once a
    # finished run's tasks are done), the teachers' consumers of rollouts.
    "inference": (*beats("inference"), *kv(RUNS, watch=True), *kv(ADMISSION, writes=">"),
                  *consumes("TASKS", "*"), f"{API}.CONSUMER.DELETE.TASKS.*", *consumes("ROLLOUTS", "*"),
                  *publishes("ROLLOUTS", "rollouts.>"), *reads("ROLLOUTS"), *watches("ROLLOUTS"),
                  *publishes("TRACES", "traces.>"), *publishes("SIGNALS", "signals.>"),
                  *publishes("USAGE", "usage.>"), *reads("WEIGHTS"), *watches("WEIGHTS"), "dead.WEIGHTS",
                  *objects(WEIGHTS)),
    # Custom scorers too (``flywheel scorer``: their heartbeats and consumers under their names).
    "scorer": (*beats("*"), *kv(RUNS), *kv(PARTITIONS, writes=">", watch=True), *consumes("ROLLOUTS", "*"),
               *publishes("SCORES", "scores.>")),
    "sandbox": (*beats("sandbox"), *publishes("USAGE", "usage.>")),
    # The Tinker-compatible training API: tenants' keys (read), its requests' usage.
    "training_api": (*beats("training_api"), *kv(KEYS), *publishes("USAGE", "usage.>")),
}
SANDBOX = "sandbox"  # the user that serves SANDBOX_SUBJECTS
SANDBOX_CALLERS = (OPERATOR, "orchestrator", "inference", "scorer")  # who sends it requests
SERVICE_USERS = tuple(GRANTS)
USERS = (OPERATOR, *SERVICE_USERS)
PULL_RESPONSE_S = 60  # how long a pull request's messages may keep coming back through its import


def _covers(pattern: str, subject: str) -> bool:
    """Whether NATS subject ``pattern`` (wildcards ``*``, ``>``) matches every subject ``subject`` does."""
    ps, ss = pattern.split("."), subject.split(".")
    for i, p in enumerate(ps):
        if p == ">":
            return len(ss) > i
        if i >= len(ss) or (p != "*" and p != ss[i]) or (p == "*" and ss[i] == ">"):
            return False
    return len(ps) == len(ss)


def _minimal(subjects: Iterable[str]) -> list[str]:
    """``subjects`` without repeats and without those another of them covers: overlapping imports
    would each carry a message, so a request (a pull, a publish) would arrive twice."""
    unique = list(dict.fromkeys(subjects))
    return [s for s in unique if not any(o != s and _covers(o, s) for o in unique)]


def allowed(user: str) -> list[str]:
    """What ``user`` may publish: its grants, plus the sandbox's requests for its callers. Every
    one has ``$JS.API.INFO`` (JetStream's account info) from :data:`ACCOUNT`: nats-server gives an
    account without JetStream an import of ``$JS.API.>`` of its own (answering "JetStream not
    enabled"), which would take every API request beside the import from ``ACCOUNT``, unless an
    import of that subject shadows it."""
    return _minimal([f"{API}.INFO", *GRANTS.get(user, ()), *((SANDBOX_SUBJECTS,) if user in SANDBOX_CALLERS else ())])


def denied(user: str) -> list[str]:
    """The consumers with fixed names of other users on the streams where ``user`` may use any
    consumer name (create, pull, ack, delete): refused to it."""
    mine = set(GRANTS[user])
    create, delete = f"{API}.CONSUMER.DURABLE.CREATE.", f"{API}.CONSUMER.DELETE."
    fixed = sorted({(g.split(".")[-2], g.split(".")[-1]) for owner, grants in GRANTS.items() if owner != user
                    for g in grants if g.startswith(create) and not g.endswith(".*")})
    return [subject for stream, durable in fixed if f"{create}{stream}.*" in mine
            for subject in (f"{create}{stream}.{durable}", f"{API}.CONSUMER.MSG.NEXT.{stream}.{durable}",
                            f"$JS.ACK.{stream}.{durable}.>",
                            *((f"{delete}{stream}.{durable}",) if f"{delete}{stream}.*" in mine else ()))]


def account_of(user: str) -> str:
    return ACCOUNT if user == OPERATOR else user.upper()


def inbox_prefix(user: str | None) -> str:
    """The inbox prefix of ``user``'s connections: ``_INBOX_<user>`` for a service's user (the
    server delivers to it alone), nats' own ``_INBOX`` for the operator and no user."""
    return f"_INBOX_{user}" if user in SERVICE_USERS else "_INBOX"


def password_variable(user: str) -> str:
    """The environment variable of ``user``'s password in the compose deployment."""
    return f"NATS_{user.upper()}_PASSWORD"


def server_config(passwords: Mapping[str, str]) -> str:
    """nats-server's ``accounts`` (JSON, which its config reads): every user of :data:`USERS` with
    its password (a quoted string: what nats-server reads as the string it is, whatever its
    characters), the operator in :data:`ACCOUNT` with JetStream, each service's user in an
    account of its own importing its :func:`allowed` subjects from there (see the module's
    docstring)."""
    exports: dict[str, list[str]] = {}  # subject -> the accounts it is exported to
    accounts: dict[str, dict[str, Any]] = {ACCOUNT: {
        "jetstream": "enabled", "users": [{"user": OPERATOR, "password": passwords[OPERATOR]}], "exports": [],
        "imports": [{"service": {"account": account_of(SANDBOX), "subject": SANDBOX_SUBJECTS}}]}}
    for user in SERVICE_USERS:
        subjects, inbox = allowed(user), f"{inbox_prefix(user)}.>"
        subscribe = [inbox, *((SANDBOX_SUBJECTS,) if user == SANDBOX else ())]
        permissions: dict[str, Any] = {"publish": {"allow": subjects, "deny": denied(user)},
                                       "subscribe": {"allow": subscribe}}
        imports = [{"service": {"account": account_of(SANDBOX) if s == SANDBOX_SUBJECTS else ACCOUNT, "subject": s}}
                   for s in subjects]
        account: dict[str, Any] = {"users": [{"user": user, "password": passwords[user], "permissions": permissions}],
                                   "imports": [*imports, {"stream": {"account": ACCOUNT, "subject": inbox}}]}
        if user == SANDBOX:  # its answers go back through the caller's import, never elsewhere
            permissions["allow_responses"] = True
            account["exports"] = [{"service": SANDBOX_SUBJECTS, "accounts": [account_of(u) for u in SANDBOX_CALLERS]}]
        for s in subjects:
            if s != SANDBOX_SUBJECTS:
                exports.setdefault(s, []).append(account_of(user))
        accounts[account_of(user)] = account
    for s, importers in exports.items():
        export: dict[str, Any] = {"service": s, "accounts": importers}
        if s.startswith(f"{API}.CONSUMER.MSG.NEXT."):  # a pull's messages: many answers to one request
            export |= {"response_type": "stream", "response_threshold": f"{PULL_RESPONSE_S}s"}
        accounts[ACCOUNT]["exports"].append(export)
    accounts[ACCOUNT]["exports"] += [{"stream": f"{inbox_prefix(u)}.>", "accounts": [account_of(u)]}
                                     for u in SERVICE_USERS]
    return "accounts: " + json.dumps(accounts, indent=1)


def read(data_dir: str | Path) -> dict[str, str] | None:
    """The passwords ``flywheel up`` made for ``data_dir`` (None when it made none there); those of
    users it did not know then are missing (:func:`load_or_create` adds them)."""
    path = Path(data_dir) / USERS_FILE
    try:
        passwords = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} does not read as the NATS users' passwords ({exc}); delete it and restart "
                         "`flywheel up`, which makes new ones") from exc
    if not isinstance(passwords, dict) or not isinstance(passwords.get(OPERATOR), str):
        raise ValueError(f"{path} has no password for NATS user {OPERATOR}; delete it and restart "
                         "`flywheel up`, which makes new ones")
    return {user: password for user, password in passwords.items() if user in USERS and isinstance(password, str)}


def load_or_create(data_dir: str | Path) -> dict[str, str]:
    """The passwords of ``data_dir``'s stack, made now (random, file mode 0600) the first time, and
    for a user added since."""
    found = read(data_dir) or {}
    if all(user in found for user in USERS):
        return found
    path = Path(data_dir) / USERS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    passwords = found | {user: secrets.token_urlsafe(24) for user in USERS if user not in found}
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(passwords, f, indent=2)
    os.replace(tmp, path)
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


def adopt_store(store_dir: str | Path) -> bool:
    """Move the streams of a single nats-server's store made before these accounts (JetStream
    kept them in the global account, ``$G``) into :data:`ACCOUNT`'s, once, with the server
    stopped: runs, API keys and weights stay. True when it moved them. (A cluster's nodes also
    record each stream's account in their shared metadata: theirs are not moved.)"""
    old, new = Path(store_dir) / "jetstream" / "$G", Path(store_dir) / "jetstream" / ACCOUNT
    if not old.is_dir() or new.exists():
        return False
    old.rename(new)
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m flywheel.contract.natsusers FILE [--store DIR]``: nats-server's users with the
    passwords of this environment, written to FILE (mode 0600), for a deployment's nats
    container; with ``--store``, first :func:`adopt_store` of the server's store folder DIR."""
    args = sys.argv[1:] if argv is None else argv
    store = None
    if len(args) == 3 and args[1] == "--store":
        args, store = args[:1], args[2]
    if len(args) != 1:
        print("usage: python -m flywheel.contract.natsusers FILE [--store DIR]", file=sys.stderr)
        return 2
    try:
        config = server_config(environment_passwords(os.environ))
    except ValueError as exc:
        print(f"nats users: {exc}", file=sys.stderr)
        return 1
    if store is not None and adopt_store(store):
        print(f"nats users: moved the streams of {store} into account {ACCOUNT}", file=sys.stderr)
    fd = os.open(args[0], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(config + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
