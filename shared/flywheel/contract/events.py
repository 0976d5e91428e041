"""The event contract: every message that crosses the bus, in one module.

Every service and every user program imports this module, so it imports nothing heavy
(msgspec and the standard library only; a unit test keeps it that way).

Each event is a frozen msgspec Struct tagged with a ``type`` field, so one decoder built
for the union :data:`AnyEvent` reads any of them. Each event names who sends it and who
reads it. ``Event.id`` is the event id: it travels as the ``Nats-Msg-Id`` header, so a
publish that is retried is stored once, and every consumer upserts by it.

Wire encoding
    JSON by default (readable with the ``nats`` CLI, writable from any language), or
    msgpack where volume matters. The ``Content-Type`` header says which:
    ``application/json`` (also assumed when the header is missing) or
    ``application/msgpack``. :func:`json_schema` exports a JSON Schema for every event.

Batches
    A message may carry several events of one subject, in order: its ``Flywheel-Batch``
    header (:data:`BATCH_HEADER`) gives how many, and its payload is an array of them, each
    encoded as it would be alone (:func:`encode_many`). Its ``Nats-Msg-Id`` is
    :func:`batch_msg_id` of its events, so the same events published again together are
    stored once. Inference sends a group's rollouts as one, a scorer the scores of such a
    message's rollouts: each event crosses the bus, and each reader's loop, once per batch
    instead of once per event. Every reader takes both forms
    (:func:`flywheel.contract.bus.decode_events`).

Schema evolution (tested against stored encodings of version 1 in tests/unit/data)
    1. A new field always has a default and is added after the existing ones.
    2. A field's type never changes, and a field is never renamed or removed; deprecate it
       instead and stop reading it.
    3. Decoders ignore fields they do not know, so an old reader accepts a new event.
    4. Tag values (``type``) and subject layouts never change; a new kind of event gets a
       new tag.
    5. :data:`SCHEMA_VERSION` goes up when fields are added; it is informational (the
       title of the exported JSON Schema), never used to reject a message.
    6. A ``Literal`` field gains a value only with a :data:`SCHEMA_VERSION` bump, and only
       in state every reader ships with (``RunState.status``): a reader older than the
       bump refuses the new value. Event fields never gain values.

    Version 2 added ``Rollout.group_size`` and ``WeightUpdate.metrics``; version 3 added
    ``Rollout.state``; version 4 added ``DeadLetter.stream_seq`` and
    ``DeadLetter.payload_size_bytes`` (a dead letter carries a capped excerpt), the run's
    lease and end (``RunState.owner``, ``lease_expires_at``, ``ended_at``, ``reason``,
    ``num_tasks_published``), the status ``stopped``, and the run's reward definition
    (``RunState.scorers``); version 5 added ``WeightUpdate.num_dropped_total``, the
    trainer's count of dropped rollouts that inference's admission and the run's task
    supply act on (before it, the trainer sent it as ``metrics["num_dropped_total"]``, which
    no reader reads any more: ``metrics`` is for people); version 6 added
    ``Rollout.sampling``, the settings a rollout was sampled with, which the trainer
    recomputes logprobs at (None on older rollouts: their readers take the run's); version 7
    added the run owner's notes (``RunState.notes``, ``num_notes``); version 8 added the
    reward of each environment of a run with several (``RunState.env_scorers``), the weight
    versions kept for its evals (``RunState.pinned_versions``) and the status ``paused``;
    version 10 added :class:`Signal` (a teacher's logprobs of a rollout's tokens) on the
    SIGNALS stream; version 11 added ``Signal.top_ids`` and ``Signal.top_logprobs`` (a
    teacher's likeliest tokens at each sampled position); version 12 added metering: a
    rollout's model calls and tokens (``Rollout.usage``) and :class:`Usage` on the USAGE stream;
    version 13 added ``DeadLetter.batch_index``, the place of a dead-lettered event in its batch;
    version 14 added ``TokenSpan.texts``, each token's text (for people reading a trace);
    version 15 added ``RunState.evals``, the figures of each eval a run's owner ran during training;
    version 16 added ``WeightUpdate.num_unused_total`` (the dropped rollouts that admission and
    the task supply give back: those of groups that trained nothing; before it they read
    ``num_dropped_total``, which counts a dropped member of a group that trained too) and
    ``RunState.errors``, a run's dropped rollouts grouped by error.

Identities
    ``run`` (a training or eval run, owned by a ``tenant``), ``task`` (one row of a task
    set), ``group`` (the rollouts of one task that are compared with each other),
    ``rollout``, ``node`` (one message of the trace graph) and ``policy_version`` (the
    trainer step whose weights produced a token). Each kind of id is made one way, here,
    by every producer: :func:`task_id` (the client, the gateway, ``flywheel run`` and
    ``flywheel eval``: the same row at the same place of the same run is the same task, so
    publishing it again stores nothing new), :func:`rollout_id` (inference and eval: a
    redelivered task publishes the same rollouts), :func:`node_id` (a content hash).

Sampling
    :class:`Sampling` is the one sampling shape: the run config's ``[sampling]``, a task's
    own sampling (the gateway's ``POST /v1/tasks``, the client), the inference API's
    request fields and what each rollout records are all this, with the defaults written
    here and the bounds of :data:`SAMPLING_BOUNDS`, which :meth:`Sampling.check` applies and
    the HTTP and config models state in their schemas. The bounds are the strictest any
    backend needs, so settings accepted anywhere are settings every backend samples.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Generic, Literal, TypeVar, overload

import msgspec

SCHEMA_VERSION = 16

JSON = "application/json"
MSGPACK = "application/msgpack"


T = TypeVar("T")
E = TypeVar("E", bound="Event")


def new_id() -> str:
    """A fresh random id: 32 hex digits (128 random bits, the shape of a uuid4's hex). From the
    random module, which reseeds in a forked child, not from os.urandom: an id is made per
    event, and a system call per id showed in inference's profile. Not a secret: keys and
    tokens come from :mod:`secrets`."""
    return f"{random.getrandbits(128):032x}"


def utc_now() -> datetime:
    return datetime.now(UTC)


class _Struct(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Value types nested inside events."""


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Fields every event carries. ``id`` is the event id (``Nats-Msg-Id``)."""

    id: str = msgspec.field(default_factory=new_id)
    created_at: datetime = msgspec.field(default_factory=utc_now)

    @property
    def msg_id(self) -> str:
        """The deduplication key sent as ``Nats-Msg-Id``."""
        return self.id

    def subject(self) -> str:
        raise NotImplementedError


# --- value types --------------------------------------------------------------------------


INT32_MAX = 2**31 - 1
# vLLM samples a lower temperature greedily (its _SAMPLING_EPS), and a greedy token has no
# sampled logprob to train against: no backend samples below it.
MIN_TEMPERATURE = 1e-5

# The bounds of each sampling setting, in pydantic's terms (``gt``, ``ge``, ``le``) so that the
# config and HTTP models state them as they are; :meth:`Sampling.check` applies them. Floats
# are finite and stop strings are not empty, besides.
SAMPLING_BOUNDS: dict[str, dict[str, float]] = {
    "temperature": {"ge": MIN_TEMPERATURE},
    "top_p": {"gt": 0, "le": 1},
    "max_tokens": {"ge": 1, "le": INT32_MAX},
    "seed": {"ge": 0, "le": INT32_MAX},
}
SAMPLING_DESCRIPTIONS: dict[str, str] = {
    "temperature": "softmax temperature (lower than the bound is greedy, which gives nothing to train on); the "
                   "trainer recomputes logprobs at the temperature each rollout was sampled with",
    "top_p": "nucleus sampling: the smallest set of tokens with this probability mass (1: all)",
    "max_tokens": "most tokens sampled per completion",
    "stop": "strings that end a completion (kept in its tokens, cut from its text); none empty",
    "seed": "a rollout's seed is this plus its index in its group; unset: fresh entropy",
}
_HOLDS = {"gt": lambda v, b: v > b, "ge": lambda v, b: v >= b, "le": lambda v, b: v <= b}
_SIGN = {"gt": ">", "ge": ">=", "le": "<="}


class Sampling(_Struct, frozen=True, kw_only=True):
    """How completions are sampled: the one sampling shape (see the module's docstring).

    The defaults here are every reader's (the wire omits a field at its default). Nothing
    checks the bounds when an event is decoded (a field's type never changes): whoever takes
    settings in calls :meth:`check`, and every backend does before it samples.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: list[str] = []
    seed: int | None = None

    def check(self) -> None:
        """Refuse settings outside :data:`SAMPLING_BOUNDS`, with a ValueError naming the field."""
        for name, bounds in SAMPLING_BOUNDS.items():
            value = getattr(self, name)
            if value is None:  # the seed, unset
                continue
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"sampling.{name} must be a finite number, got {value}")
            for op, bound in bounds.items():
                if not _HOLDS[op](value, bound):
                    raise ValueError(f"sampling.{name} must be {_SIGN[op]} {bound}, got {value}"
                                     + (" (lower is greedy: no backend samples it)" if name == "temperature" else ""))
        if any(not s for s in self.stop):
            raise ValueError("sampling.stop: an empty stop string would end every completion at once")

    def with_seed_offset(self, offset: int) -> Sampling:
        """These settings with the seed moved on by ``offset`` (a rollout's index, a call's
        number), kept within the seed's bounds; unchanged without a seed."""
        if self.seed is None:
            return self
        return msgspec.structs.replace(self, seed=(self.seed + offset) % (INT32_MAX + 1))


class ToolCall(_Struct, frozen=True, kw_only=True):
    id: str
    name: str
    arguments: str = "{}"  # JSON text, as in the OpenAI API


class Message(_Struct, frozen=True, kw_only=True):
    """The message layer of a trace node (OpenAI chat shape)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[ToolCall] = []
    tool_call_id: str | None = None
    name: str | None = None


class TokenSpan(_Struct, frozen=True, kw_only=True):
    """The token layer of a trace node: the tokens this node adds to its branch.

    ``logprobs`` and ``loss_mask`` are aligned with ``token_ids``. Tokens the model did
    not sample (prompt, tool output) have logprob 0.0 and loss mask False.
    ``policy_version`` is the weights version that sampled them (None when none did).
    ``texts``, aligned too, is each token's text as the policy's tokenizer decodes it alone
    (a character split across tokens shows as U+FFFD in each), so a trace reads without the
    tokenizer; empty where the producer had none. It is for people: nothing trains on it, and
    it is no part of a node's id.
    """

    token_ids: list[int]
    logprobs: list[float] = []
    loss_mask: list[bool] = []
    policy_version: int | None = None
    texts: list[str] = []


class Node(_Struct, frozen=True, kw_only=True):
    """One node of a rollout's trace graph: a message plus the tokens it adds.

    ``id`` is a content hash (see :func:`node_id`), so the same message after the same
    parent is one node, wherever it is seen. ``parent_id`` is None for a root.
    """

    id: str
    parent_id: str | None = None
    message: Message
    tokens: TokenSpan | None = None


def node_id(parent_id: str | None, message: Message, tokens: TokenSpan | None = None) -> str:
    """Content hash of a node: its parent, its message and its tokens."""
    h = hashlib.sha256()
    h.update((parent_id or "").encode())
    h.update(b"\x00")
    h.update(msgspec.json.encode(message))
    h.update(b"\x00")
    if tokens is not None:  # without its texts: they follow from the ids, and a producer may have none
        h.update(msgspec.json.encode(msgspec.structs.replace(tokens, texts=[]) if tokens.texts else tokens))
    return h.hexdigest()[:32]


# The namespace of derived task ids: changing it would change every task id made so far.
TASK_ID_NAMESPACE = uuid.UUID("5b0f6a1e-2c4d-4e4f-9a53-6c1d7f0e8b21")


def task_id(run: str, env: str, position: int, row: dict[str, Any]) -> str:
    """The id of task ``row`` of ``run`` on ``env`` at ``position`` (from 1: a file's line, a
    request's index, a task set's place): the row's own string ``"id"``, else uuid5 over
    (run, env, position, the row as canonical JSON). So the same row at the same place is the
    same task, and publishing it again stores nothing new. ValueError for an own id that
    cannot be a header (blank, more than one line); TypeError for a row JSON cannot carry."""
    own = row.get("id")
    if isinstance(own, str):
        if not own.strip() or "\r" in own or "\n" in own:
            raise ValueError(f"id={own!r}: a task id must be non-empty and on one line (it is sent as a header)")
        return own
    canonical = json.dumps([run, env, position, row], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return uuid.uuid5(TASK_ID_NAMESPACE, canonical).hex


def rollout_id(run: str, task: str, index: int) -> str:
    """The id of rollout ``index`` of task ``task``'s group in ``run``: a hash, so a task rolled
    out again (redelivered, resumed) publishes the same ids, which the bus deduplicates; the
    run is in it because a task id a user chose may repeat across runs."""
    return hashlib.sha256(f"{run}\x00{task}\x00{index}".encode()).hexdigest()[:32]


class RolloutUsage(_Struct, frozen=True, kw_only=True):
    """What a rollout's model calls cost, counted by inference call by call: ``prompt_tokens``
    is each call's whole prompt (what the model was given, as an API bills it, however much of
    it a cache held), ``sampled_tokens`` what the calls sampled."""

    num_calls: int = 0
    prompt_tokens: int = 0
    sampled_tokens: int = 0


# --- events -------------------------------------------------------------------------------


class Task(Event, frozen=True, kw_only=True, tag="task"):
    """One row of a task set, to be rolled out ``num_rollouts`` times as one group.

    Sent by: gateway, CLI, user code. Read by: inference (one durable consumer shared by
    all replicas), recorder. Subject: ``tasks.<run>.<env>``.
    """

    run: str
    env: str
    data: dict[str, Any]
    num_rollouts: int = 1
    sampling: Sampling | None = None

    def subject(self) -> str:
        return f"tasks.{self.run}.{self.env}"


# A rollout's subject ends in its group's partition (rollouts.<run>.<env>.<partition>), so a
# consumer of some partitions sees whole groups: scorer replicas split the partitions between
# them, never a group. Fixed: publishers and consumers must agree on it.
ROLLOUT_PARTITIONS = 8


def partition_of(group_id: str) -> int:
    """The partition (0 .. ROLLOUT_PARTITIONS - 1) of every rollout of group ``group_id``."""
    return int.from_bytes(hashlib.blake2b(group_id.encode(), digest_size=4).digest(), "big") % ROLLOUT_PARTITIONS


class Rollout(Event, frozen=True, kw_only=True, tag="rollout"):
    """A finished rollout with its whole trace graph (message and token layers).

    Sent by: inference. Read by: every scorer (one durable each), trainer, recorder.
    Subject: ``rollouts.<run>.<env>.<partition>``, the partition :func:`partition_of` its
    ``group_id`` (so every member of a group shares it). ``id`` is the rollout id. ``policy_version`` is
    the version when the rollout started; each node's tokens carry their own.
    ``nodes`` holds every node of the graph, parents before children; the last one ends the
    final branch (the one rewards read). A single-turn rollout is one chain; retries,
    sub-agents and re-rendered histories are further branches (``metrics["num_rerenders"]``
    counts the last kind).
    """

    run: str
    env: str
    task_id: str
    group_id: str
    index: int = 0  # position within the group
    policy_version: int = 0
    task_data: dict[str, Any] = {}
    nodes: list[Node] = []
    status: Literal["completed", "truncated", "error"] = "completed"
    error: str | None = None
    metrics: dict[str, float] = {}
    group_size: int = 1  # rollouts in this rollout's group (the task's num_rollouts)
    state: dict[str, Any] = {}  # what the harness recorded (a game's board, a database); rewards read it
    # What it was sampled with (the task's or the run's settings, its own seed); None where
    # not known (older rollouts, `flywheel eval`'s endpoint), and readers take the run's.
    sampling: Sampling | None = None
    # Its model calls' tokens (metering). They travel with the rollout, so they count exactly
    # once with it whatever is redelivered or rolled out again; None on older rollouts.
    usage: RolloutUsage | None = None

    def subject(self) -> str:
        return f"rollouts.{self.run}.{self.env}.{partition_of(self.group_id)}"


class TraceNode(Event, frozen=True, kw_only=True, tag="trace_node"):
    """A trace node published live while its rollout is still running (once it has run for
    the inference setting ``live_trace_after_s``: a shorter rollout's nodes are in its
    :class:`Rollout` only).

    Sent by: inference, node by node. Read by: recorder, live viewers.
    Subject: ``traces.<run>.<rollout>``. The event id is ``<rollout>.<node>``: a node
    shared by several rollouts is one node in the graph but one event per rollout.
    """

    run: str
    rollout_id: str
    node: Node

    @property
    def msg_id(self) -> str:
        return f"{self.rollout_id}.{self.node.id}"

    def subject(self) -> str:
        return f"traces.{self.run}.{self.rollout_id}"


WATCH_SCORER = "watch"  # the scorer name of the reward-hacking watch's flags


class Score(Event, frozen=True, kw_only=True, tag="score"):
    """One scorer's verdict on one rollout.

    Sent by: scorers (built-in and custom). Read by: trainer, recorder.
    Subject: ``scores.<run>.<env>.<scorer>``. A rollout's reward is the weighted sum of
    the values of the run's scorers (``RunState.scorers``; a score of another scorer counts
    for nothing). ``error`` is set (and ``value`` is 0.0, not to be trusted) when the scorer
    failed on this rollout. A score of the scorer ``watch`` (:data:`WATCH_SCORER`, weight 0)
    flags the rollout as possibly gaming its reward: ``components`` names the detectors that
    fired, ``value`` is how many.
    """

    run: str
    env: str
    rollout_id: str
    group_id: str
    scorer: str
    value: float
    weight: float = 1.0
    components: dict[str, float] = {}
    error: str | None = None

    def subject(self) -> str:
        return f"scores.{self.run}.{self.env}.{self.scorer}"


class Signal(Event, frozen=True, kw_only=True, tag="signal"):
    """Per-token values for one rollout from one source: a teacher's logprobs of the tokens the
    policy sampled, each in exactly the context it was sampled in.

    Sent by: teachers (hosted by inference). Read by: trainer, which joins them with rollouts as
    it joins scores. Subject: ``signals.<run>.<env>.<source>``, where ``source`` is the
    teacher's name in the run config (``[teachers.<name>]``). ``values`` maps the id of each
    node of the rollout's trace graph that holds sampled tokens to one value per token of
    that node's span (aligned with its ``token_ids``; a token the policy did not sample has
    0.0). A node's context is the branch from its root, the same in every branch that shares
    it, so a node's values do not depend on the branch it is read in. ``temperature`` is the
    one the values were computed at (the rollout's sampling temperature), ``model`` what
    computed them (a model and, for the policy's own weights, ``@v<version>``). ``error`` is
    set (and ``values`` empty) when the source could not compute them for this rollout; readers
    then treat the rollout as unusable, as for a scorer's error. The event id is
    ``<rollout>.<source>``.

    ``top_ids`` and ``top_logprobs`` (when the run's training asks the source for its top-k
    tokens: a dense on-policy distillation term) map the same nodes to, for each token of the
    span, the source's ``k`` likeliest next tokens in that token's place and their logprobs
    (at ``temperature``), likeliest first; an empty list where the token has no value.
    """

    run: str
    env: str
    rollout_id: str
    group_id: str
    source: str
    values: dict[str, list[float]] = {}
    top_ids: dict[str, list[list[int]]] = {}
    top_logprobs: dict[str, list[list[float]]] = {}
    temperature: float = 1.0
    model: str = ""
    error: str | None = None

    def subject(self) -> str:
        return f"signals.{self.run}.{self.env}.{self.source}"


class WeightUpdate(Event, frozen=True, kw_only=True, tag="weight_update"):
    """New policy weights are available, with what the trainer tells the run.

    Sent by: trainer. Read by: every inference replica, the run's owner (its orchestrator),
    ``flywheel run``, recorder. Subject: ``weights.<run>``. ``uri`` points at the blob
    (``nats-os://<bucket>/<name>`` for the JetStream object store, or ``file://`` /
    ``s3://``); inference checks ``sha256`` before it swaps.

    Control signals are fields, which services act on: ``num_unused_total`` counts the
    rollouts of every group the trainer consumed without training any of it (each member
    dropped: stale, failed by a scorer, errored), never decreasing. A step takes whole groups
    that train something, so such a group is one the run must make again: inference's
    admission gives its allowance back and the run's owner publishes a task to replace it. A
    dropped member of a group that trained costs nothing more (its group counted in its
    step), so it is not given back: giving it back let sampling run ahead of the trainer, and
    the extra rollouts went stale. ``num_dropped_total`` counts every dropped rollout, for
    people. ``metrics`` holds the step's figures for people (loss, reward_mean, ...): no
    service acts on them.
    """

    run: str
    version: int
    uri: str
    sha256: str
    size_bytes: int
    format: Literal["full", "lora"] = "full"
    trainer_step: int = 0
    metrics: dict[str, float] = {}  # the training step's figures (loss, reward mean, ...), for people
    num_dropped_total: int = 0  # rollouts of the run dropped so far (stale, scorer error, rollout error)
    num_unused_total: int = 0  # rollouts of the groups consumed with nothing trained: what the run makes again

    def subject(self) -> str:
        return f"weights.{self.run}"


class Usage(Event, frozen=True, kw_only=True, tag="usage"):
    """What a run used that its rollouts do not carry (metering), counted where it happened.

    Sent by: the trainer (``source`` ``trainer``, one a step: ``trained_tokens`` are the
    tokens under the loss of the rollouts it trained, ``rollout_ids``; ``sft_tokens`` those
    of the reference answers its SFT term trained on; ``sft``, once, for the warm-up),
    inference's OpenAI API (``api``, one a request: the prompt once, every choice's tokens), and
    the sandbox service (``sandbox``, one a sandbox labelled with a run, a rollout's or one a
    reward made while scoring it, once it is destroyed: ``sandbox_s``, its seconds alive, and
    its ``rollout_id``), and the training API (``training_api``, one a request that did work:
    ``run`` is the API session, ``trained_tokens`` the tokens of a ``forward_backward``'s
    datums, ``prompt_tokens`` those of a ``forward`` or a sampling prompt, ``sampled_tokens``
    the samples'). A rollout's own tokens travel in :attr:`Rollout.usage`. Read by: the
    recorder, billing. Subject: ``usage.<run>.<source>``. The event id is the count's own (a
    trainer step's is ``<run>.trainer.<step>``, a sandbox's ``sandbox.<id>``), so a count made
    again after a crash counts once. ``tenant`` is who pays: the run's owner, or the caller of
    the API.
    """

    run: str
    source: Literal["trainer", "sft", "api", "sandbox", "training_api"]
    tenant: str = ""
    step: int | None = None
    prompt_tokens: int = 0
    sampled_tokens: int = 0
    trained_tokens: int = 0
    sft_tokens: int = 0
    rollout_ids: list[str] = []
    sandbox_s: float = 0.0
    rollout_id: str | None = None

    def subject(self) -> str:
        return f"usage.{self.run}.{self.source}"


class DeadLetter(Event, frozen=True, kw_only=True, tag="dead_letter"):
    """A message that could not be processed, with the reason.

    Sent by: the bus layer, after the last allowed delivery fails or at once when the
    payload does not decode. Read by: recorder, operators. Subject: ``dead.<stream>``.
    Bounded, so that it can always be published, whatever the original's size:
    ``payload`` is the original message body, or its first bytes when it is longer
    (``payload_size_bytes`` is the original's size); the whole message stays in its stream
    at ``stream_seq`` for the stream's retention. ``reason`` and ``headers`` are capped too.
    """

    stream: str
    original_subject: str
    consumer: str
    num_delivered: int
    reason: str
    payload: bytes = b""
    headers: dict[str, str] = {}
    stream_seq: int = 0  # the original's sequence in ``stream`` (0: not known)
    payload_size_bytes: int = 0  # the original body's size; above len(payload) when cut
    # The event's place in its batch (a message of several events): ``payload`` is then that
    # event alone, encoded as it would travel alone. None: the whole message.
    batch_index: int | None = None

    def subject(self) -> str:
        return f"dead.{self.stream}"


class EvalPoint(_Struct, frozen=True, kw_only=True):
    """One eval of a training run at one step (``RunState.evals``): its name (the ``[[evals]]``
    label), the step, the eval run that holds its rollouts, and its figures."""

    eval: str
    step: int
    run: str  # the eval run (kind eval), whose rollouts and scores the trace API has
    reward_mean: float | None = None
    reward_stderr: float | None = None
    num_rollouts: int = 0
    num_errors: int = 0


class ErrorGroup(_Struct, frozen=True, kw_only=True):
    """The rollouts of a run its trainer dropped for one error (``RunState.errors``): where it
    happened, the first one's text, how many, and the first one's rollout (its trace shows the
    error in place). Errors whose texts differ only in numbers and ids are one group."""

    source: str  # "rollout" (inference marked it failed), "scorer NAME", "teacher NAME"
    error: str
    count: int
    example: str  # a rollout id


class RunState(_Struct, frozen=True, kw_only=True):
    """A run's state, kept in the run-state KV bucket under the run id (not a stream event).

    Written by: gateway (on creation; a stop), ``flywheel run`` (registration with the config;
    a stop or resume), the orchestrator (its owner: lease, task supply, notes, failed),
    trainer (step, policy version, running, finished). Read by: everyone.

    The owner renews ``lease_expires_at`` while it lives; a run whose lease has expired has
    lost its owner (:func:`flywheel.contract.runs.end_of`) until another orchestrator claims
    it. ``ended_at`` and ``reason`` are set when the run finishes, fails or is stopped.
    ``notes`` are the owner's last words on the run for people (its trainer started or
    restarting, tasks published), newest last, at most ``MAX_NOTES``; ``num_notes`` counts
    every note so far, so a reader that polls says each one once.
    """

    id: str
    tenant: str = "default"
    kind: Literal["train", "eval"] = "train"
    # paused: its owner stopped the trainer (a checkpoint) and holds the run, its tasks kept,
    # until it is resumed (running) or stopped.
    status: Literal["created", "running", "paused", "finished", "failed", "stopped"] = "created"
    policy_version: int = 0
    trainer_step: int = 0
    config: dict[str, Any] = {}
    created_at: datetime = msgspec.field(default_factory=utc_now)
    updated_at: datetime = msgspec.field(default_factory=utc_now)
    owner: str | None = None  # who holds the lease: "flywheel-run pid 123 on host"
    lease_expires_at: datetime | None = None
    ended_at: datetime | None = None
    reason: str | None = None  # why it ended, when it did not simply finish
    num_tasks_published: int = 0  # tasks the owner's task supply published so far
    # The run's reward: the scorers whose weighted values make it, name -> weight (the run
    # config's `scorers`, else its environment's rewards; flywheel.sdk.scoring), written at
    # registration by whoever knows the environment. Empty: not known; readers then count
    # every score at its own weight.
    scorers: dict[str, float] = {}
    # A run with several environments: the reward of each (its name in subjects -> scorer ->
    # weight), which its rollouts are scored and trained on; `scorers` then holds every one of
    # their scorers (a reader that knows only it waits for scores a rollout never gets). A
    # rollout of an environment not named here takes `scorers`.
    env_scorers: dict[str, dict[str, float]] = {}
    # A run with several environments: each one's id in the run config (owner/name[@version], a
    # module, a path) by its name in subjects, so the trace store finds a rollout by the id a
    # user ran it with. A run with one environment has its id in `config` (`env`).
    env_ids: dict[str, str] = {}
    # Weight versions the trainer keeps in the weights bucket past weight_versions_kept: those
    # of the steps its evals run on (`[[evals]]`), pinned by the trainer when it publishes them,
    # let go by the run's owner once their evals are done.
    pinned_versions: list[int] = []
    notes: list[str] = []
    num_notes: int = 0
    # False: registered over HTTP (POST /v1/runs) with the config as its tenant gave it. The
    # orchestrator that claims it first loads its environments in its workers, pins its hub
    # environments, and writes the config as registered (with `scorers`, `env_scorers`,
    # `env_ids`); a config that does not load fails the run, saying why.
    prepared: bool = True
    # The evals its owner ran during training (`[[evals]]`), each at the step it evaluated, in
    # the order they ended; the run page draws them on the reward chart. At most MAX_EVAL_POINTS.
    evals: list[EvalPoint] = []
    # The rollouts its trainer dropped for an error (a failed rollout, a scorer's or a teacher's
    # error), grouped by error, most frequent first: written by the trainer as steps take them.
    # At most MAX_ERROR_GROUPS; further kinds count in their source's "other errors" group.
    errors: list[ErrorGroup] = []


MAX_NOTES = 20  # RunState.notes kept
MAX_ERROR_GROUPS = 16  # RunState.errors kept: a run's state is one KV value
MAX_ERROR_CHARS = 500  # an ErrorGroup's text, cut
MAX_EVAL_POINTS = 1000  # RunState.evals kept (the latest): a run's state is one KV value


class ServiceHeartbeat(_Struct, frozen=True, kw_only=True):
    """A running service instance, kept in the services KV bucket (expires unless renewed).

    Written by: every service process, every few seconds. Read by: ``flywheel status``,
    ``flywheel up`` (to wait for health), the gateway.
    """

    service: str
    instance: str
    pid: int
    host: str
    status: Literal["starting", "ok", "stopping"] = "ok"
    started_at: datetime
    updated_at: datetime = msgspec.field(default_factory=utc_now)
    info: dict[str, Any] = {}


class ApiKey(_Struct, frozen=True, kw_only=True):
    """A tenant's API key, kept in the keys KV bucket under its ``id`` (not a stream event). The
    secret itself is never stored: ``sha256`` is the hash of the whole key, which is shown once
    when it is made (:mod:`flywheel.contract.keys`).

    Written by: ``flywheel keys`` (create, revoke). Read by: the gateway and inference, on
    every request that carries a key.
    """

    id: str
    tenant: str
    scopes: list[Literal["read", "write", "admin"]]
    sha256: str
    name: str = ""
    created_at: datetime = msgspec.field(default_factory=utc_now)
    revoked_at: datetime | None = None


# --- bounds -------------------------------------------------------------------------------
#
# Every number that crosses the bus is checked where it is read: the bus layer passes each
# event it decodes through :func:`checked` (so does the trainer's journal when it replays). A
# score, a rollout or a teacher's signal with a number out of bounds becomes one that failed,
# with the reason in its ``error``: readers drop it (the trainer counts the rollout dropped) and
# nothing trains on the number. Any other event out of bounds (a task, a weight update, a usage
# count) is :class:`OutOfBounds` and goes to the dead-letter stream with the reason.

SCORE_LIMIT = 1e6  # |a score's value, weight or component|: rewards far past any reward scale
LOGPROB_MIN = -1e4  # a token's logprob: finite, at most 0 (a float's rounding allowed), not absurdly low
LOGPROB_MAX = 1e-3
MAX_GROUP_SIZE = 4096  # rollouts of one task (the gateway's bound on ``num_rollouts`` too)
COUNT_LIMIT = 2**53  # a count (tokens, rollouts, bytes): exact as a float, past anything real
METRIC_LIMIT = 1e30  # a figure for people (rollout or step metrics): finite and not absurd


class OutOfBounds(ValueError):
    """An event with a number outside its bounds (the message names the field and the bound)."""


def _number_problem(name: str, value: float, low: float, high: float) -> str | None:
    if not math.isfinite(value) or not low <= value <= high:
        return f"{name}={value!r} is out of bounds (a finite number from {low:g} to {high:g})"
    return None


def _numbers_problem(name: str, values: dict[str, float] | list[float], low: float, high: float) -> str | None:
    """The first value of ``values`` out of [low, high] or not finite, named; None: all in bounds.
    A sum and two extremes first (C loops: a rollout's logprobs are read by every consumer)."""
    seq = list(values.values()) if isinstance(values, dict) else values
    if not seq or (math.isfinite(sum(seq)) and low <= min(seq) and max(seq) <= high):
        return None
    keys = list(values) if isinstance(values, dict) else range(len(seq))
    for key, value in zip(keys, seq, strict=True):
        if (problem := _number_problem(f"{name}[{key!r}]", value, low, high)) is not None:
            return problem
    return None  # a sum that overflowed from values each in bounds


def _count_problem(name: str, value: int | None, low: int = 0, high: int = COUNT_LIMIT) -> str | None:
    if value is not None and not low <= value <= high:
        return f"{name}={value} is out of bounds (a whole number from {low} to {high})"
    return None


def _tokens_problem(where: str, tokens: TokenSpan | None) -> str | None:
    if tokens is None:
        return None
    return (_numbers_problem(f"{where}.logprobs", tokens.logprobs, LOGPROB_MIN, LOGPROB_MAX)
            or _count_problem(f"{where}.policy_version", tokens.policy_version, high=INT32_MAX))


def _first(*problems: str | None) -> str | None:
    return next((p for p in problems if p is not None), None)


def _sampling_problem(sampling: Sampling | None) -> str | None:
    """Settings no reader can do arithmetic with: not finite, or negative. (What a backend samples
    is :meth:`Sampling.check`'s, applied where settings are taken in; a rollout records 0.0 for
    a greedy eval's temperature.)"""
    if sampling is None:
        return None
    return _first(_number_problem("sampling.temperature", sampling.temperature, 0.0, 1e6),
                  _number_problem("sampling.top_p", sampling.top_p, 0.0, 1.0),
                  _count_problem("sampling.max_tokens", sampling.max_tokens, 0, INT32_MAX),
                  _count_problem("sampling.seed", sampling.seed, 0, INT32_MAX))


def finite_metrics(values: dict[str, float]) -> dict[str, float]:
    """``values`` less the figures that are not finite or are past :data:`METRIC_LIMIT`."""
    return {k: v for k, v in values.items() if _number_problem(k, v, -METRIC_LIMIT, METRIC_LIMIT) is None}


def checked(event: E) -> E:
    """``event`` if its numbers are within their bounds (see "bounds" above). Otherwise a
    :class:`Score` or :class:`Signal` comes back failed (``error`` naming the number, no values),
    a :class:`Rollout` with status ``error`` (the bad numbers left out, so every reader can show
    it), and any other event raises :class:`OutOfBounds` naming the field and its bound."""
    if isinstance(event, Score):
        problem = _first(_number_problem("value", event.value, -SCORE_LIMIT, SCORE_LIMIT),
                         _number_problem("weight", event.weight, -SCORE_LIMIT, SCORE_LIMIT),
                         _numbers_problem("components", event.components, -SCORE_LIMIT, SCORE_LIMIT))
        if problem is None:
            return event
        return msgspec.structs.replace(
            event, value=0.0, weight=1.0 if not math.isfinite(event.weight) else event.weight,
            components=finite_metrics(event.components),
            error=event.error or f"score of scorer {event.scorer!r}: {problem}; the rollout is not trained on")
    if isinstance(event, Signal):
        problem = _first(_number_problem("temperature", event.temperature, 0.0, 1e6),
                         *(_numbers_problem(f"values[{n!r}]", v, LOGPROB_MIN, LOGPROB_MAX)
                           for n, v in event.values.items()),
                         *(_numbers_problem(f"top_logprobs[{n!r}][{i}]", row, LOGPROB_MIN, LOGPROB_MAX)
                           for n, rows in event.top_logprobs.items() for i, row in enumerate(rows)))
        if problem is None:
            return event
        return msgspec.structs.replace(
            event, values={}, top_ids={}, top_logprobs={}, temperature=1.0,
            error=event.error or f"signal of {event.source!r}: {problem}; the rollout is not trained on")
    if isinstance(event, Rollout):
        structure = _first(_count_problem("group_size", event.group_size, 1, MAX_GROUP_SIZE),
                           _count_problem("index", event.index, 0, event.group_size - 1),
                           _count_problem("policy_version", event.policy_version, high=INT32_MAX),
                           _sampling_problem(event.sampling))
        if structure is not None:
            raise OutOfBounds(f"rollout {event.id}: {structure}")
        problem = _first(_numbers_problem("metrics", event.metrics, -METRIC_LIMIT, METRIC_LIMIT),
                         *(_tokens_problem(f"nodes[{i}].tokens", n.tokens) for i, n in enumerate(event.nodes)))
        if problem is None:
            return event
        nodes = [n if _tokens_problem("", n.tokens) is None or n.tokens is None else msgspec.structs.replace(
            n, tokens=msgspec.structs.replace(n.tokens, logprobs=[0.0] * len(n.tokens.logprobs), policy_version=None))
            for n in event.nodes]
        return msgspec.structs.replace(
            event, status="error", nodes=nodes, metrics=finite_metrics(event.metrics),
            error=f"rollout {event.id}: {problem}; not trained on" + (f" (and: {event.error})" if event.error else ""))
    problem = None
    if isinstance(event, TraceNode):
        problem = _tokens_problem("node.tokens", event.node.tokens)
    elif isinstance(event, Task):
        problem = _first(_count_problem("num_rollouts", event.num_rollouts, 1, MAX_GROUP_SIZE),
                         _sampling_problem(event.sampling))
    elif isinstance(event, WeightUpdate):
        problem = _first(_count_problem("version", event.version, high=INT32_MAX),
                         _count_problem("trainer_step", event.trainer_step, high=INT32_MAX),
                         _count_problem("size_bytes", event.size_bytes),
                         _count_problem("num_dropped_total", event.num_dropped_total),
                         _count_problem("num_unused_total", event.num_unused_total),
                         _numbers_problem("metrics", event.metrics, -METRIC_LIMIT, METRIC_LIMIT))
    elif isinstance(event, Usage):
        problem = _first(*(_count_problem(name, getattr(event, name)) for name in
                           ("step", "prompt_tokens", "sampled_tokens", "trained_tokens", "sft_tokens")),
                         _number_problem("sandbox_s", event.sandbox_s, 0.0, 1e9))
    if problem is not None:
        raise OutOfBounds(f"{type(event).__name__} {event.id}: {problem}")
    return event


AnyEvent = Task | Rollout | TraceNode | Score | Signal | WeightUpdate | Usage | DeadLetter

EVENT_TYPES: dict[str, type[Event]] = {
    cls.__struct_config__.tag: cls  # type: ignore[misc]  # each class below sets tag= to a str
    for cls in (Task, Rollout, TraceNode, Score, Signal, WeightUpdate, Usage, DeadLetter)
}

# --- encoding -----------------------------------------------------------------------------

_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()


def encode(event: Event | RunState | ServiceHeartbeat | ApiKey, content_type: str = JSON) -> bytes:
    if content_type == MSGPACK:
        return _msgpack_encoder.encode(event)
    if content_type == JSON:
        return _json_encoder.encode(event)
    raise ValueError(f"content_type must be {JSON!r} or {MSGPACK!r}, got {content_type!r}")


# A message holding several events of one subject says how many here (see "Batches" above).
BATCH_HEADER = "Flywheel-Batch"


def encode_many(batch: Sequence[Event], content_type: str = JSON) -> bytes:
    """The payload of a batch message: an array of ``batch``'s events, each as :func:`encode` gives it."""
    if content_type == MSGPACK:
        return _msgpack_encoder.encode(batch)
    if content_type == JSON:
        return _json_encoder.encode(batch)
    raise ValueError(f"content_type must be {JSON!r} or {MSGPACK!r}, got {content_type!r}")


def batch_msg_id(batch: Sequence[Event]) -> str:
    """The ``Nats-Msg-Id`` of a batch message: a digest of its events' own ids, in order."""
    digest = hashlib.sha256("\n".join(e.msg_id for e in batch).encode()).hexdigest()
    return f"batch-{digest[:32]}"


class Decoder(Generic[T]):
    """Decodes one event type (or a union) from either wire encoding. Build once, reuse."""

    # A class gives a Decoder of it; anything else msgspec decodes (a union such as the
    # default, AnyEvent) gives a Decoder[Any], for its variable to annotate.
    @overload
    def __init__(self: Decoder[T], type_: type[T]) -> None: ...
    @overload
    def __init__(self: Decoder[Any], type_: Any = ...) -> None: ...
    def __init__(self, type_: Any = AnyEvent) -> None:
        self.type = type_
        self._json = msgspec.json.Decoder(type_)
        self._msgpack = msgspec.msgpack.Decoder(type_)
        self._json_many = msgspec.json.Decoder(list[type_])
        self._msgpack_many = msgspec.msgpack.Decoder(list[type_])

    def decode(self, data: bytes, content_type: str | None = None) -> T:
        """Decode ``data``; raises msgspec.DecodeError / ValidationError with the reason."""
        if content_type is None or content_type.startswith(JSON):
            return self._json.decode(data)
        if content_type == MSGPACK:
            return self._msgpack.decode(data)
        raise msgspec.DecodeError(f"unknown Content-Type {content_type!r}; use {JSON} or {MSGPACK}")

    def decode_many(self, data: bytes, content_type: str | None = None) -> list[T]:
        """Decode a batch message's payload (an array of events; see :func:`encode_many`)."""
        if content_type is None or content_type.startswith(JSON):
            return self._json_many.decode(data)
        if content_type == MSGPACK:
            return self._msgpack_many.decode(data)
        raise msgspec.DecodeError(f"unknown Content-Type {content_type!r}; use {JSON} or {MSGPACK}")


def json_schema() -> dict[str, Any]:
    """JSON Schema (2020-12) for every event, for validating from other languages."""
    (schema,), components = msgspec.json.schema_components([AnyEvent], ref_template="#/$defs/{name}")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"Flywheel events, schema version {SCHEMA_VERSION}",
        **schema,
        "$defs": components,
    }
