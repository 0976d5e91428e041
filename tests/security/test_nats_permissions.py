"""Least privilege on the bus, tried against a real nats-server running the stack's users
(:func:`flywheel.contract.natsusers.server_config`).

Each service's user tries every JetStream admin operation on every stream and bucket of the bus
(create, update, delete, purge, delete a message, snapshot; make a KV bucket or an object store;
create, update, pull from, pause and delete the other services' durable consumers, by each
request form), the key-minting chain (a subject transform into ``$KV.flywheel-keys.>`` by
STREAM.UPDATE, then a key record for tenant alice published through it), and reply-subject writes
(a request whose reply subject is a KV key, a stream's subject or the object store, among them the
overwrite of a run's state; the same through the sandbox service's answers; a consumer delivering
into a KV key). All are refused except :data:`ALLOWED`, which ``pytest -s`` prints; the operator,
who may, mints a key the same way, so the check would see one.

What :data:`ALLOWED` holds is what NATS cannot refuse by subject (see
:mod:`flywheel.contract.natsusers`): a user whose consumers' names are made at run time may
update and pull the other run-time-named consumers of that stream; a user that makes ordered
consumers on a stream (a watch) can name an existing consumer in the request's body; and the
trainer and the orchestrator purge old weight versions from the weights object store.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from nats.aio.client import Client as NATS
from nats.js.api import AckPolicy, ConsumerConfig

from flywheel.contract import events, natsusers
from flywheel.contract.bus import BUCKETS, STREAMS, WEIGHTS_BUCKET, Bus, stream_of
from flywheel.contract.keys import create_key, list_keys
from flywheel.contract.runs import register_run
from flywheel.runtime.natsserver import NatsServer
from tests.helpers import until

API = "$JS.API"
ALL_STREAMS = [*STREAMS, *(f"KV_{b}" for b in BUCKETS), f"OBJ_{WEIGHTS_BUCKET}"]
# The other services' durables on the bus, (stream, name) -> owner: fixed names and run-time ones.
DURABLES: dict[tuple[str, str], str] = {
    ("TASKS", "inference"): "inference",
    **{(s, f"recorder-{s.lower()}"): "recorder" for s in STREAMS},
    ("ROLLOUTS", "scorer-p0"): "scorer",
    ("ROLLOUTS", "trainer-r1-rollouts"): "trainer", ("SCORES", "trainer-r1-scores"): "trainer",
    ("SIGNALS", "trainer-r1-signals"): "trainer",
    ("ROLLOUTS", "teacher-r1-t"): "inference",  # a run's teacher, in the inference service
}
RUN_TIME_ROLLOUTS = ("scorer-p0", "trainer-r1-rollouts", "teacher-r1-t")


def _updates(stream: str, *names: str) -> set[str]:
    return {f"{op} {stream} {name}" for name in names for op in ("CONSUMER.DURABLE.CREATE", "CONSUMER.MSG.NEXT")}


def _named(stream: str, *names: str) -> set[str]:
    return {f"CONSUMER.CREATE {stream} (body names {name})" for name in names}


# Every admin operation a user may do of those tried (the rest are refused).
ALLOWED: dict[str, set[str]] = {
    "orchestrator": {"STREAM.PURGE OBJ_flywheel-weights", *_named("WEIGHTS", "recorder-weights")},
    "trainer": {"STREAM.PURGE OBJ_flywheel-weights", *_updates("ROLLOUTS", "scorer-p0", "teacher-r1-t")},
    "gateway": {*_named("TRACES", "recorder-traces"), *_named("ROLLOUTS", "recorder-rollouts", *RUN_TIME_ROLLOUTS)},
    "recorder": set(),
    "inference": {*_updates("ROLLOUTS", "scorer-p0", "trainer-r1-rollouts"),
                  *_named("ROLLOUTS", "recorder-rollouts", "scorer-p0", "trainer-r1-rollouts"),
                  *_named("WEIGHTS", "recorder-weights")},
    "scorer": _updates("ROLLOUTS", "trainer-r1-rollouts", "teacher-r1-t"),
    "sandbox": set(),
    "training_api": set(),
}
TIMEOUT_S = 2.0  # for a JetStream answer to a request the user may make


@dataclass
class Bus_:
    """The server, its users' passwords, and the operator's connection (which made the streams)."""

    server: NatsServer
    passwords: dict[str, str]
    operator: Bus

    async def login(self, user: str) -> NATS:
        return await nats.connect(self.server.url, user=user, password=self.passwords[user],
                                  inbox_prefix=natsusers.inbox_prefix(user), error_cb=_quiet)


async def _quiet(exc: Exception) -> None:
    """A refusal is what is tried here; nats-py reports each one to this callback."""


@pytest.fixture
async def bus_(tmp_path: Path) -> AsyncIterator[Bus_]:
    """The stack's users and streams, with a run, another tenant's key, every durable of
    :data:`DURABLES` and a message in each event stream."""
    passwords = natsusers.load_or_create(tmp_path)
    server = NatsServer(tmp_path / "nats", config=natsusers.server_config(passwords)).start()
    operator = await Bus.connect(natsusers.with_user(server.url, natsusers.OPERATOR, passwords["operator"]), "op")
    try:
        await register_run(operator, "RUN", tenant="bob")
        await create_key(operator, "bob", ["read"], "bob's")
        for stream, subject in (("TASKS", "tasks.r1.e"), ("ROLLOUTS", "rollouts.r1.e.0"), ("TRACES", "traces.r1.x"),
                                ("SCORES", "scores.r1.e.s"), ("SIGNALS", "signals.r1.e.t"), ("WEIGHTS", "weights.r1"),
                                ("USAGE", "usage.r1.x"), ("DEAD", "dead.TASKS")):
            await operator.publish_raw(subject, b"{}", {"Nats-Msg-Id": stream})
        for (stream, name), _ in DURABLES.items():
            await operator.js.add_consumer(stream, ConsumerConfig(durable_name=name, ack_policy=AckPolicy.EXPLICIT,
                                                                  filter_subject=_filter(stream)))
        yield Bus_(server, passwords, operator)
    finally:
        await operator.close()
        server.stop()


def _filter(stream: str) -> str:
    return {"ROLLOUTS": "rollouts.>", "DEAD": "dead.>"}.get(stream, f"{stream.lower()}.>")


async def _answered(nc: NATS, subject: str, body: bytes) -> bool:
    """Whether JetStream answers the request (it was let through; the answer may be an error, or a
    message a pull delivers): a refused request gets no answer (its publish is dropped), or a 503
    (no responder: no import)."""
    inbox = nc.new_inbox()
    answers = await nc.subscribe(inbox, max_msgs=1)
    await nc.publish(subject, body, reply=inbox)
    try:
        answer = await answers.next_msg(timeout=TIMEOUT_S)
    except nats.errors.TimeoutError:
        return False
    return (answer.headers or {}).get("Status") != "503"


async def _snapshot(op: Bus) -> dict[str, Any]:
    """What the admin operations would change: every stream's config and message count, every
    durable's config, the keys and the run's state."""
    streams = {}
    for name in ALL_STREAMS:
        info = await op.js.stream_info(name)
        streams[name] = (info.config.as_dict(), info.state.messages)
    durables = {key: (await op.js.consumer_info(*key)).config.as_dict() for key in DURABLES}
    return {"streams": streams, "names": sorted(info.config.name for info in await op.js.streams_info()),
            "durables": durables, "keys": sorted((k.id, k.tenant, tuple(k.scopes)) for k in await list_keys(op)),
            "run": (await (await op.runs_kv()).get("RUN")).value}


def _changes_consumer(label: str) -> bool:
    """Whether an operation, let through, changes a consumer's config (tried after the rest, which
    they would race: a pull from a consumer being changed may get no answer)."""
    return label.startswith(("CONSUMER.DURABLE.CREATE", "CONSUMER.CREATE"))


def _consumers_of(labels: set[str]) -> set[tuple[str, str]]:
    """The consumers (stream, name) the allowed operations ``labels`` may change."""
    found = set()
    for label in labels:
        words = label.split()
        if words[0] == "CONSUMER.DURABLE.CREATE":
            found.add((words[1], words[2]))
        elif "(body names" in label:
            found.add((words[1], words[-1].rstrip(")")))
    return found


def _mint_config(op_config: dict[str, Any]) -> dict[str, Any]:
    """The keys bucket's config with a subject transform from an inbox into its keys: what the
    key-minting chain adds by STREAM.UPDATE."""
    return {**op_config, "subjects": [*op_config["subjects"], "_INBOX.mint.*"],
            "subject_transform": {"src": "_INBOX.mint.*", "dest": "$KV.flywheel-keys.{{wildcard(1)}}"}}


def _alice() -> bytes:
    return events.encode(events.ApiKey(id="alice", tenant="alice", scopes=["read", "write", "admin"], sha256="0" * 64))


async def _admin_operations(b: Bus_, user: str) -> dict[str, tuple[str, bytes]]:
    """Every admin operation ``user`` tries, by label: (subject, body). Those that change a
    consumer come last (:func:`_changes_consumer`)."""
    ops: dict[str, tuple[str, bytes]] = {}
    for name in ALL_STREAMS:
        config = (await b.operator.js.stream_info(name)).config.as_dict()
        shrunk = json.dumps({**config, "max_msgs": 1}).encode()
        ops[f"STREAM.CREATE {name}"] = (f"{API}.STREAM.CREATE.{name}", shrunk)
        ops[f"STREAM.UPDATE {name}"] = (f"{API}.STREAM.UPDATE.{name}", shrunk)
        ops[f"STREAM.DELETE {name}"] = (f"{API}.STREAM.DELETE.{name}", b"")
        ops[f"STREAM.PURGE {name}"] = (f"{API}.STREAM.PURGE.{name}", b"")
        ops[f"STREAM.MSG.DELETE {name}"] = (f"{API}.STREAM.MSG.DELETE.{name}", b'{"seq": 1}')
        ops[f"STREAM.SNAPSHOT {name}"] = (f"{API}.STREAM.SNAPSHOT.{name}", b'{"deliver_subject": "_INBOX.snap"}')
        if name == "KV_flywheel-keys":
            ops["STREAM.UPDATE KV_flywheel-keys (key-minting transform)"] = (
                f"{API}.STREAM.UPDATE.{name}", json.dumps(_mint_config(config)).encode())
    new = (("EVIL", ["evil.>"]), ("KV_evil", ["$KV.evil.>"]), (f"OBJ_{WEIGHTS_BUCKET}-r2", ["$O.w2.>"]))
    for name, subjects in new:
        ops[f"STREAM.CREATE {name} (a new stream or bucket)"] = (
            f"{API}.STREAM.CREATE.{name}", json.dumps({"name": name, "subjects": subjects}).encode())
    for (stream, name), owner in DURABLES.items():
        if owner == user:  # its own: the other services' are tried
            continue
        hijack = {"durable_name": name, "ack_policy": "explicit", "filter_subject": f"{stream.lower()}.hijacked"}
        ops[f"CONSUMER.DELETE {stream} {name}"] = (f"{API}.CONSUMER.DELETE.{stream}.{name}", b"")
        body = json.dumps({"stream_name": stream, "config": hijack}).encode()
        ops[f"CONSUMER.DURABLE.CREATE {stream} {name}"] = (f"{API}.CONSUMER.DURABLE.CREATE.{stream}.{name}", body)
        ops[f"CONSUMER.CREATE {stream} {name} (by name and filter)"] = (
            f"{API}.CONSUMER.CREATE.{stream}.{name}.{stream.lower()}.hijacked", body)
        named = {"name": name, "ack_policy": "explicit", "filter_subject": f"{stream.lower()}.hijacked"}
        ops[f"CONSUMER.CREATE {stream} (body names {name})"] = (
            f"{API}.CONSUMER.CREATE.{stream}", json.dumps({"stream_name": stream, "config": named}).encode())
        ops[f"CONSUMER.MSG.NEXT {stream} {name}"] = (f"{API}.CONSUMER.MSG.NEXT.{stream}.{name}",
                                                      b'{"batch": 1, "no_wait": true}')
        ops[f"CONSUMER.PAUSE {stream} {name}"] = (f"{API}.CONSUMER.PAUSE.{stream}.{name}",
                                                   b'{"pause_until": "2999-01-01T00:00:00Z"}')
    return ops


@pytest.mark.parametrize("user", natsusers.SERVICE_USERS)
async def test_each_service_user_is_refused_every_admin_operation_but_its_allow_list(bus_: Bus_, user: str) -> None:
    ops = await _admin_operations(bus_, user)
    before = await _snapshot(bus_.operator)
    nc = await bus_.login(user)
    try:
        answered: dict[str, bool] = {}
        for last in (False, True):
            tried = [label for label in ops if _changes_consumer(label) == last]
            answers = await asyncio.gather(*(_answered(nc, *ops[label]) for label in tried))
            answered.update(zip(tried, answers, strict=True))
        # The key-minting chain's second step: a key record for tenant alice through the transform.
        await nc.publish("_INBOX.mint.alice", _alice())
        await nc.flush()
    finally:
        await nc.close()
    allowed = {label for label, ok in answered.items() if ok}
    others = sum(owner != user for owner in DURABLES.values())
    print(f"\n{user} may, of {len(ops)} admin operations on the bus's {len(ALL_STREAMS)} streams and buckets and "
          f"{others} consumers of other services (each refused but these):")
    for label in sorted(allowed) or ["(none)"]:
        print(f"    {label}")
    assert allowed == ALLOWED[user]
    after = await _snapshot(bus_.operator)
    assert after["names"] == before["names"] == sorted(ALL_STREAMS)  # none made, none deleted
    assert after["streams"] == before["streams"]  # none changed, purged or emptied
    assert after["keys"] == before["keys"]  # no key minted: bob's alone
    assert after["run"] == before["run"]
    changed = {key for key in DURABLES if after["durables"][key] != before["durables"][key]}
    assert changed <= _consumers_of(ALLOWED[user])


async def test_the_operator_mints_a_key_by_the_same_chain(bus_: Bus_) -> None:
    """The chain the users are refused works for who may update streams: the check would see it."""
    op = bus_.operator
    config = (await op.js.stream_info("KV_flywheel-keys")).config.as_dict()
    answer = await op.nc.request(f"{API}.STREAM.UPDATE.KV_flywheel-keys", json.dumps(_mint_config(config)).encode())
    assert "error" not in json.loads(answer.data), answer.data
    await op.nc.publish("_INBOX.mint.alice", _alice())
    await until(lambda: _has_alice(op), what="the key minted through the transform")


async def _has_alice(op: Bus) -> bool:
    return any(k.tenant == "alice" and "admin" in k.scopes for k in await list_keys(op))


# Where a reply-subject write would land, by what it would change: every KV bucket's key (the
# run's state among them), a subject of every stream, the object store's metadata.
REPLY_TARGETS = [*(f"$KV.{b}.reply" for b in BUCKETS), "$KV.flywheel-runs.RUN", "tasks.reply.x", "rollouts.reply.x.0",
                 "traces.reply.x", "scores.reply.x.s", "signals.reply.x.t", "weights.reply", "usage.reply.x",
                 "dead.REPLY", f"$O.{WEIGHTS_BUCKET}.M.cmVwbHk="]


def _requests(user: str) -> list[str]:
    """Requests ``user`` may make whose answer goes to the reply subject: JetStream's account
    info, a stream's info, and a publish of each kind of its events (answered with an ack)."""
    grants = natsusers.allowed(user)
    info = next(g for g in grants if g.startswith(f"{API}.STREAM.INFO."))
    published = [g.replace(">", "reply.x.y").replace("*", "reply") for g in grants
                 if g.split(".")[0] in {"tasks", "rollouts", "traces", "scores", "signals", "weights", "usage", "dead"}]
    return [f"{API}.INFO", info, *published]


@pytest.mark.parametrize("user", natsusers.SERVICE_USERS)
async def test_no_reply_subject_write_lands_in_a_kv_bucket_or_a_stream(bus_: Bus_, user: str) -> None:
    """``nc.publish("$JS.API.INFO", b"", reply="$KV.flywheel-runs.RUN")`` and its kind: the server
    answers each request on the reply subject it names, whatever the user may publish or read, so
    in one account this overwrote the run's state. Each of the user's requests, aimed at every
    target: nothing lands (the run's state is unchanged, no key, stream message or object
    appears); the operator's same write, made after, lands, so the check would see one."""
    op = bus_.operator
    before = await _snapshot(op)
    nc = await bus_.login(user)
    requests = _requests(user)
    try:
        for subject in requests:
            for target in REPLY_TARGETS:  # an event is stored once (its id), acked to each reply subject
                await nc.publish(subject, b"{}", reply=target, headers={"Nats-Msg-Id": subject})
        # A consumer made to deliver into a KV key, where the user may make one on a stream.
        for grant in natsusers.allowed(user):
            if grant.startswith(f"{API}.CONSUMER.CREATE.") and grant.count(".") == 4:
                stream = grant.split(".")[-1]
                config = {"deliver_subject": "$KV.flywheel-runs.delivered", "ack_policy": "none"}
                await nc.publish(grant, json.dumps({"stream_name": stream, "config": config}).encode())
        await nc.flush()
    finally:
        await nc.close()
    await op.nc.publish(f"{API}.INFO", b"", reply="$KV.flywheel-runs.control")
    await until(lambda: _has_key(op, "control"), what="the operator's reply-subject write")
    published = Counter(stream_of(s) for s in requests if not s.startswith("$"))  # its own events, once each
    expected = {s: n + published[s] for s, (_, n) in before["streams"].items() if s != "KV_flywheel-runs"}
    await until(lambda: _stored(op, expected), what="the user's own events stored")
    after = await _snapshot(op)
    print(f"\n{user}: {len(requests)} requests x {len(REPLY_TARGETS)} reply subjects in KV buckets, streams and the "
          "object store, and consumers delivering into a KV key: none landed")
    assert after["run"] == before["run"]
    assert after["keys"] == before["keys"]
    assert {s: n for s, (_, n) in after["streams"].items() if s != "KV_flywheel-runs"} == expected
    assert [k for k in await op.kv_keys("flywheel-runs") if k != "control"] == ["RUN"]


async def _stored(op: Bus, counts: dict[str, int]) -> bool:
    """Whether each stream of ``counts`` holds at least that many messages."""
    held = {s: (await op.js.stream_info(s)).state.messages for s in counts}
    return all(held[s] >= n for s, n in counts.items())


async def _has_key(op: Bus, key: str) -> bool:
    return key in await op.kv_keys("flywheel-runs")


@pytest.mark.parametrize("caller", [u for u in natsusers.SANDBOX_CALLERS if u != natsusers.OPERATOR])
async def test_the_sandbox_services_answer_goes_back_to_its_caller_never_into_a_bucket(bus_: Bus_,
                                                                                      caller: str) -> None:
    """The sandbox user may answer whatever reply subject a request names (allow_responses): its
    answer goes back through the caller's import, to the caller, and a reply subject in a KV
    bucket gets nothing."""
    sandbox = await bus_.login("sandbox")
    answered = asyncio.Event()

    async def answer(msg: Any) -> None:
        await msg.respond(b'{"kind": "answer"}')
        answered.set()

    await sandbox.subscribe("sandbox.>", cb=answer)
    await sandbox.flush()
    nc = await bus_.login(caller)
    try:
        assert (await nc.request("sandbox.create", b"{}", timeout=TIMEOUT_S)).data == b'{"kind": "answer"}'
        answered.clear()
        await nc.publish("sandbox.create", b"{}", reply="$KV.flywheel-runs.RUN")
        await nc.flush()
        await asyncio.wait_for(answered.wait(), TIMEOUT_S)  # the service answered it
        await sandbox.flush()
    finally:
        await nc.close()
        await sandbox.close()
    await bus_.operator.nc.publish(f"{API}.INFO", b"", reply="$KV.flywheel-runs.control")
    await until(lambda: _has_key(bus_.operator, "control"), what="the operator's reply-subject write")
    state = events.Decoder(events.RunState).decode((await (await bus_.operator.runs_kv()).get("RUN")).value or b"")
    assert state.id == "RUN" and state.tenant == "bob"


async def test_the_orchestrator_reads_a_runs_task_consumer(bus_: Bus_) -> None:
    """A run's owner asks whether its tasks wait or are being rolled out (its stall check): the
    info of inference's durable of the run's tasks, which its login may read, not change."""
    await bus_.operator.js.add_consumer("TASKS", durable_name="inference-r1", filter_subject="tasks.r1.>")
    nc = await bus_.login("orchestrator")
    try:
        info = await nc.jetstream().consumer_info("TASKS", "inference-r1", timeout=TIMEOUT_S)
        assert info.num_pending == 1  # the fixture's task of run r1
    finally:
        await nc.close()
