"""The HTTP API's request and response models (pydantic), one family per resource.

``*Create`` models are what clients send: strict (unknown fields are refused, so a typo
is an error rather than a silently ignored setting) and turned into bus events by
``to_event``. ``*Public`` models are what the API answers. The events themselves
(:mod:`flywheel.contract.events`) stay msgspec Structs; these models are the HTTP boundary only.

``run`` and ``env`` become NATS subject tokens (``tasks.<run>.<env>``) and ``run`` is
also a key in the run-state KV bucket, so both are checked here, with messages that say
what is allowed. Every constraint the API enforces is also stated in its OpenAPI schema
(``pattern``, ``maxLength``, integer ranges, list lengths), so a generated client can build
valid requests: the patterns below are written out character by character to match the
Python checks exactly (a test compares them on every character), and integers are bounded
to what the trace store's columns hold (32-bit signed; the bus carries 64-bit integers).
The gateway is stricter than the bus about names: no control characters in a subject token
(the NATS server drops a connection that sends some of them in a subject).
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
)

from flywheel.contract import events
from flywheel.contract.config import SamplingConfig
from flywheel.contract.names import (
    CONTROL_OR_SPACE,
    KEY_PATTERN,
    MAX_NAME_CHARS,
    RUN_ID_PATTERN,
    RUN_ID_RULE,
    TOKEN_PATTERN,
    is_key,
    is_run_id,
    is_token,
)
from flywheel_gateway.store import MAX_PAGE_LIMIT

MAX_TASKS_PER_REQUEST = 10_000
MAX_TASK_ID_CHARS = 200
# Ids looked up by path (tasks, rollouts, nodes): far above any id Flywheel makes (uuid hex,
# 32-character hashes, 200-character task ids); a longer one cannot name anything.
MAX_ID_CHARS = 1024
MAX_CURSOR_CHARS = 1024
# The store's integer columns (policy_version, step, ...) are 32-bit signed.
INT32_MAX = 2**31 - 1
# What msgspec (the bus) and other languages' JSON readers take as an integer.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# Python's whitespace (str.isspace, what ``\s`` matches in flywheel.contract.runs), spelled out so that a
# JSON Schema (ECMA-262) regex means the same: ECMA's ``\s`` differs on a few characters.
_SPACE = r"\t\n\v\f\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
TASK_ID_PATTERN = rf"^[^\r\n]*[^{_SPACE}][^\r\n]*$"
_TASK_ID = re.compile(TASK_ID_PATTERN)


def subject_token(value: str) -> str:
    """A NATS subject token without control characters: not empty, no '.', whitespace, '*' or '>'."""
    if not is_token(value):
        raise ValueError(f"must be a NATS subject token (no '.', '*', '>', spaces or control characters), "
                         f"got {value!r}")
    return value


def run_id(value: str) -> str:
    """A run id, by the one rule (:func:`flywheel.contract.names.is_run_id`)."""
    if not is_run_id(value):
        raise ValueError(f"{RUN_ID_RULE}, got {value!r}")
    return value


def tenant_name(value: str) -> str:
    if not is_key(value):
        raise ValueError(f"must be 1 to {MAX_NAME_CHARS} letters, digits, '-', '_', '=' or '/', got {value!r}")
    return value


def task_id(value: str) -> str:
    """A task id: sent as the ``Nats-Msg-Id`` header, so on one line and not blank."""
    if not _TASK_ID.fullmatch(value):
        raise ValueError(f"must be on one line and not blank (it is sent as a header), got {value!r}")
    return value


_RFC3339_START = re.compile(r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}")


def rfc3339_text(value: Any) -> Any:
    """Only RFC 3339 text: pydantic would also take a number as Unix seconds, which the schema does not say."""
    if not (isinstance(value, str) and _RFC3339_START.match(value)) and not isinstance(value, datetime):
        raise ValueError(f"give an RFC 3339 time with an offset (2026-01-01T00:00:00Z), got {value!r}")
    return value


def utc_range(value: datetime) -> datetime:
    """An aware datetime that converts to UTC within years 1 to 9999 (the store keeps UTC)."""
    try:
        value.astimezone(UTC)
    except OverflowError:
        raise ValueError(f"is out of range once converted to UTC ({value.isoformat()}); give a time between "
                         "0001-01-01 and 9999-12-31 UTC") from None
    return value


def json_data(value: dict[str, Any]) -> dict[str, Any]:
    """Task data every reader of the bus decodes as it was sent: finite numbers, 64-bit integers."""
    stack: list[tuple[str, Any]] = [("data", value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, dict):
            stack.extend((f"{where}[{k!r}]", v) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(item))
        elif isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{where} is {item}, which JSON cannot carry; send a finite number or a string")
        elif isinstance(item, int) and not isinstance(item, bool) and not INT64_MIN <= item <= INT64_MAX:
            raise ValueError(f"{where} is an integer beyond 64 bits ({item}); send it as a string")
    return value


def _schema(pattern: str) -> dict[str, Any]:
    """The JSON Schema half of a constraint whose check (with its message) is an AfterValidator."""
    return {"pattern": pattern}


RunId = Annotated[str, Field(max_length=MAX_NAME_CHARS, description="Run id (letters, digits, - _).",
                             json_schema_extra=_schema(RUN_ID_PATTERN)),
                  AfterValidator(run_id)]
EnvName = Annotated[str, Field(max_length=MAX_NAME_CHARS,
                               description="Environment name (a NATS subject token).",
                               json_schema_extra=_schema(TOKEN_PATTERN)),
                    AfterValidator(subject_token)]
TaskId = Annotated[str, Field(min_length=1, max_length=MAX_TASK_ID_CHARS, json_schema_extra=_schema(TASK_ID_PATTERN),
                              description="Task id; also the deduplication key (a retried POST with the same id is "
                                          "stored once). On one line, not blank. Default: the data's own string "
                                          "'id', else derived from the run, env, data and the task's position in "
                                          "the request (from 1), as `flywheel tasks publish` derives a file's, so "
                                          "a POST retried without ids is stored once too."),
                   AfterValidator(task_id)]


class _Create(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- tasks --------------------------------------------------------------------------------


class Sampling(SamplingConfig):
    """The task's own sampling settings, in place of its run's: the contract's sampling
    (:class:`flywheel.contract.events.Sampling`), its defaults and bounds, so a task accepted
    here is one inference samples."""


class TaskCreate(_Create):
    """One row of a task set, to be rolled out ``num_rollouts`` times as one group."""

    run: RunId
    env: EnvName
    data: Annotated[dict[str, Any], AfterValidator(json_data)] = Field(
        description="The task row, as the environment expects it (finite numbers, integers within 64 bits).")
    id: TaskId | None = None
    num_rollouts: int = Field(1, ge=1, le=events.MAX_GROUP_SIZE)
    sampling: Sampling | None = None

    def to_event(self, position: int) -> events.Task:
        """The task, ``position`` (from 1) being its place in the request: its id, when it has
        none, is :func:`flywheel.contract.events.task_id`'s (ValueError for a blank data id)."""
        return events.Task(id=self.id if self.id is not None else events.task_id(self.run, self.env, position,
                                                                                 self.data),
                           run=self.run, env=self.env, data=self.data, num_rollouts=self.num_rollouts,
                           sampling=self.sampling.to_event() if self.sampling is not None else None)


def _one_or_many(value: Any) -> str:
    return "tasks" if isinstance(value, list) else "task"


# The tag names show in error paths: "task.run: ..." for one task, "tasks[2].run: ..." for a list.
TasksCreate = Annotated[
    Annotated[TaskCreate, Tag("task")]
    | Annotated[list[TaskCreate], Field(min_length=1, max_length=MAX_TASKS_PER_REQUEST), Tag("tasks")],
    Discriminator(_one_or_many),
]


class TasksAccepted(BaseModel):
    """The tasks were stored on the bus; they show in ``GET /v1/tasks`` once recorded."""

    ids: list[str]


_SAMPLING = events.Sampling()


class SamplingPublic(BaseModel):
    """Sampling as recorded, with the contract's defaults: a task may come from any producer, so
    no bound is checked here."""

    temperature: float = _SAMPLING.temperature
    top_p: float = _SAMPLING.top_p
    max_tokens: int = _SAMPLING.max_tokens
    stop: list[str] = _SAMPLING.stop
    seed: int | None = _SAMPLING.seed


class TaskPublic(BaseModel):
    id: str
    run: str
    env: str
    data: dict[str, Any]
    num_rollouts: int
    sampling: SamplingPublic | None
    created_at: datetime


class TaskPage(BaseModel):
    items: list[TaskPublic]
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next page; null on the last page.")


# --- rollouts -----------------------------------------------------------------------------


class ScorePublic(BaseModel):
    id: str
    scorer: str
    value: float
    weight: float
    components: dict[str, float]
    error: str | None
    created_at: datetime


class RolloutPublic(BaseModel):
    id: str
    run: str
    env: str
    task_id: str
    group_id: str
    index: int
    policy_version: int
    status: Literal["completed", "truncated", "error"]
    error: str | None = Field(description="Why the rollout is an error, as the filter `error=true` takes it: "
                                          "inference's message, then each failed scorer's (`scorer 'NAME' "
                                          "failed: ...`); null for the others.")
    reward: float | None = Field(description="The rollout's reward, as the trainer takes it: the weighted sum of the "
                                             "values of its run's scorers; null until each has scored it, when one "
                                             "failed on it, and for an errored rollout.")
    num_tokens: int
    created_at: datetime


class RolloutDetail(RolloutPublic):
    metrics: dict[str, float]
    task_data: dict[str, Any]
    scores: list[ScorePublic]


class RolloutPage(BaseModel):
    items: list[RolloutPublic]
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next page; null on the last page.")


Reward = Annotated[float | None, Field(allow_inf_nan=False)]
PolicyVersion = Annotated[int, Field(ge=0, le=INT32_MAX)]
Instant = Annotated[AwareDatetime, BeforeValidator(rfc3339_text), AfterValidator(utc_range)]
# Filters name what may have been recorded from any producer: any subject token, not only a
# run id the gateway would create.
TokenFilter = Annotated[str, Field(max_length=MAX_NAME_CHARS, json_schema_extra=_schema(TOKEN_PATTERN)),
                        AfterValidator(subject_token)]
ENV_ID_PATTERN = rf"^[^{CONTROL_OR_SPACE}.*>@]+(@[-+_.a-zA-Z0-9]+)?$"  # a subject token, or one with @version
EnvFilter = Annotated[str, Field(max_length=MAX_NAME_CHARS, pattern=ENV_ID_PATTERN)]
Cursor = Annotated[str, Field(max_length=MAX_CURSOR_CHARS)]


class RolloutFilters(BaseModel):
    """Query parameters that choose rollouts; unknown parameters are refused (a typo must
    not silently widen a filter)."""

    model_config = ConfigDict(extra="forbid")

    run: TokenFilter | None = None
    env: EnvFilter | None = Field(None, description="The environment: the name in the rollouts' subjects "
                                                    "(reverse_text), or the id a run's config names "
                                                    "(owner/name, owner/name@1.0). An installed package's "
                                                    "id (no version) and its module are one environment: "
                                                    "either finds runs configured with the other.")
    status: Literal["completed", "truncated", "error"] | None = None
    error: bool | None = Field(None, description="true: rollouts with an error (inference marked them `error` or "
                                                 "gave a message, or a scorer failed on them); false: the others.")
    flagged: bool | None = Field(None, description="true: rollouts the reward-hacking watch flagged (a `watch` "
                                                   "score names the detectors); false: the others.")
    policy_version: PolicyVersion | None = None
    min_policy_version: PolicyVersion | None = Field(None, description="Inclusive.")
    max_policy_version: PolicyVersion | None = Field(None, description="Inclusive.")
    min_reward: Reward = Field(None, description="Inclusive; leaves out rollouts without a reward.")
    max_reward: Reward = Field(None, description="Inclusive; leaves out rollouts without a reward.")
    created_after: Instant | None = Field(None, description="Inclusive, RFC 3339 with an offset "
                                                            "(2026-01-01T00:00:00Z).")
    created_before: Instant | None = Field(None, description="Exclusive, RFC 3339 with an offset.")


class RolloutListQuery(RolloutFilters):
    limit: int = Field(50, ge=1, le=MAX_PAGE_LIMIT, description="Items per page.")
    cursor: Cursor | None = Field(None, description="next_cursor of the previous page (with the same filters).")


class RolloutExportQuery(RolloutFilters):
    tokens: bool = Field(False, description="Add each rollout's token layer (token_ids, logprobs, loss_mask).")


# --- traces -------------------------------------------------------------------------------


class ToolCallPublic(BaseModel):
    id: str
    name: str
    arguments: str = "{}"


class MessagePublic(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[ToolCallPublic] = []
    tool_call_id: str | None = None
    name: str | None = None


class TokenSpanPublic(BaseModel):
    token_ids: list[int]
    logprobs: list[float] = []
    loss_mask: list[bool] = []
    policy_version: int | None = None
    texts: list[str] = Field([], description="Each token's text, as the policy's tokenizer decodes it alone "
                                             "(aligned with token_ids); empty where inference did not record it.")


class NodePublic(BaseModel):
    id: str
    parent_id: str | None
    position: int = Field(description="Order of the node in its rollout.")
    message: MessagePublic
    tokens: TokenSpanPublic | None = Field(
        None, description="The token layer; only with ?tokens=true, and null for a node without tokens.")


class SignalPublic(BaseModel):
    source: str = Field(description="The teacher's name in the run config ([teachers.<name>]).")
    model: str = Field(description="What computed the values (a model; the run's own weights as RUN@vVERSION).")
    temperature: float = Field(description="The temperature the values are at (the rollout's sampling).")
    values: dict[str, list[float]] = Field(
        description="By node id (those holding sampled tokens): the teacher's logprob of each token of the node's "
                    "span, in the context it was sampled in; 0.0 where the policy did not sample the token.")
    error: str | None = Field(None, description="Why the teacher could not value the rollout (then no values).")


class TracePublic(BaseModel):
    rollout_id: str
    finished: bool = Field(description="Whether the rollout itself is recorded; false while only live nodes are.")
    nodes: list[NodePublic]
    leaves: list[str] = Field(description="Ids of the nodes no other node of the rollout continues: one per branch "
                                          "(sub-agent, retry); pick one for /v1/traces/{rollout_id}/branches/{leaf}.")
    final_leaf: str | None = Field(description="The rollout's last node, the end of the branch rewards read; null "
                                               "until the rollout is recorded.")
    signals: list[SignalPublic] | None = Field(
        None, description="With ?tokens=true: each teacher's logprobs of the sampled tokens (runs that name "
                          "teachers), aligned with the nodes' token spans.")


class TokenLayerPublic(BaseModel):
    token_ids: list[int]
    logprobs: list[float]
    loss_mask: list[bool]


class BranchPublic(BaseModel):
    rollout_id: str
    leaf_id: str
    complete: bool = Field(description="Whether the branch reaches a root; false when a parent is not recorded "
                                       "(yet) for this rollout.")
    nodes: list[NodePublic] = Field(description="Root first.")
    tokens: TokenLayerPublic | None = Field(
        None, description="With ?tokens=true: the branch's token spans concatenated, the tokens the model saw.")


# --- runs ---------------------------------------------------------------------------------


class RunPublic(BaseModel):
    id: str
    tenant: str
    kind: Literal["train", "eval"]
    created_at: datetime
    env: str | None = Field(None, description="The environment id its config names (owner/name[@version] or a "
                                              "module name); null for a run registered without a config.")


class RunPage(BaseModel):
    items: list[RunPublic]
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next page; null on the last page.")


class EvalPointPublic(BaseModel):
    eval: str = Field(description="The eval's name (its [[evals]] label).")
    step: int = Field(description="The training step whose weights it evaluated.")
    run: str = Field(description="The eval run holding its rollouts and scores (/v1/rollouts?run=).")
    reward_mean: float | None = Field(description="Mean reward over its rollouts without an error.")
    reward_stderr: float | None = Field(description="Standard error of that mean.")
    num_rollouts: int
    num_errors: int


class ErrorGroupPublic(BaseModel):
    source: str = Field(description="Where it failed: `rollout` (inference marked it failed), `scorer NAME`, "
                                    "`teacher NAME`.")
    error: str = Field(description="The first one's error text; errors that differ only in numbers and ids group.")
    count: int = Field(description="Rollouts of the run dropped for it so far (never trained).")
    example: str = Field(description="The first one's rollout id (/v1/rollouts/ID shows the error in place).")


class RunDetail(RunPublic):
    status: Literal["created", "running", "paused", "finished", "failed", "stopped", "abandoned"] | None = Field(
        description="Live, from the run-state bucket; null when the bucket holds no state for the run. `abandoned`: "
                    "running, but its owner stopped renewing its lease (killed, or its machine is gone).")
    config: dict[str, Any] | None = Field(description="The run's config, from the run-state bucket; null as status.")
    ended_at: datetime | None = Field(None, description="When the run ended (finished, failed, stopped, or when the "
                                                        "lease of an abandoned run expired); null while it runs.")
    reason: str | None = Field(None, description="Why the run takes no more tasks, or who paused it, a sentence; "
                                                 "null while it runs.")
    owner: str | None = Field(None, description="Who holds the run's lease (`flywheel run`), if anyone.")
    lease_expires_at: datetime | None = Field(None, description="When the owner's lease expires unless renewed.")
    latest_step: int | None = Field(description="Latest training step recorded; null before the first.")
    latest_version: int | None = Field(description="Policy version the latest step published.")
    reward_mean: float | None = Field(description="The latest step's reward_mean metric, where it reports one.")
    num_tasks: int
    num_rollouts: int
    num_scored_rollouts: int = Field(description="Rollouts with at least one score recorded.")
    evals: list[EvalPointPublic] = Field(default_factory=list, description="The evals its owner ran during "
                                         "training, from the run-state bucket, in the order they ended.")
    errors: list[ErrorGroupPublic] = Field(default_factory=list, description="The rollouts its trainer dropped for "
                                           "an error, grouped by kind, most frequent first (from the run-state "
                                           "bucket).")


class StepMetricsPublic(BaseModel):
    step: int
    version: int = Field(description="Policy version published by this step.")
    metrics: dict[str, float] = Field(description="The trainer's figures for the step: loss, reward_mean, ...")
    created_at: datetime


class RunMetricsPublic(BaseModel):
    run: str
    items: list[StepMetricsPublic] = Field(
        description="Steps in ascending order. To poll, pass the last step seen as ?since_step=.")


# --- errors and health --------------------------------------------------------------------


class _UsageScope(BaseModel):
    """Whose usage, and when: the query parameters both usage reports take."""

    model_config = ConfigDict(extra="forbid")

    tenant: Annotated[str, Field(max_length=MAX_NAME_CHARS, json_schema_extra=_schema(KEY_PATTERN)),
                      AfterValidator(tenant_name)] | None = Field(
        None, description="Only this tenant's (with an API key: its own, always).")
    run: TokenFilter | None = Field(None, description="Only this run's.")
    since: Instant | None = Field(None, description="Counts made at or after this time, RFC 3339 with an offset.")
    until: Instant | None = Field(None, description="Counts made before this time (exclusive), RFC 3339 with an "
                                                    "offset.")

    @field_validator("until")
    @classmethod
    def _after_since(cls, until: datetime | None, info: ValidationInfo) -> datetime | None:
        since = info.data.get("since")
        if until is not None and since is not None and until <= since:
            raise ValueError(f"{until.isoformat()} is not after since={since.isoformat()}: give a range that holds "
                             "some time")
        return until


class UsageQuery(_UsageScope):
    """Query parameters of the usage report; unknown parameters are refused."""

    recount: bool = Field(False, description="With run: count the run's tokens again from its stored traces, "
                                             "beside the metered figures.")

    @field_validator("recount")
    @classmethod
    def _of_a_run(cls, recount: bool, info: ValidationInfo) -> bool:
        if recount and info.data.get("run") is None:
            raise ValueError("recount=true needs run: the recount is of one run's stored traces")
        return recount


BUCKET_UNITS = {"m": 60, "h": 3600, "d": 86400}
BUCKET_PATTERN = r"^[1-9][0-9]{0,3}[mhd]$"
MAX_BUCKETS = 1000  # in the range of one usage-over-time report
USAGE_RANGE = timedelta(days=7)  # the range of a usage-over-time report that names no since
USAGE_EPOCH, USAGE_END = datetime(1970, 1, 1, tzinfo=UTC), datetime(9000, 1, 1, tzinfo=UTC)


def bucket_seconds(bucket: str) -> int:
    """'15m' -> 900, '1h' -> 3600, '1d' -> 86400; ValueError naming the form otherwise."""
    if not re.fullmatch(BUCKET_PATTERN, bucket):
        raise ValueError(f"{bucket!r} is not a bucket: give minutes, hours or days as 15m, 1h, 1d (1 to 9999 of "
                         "them)")
    return int(bucket[:-1]) * BUCKET_UNITS[bucket[-1]]


class UsageOverTimeQuery(_UsageScope):
    """Query parameters of the usage over time; unknown parameters are refused. ``until``
    defaults to now, ``since`` to 7 days before ``until``."""

    bucket: Annotated[str, Field(max_length=5, json_schema_extra=_schema(BUCKET_PATTERN))] = Field(
        "1h", description="The length of a bucket: minutes, hours or days (15m, 1h, 1d). Buckets start at whole "
                          f"multiples of it from the Unix epoch (a day's at 00:00 UTC); at most {MAX_BUCKETS} in the "
                          "range.")

    @field_validator("since", "until")
    @classmethod
    def _in_unix_time(cls, value: datetime | None) -> datetime | None:
        if value is not None and not USAGE_EPOCH <= value < USAGE_END:
            raise ValueError(f"{value.isoformat()} is out of range: usage over time is from {USAGE_EPOCH.year} (the "
                             f"Unix epoch) to {USAGE_END.year}")
        return value

    @field_validator("bucket")
    @classmethod
    def _few_enough(cls, bucket: str, info: ValidationInfo) -> str:
        seconds = bucket_seconds(bucket)
        if "since" not in info.data or "until" not in info.data:
            return bucket  # the range is refused already
        since, until = usage_range(info.data["since"], info.data["until"])
        first = int(since.timestamp()) // seconds
        num_buckets = -(-int(until.timestamp()) // seconds) - first
        if num_buckets > MAX_BUCKETS:
            raise ValueError(f"{bucket} buckets from {since.isoformat()} to {until.isoformat()} are {num_buckets}; at "
                             f"most {MAX_BUCKETS}: take longer buckets or a shorter range (since, until)")
        return bucket

    def resolved(self) -> tuple[datetime, datetime]:
        """``since`` and ``until`` with their defaults."""
        return usage_range(self.since, self.until)


def usage_range(since: datetime | None, until: datetime | None) -> tuple[datetime, datetime]:
    """A usage range with its defaults: until now, since 7 days before until."""
    until = until or datetime.now(UTC)
    return since or max(until - USAGE_RANGE, USAGE_EPOCH), until


class UsageRowPublic(BaseModel):
    tenant: str = Field(description="Who pays: the API key's tenant for API requests, else the run's owner.")
    run: str
    source: Literal["rollout", "trainer", "sft", "api", "sandbox", "training_api"] = Field(
        description="rollout: a rollout's model calls; trainer: a training step; sft: the SFT warm-up; api: a "
                    "request to inference's OpenAI API; sandbox: a rollout's sandbox; training_api: a request to the "
                    "training API (run: its session).")
    num_counts: int = Field(description="Counts summed (rollouts, steps, requests).")
    num_calls: int = Field(description="Model calls of the rollouts.")
    prompt_tokens: int = Field(description="Every model call's whole prompt.")
    sampled_tokens: int
    trained_tokens: int = Field(description="Sampled tokens under the loss of the steps.")
    sft_tokens: int = Field(description="Reference answers' tokens under the SFT loss.")
    sandbox_s: float = Field(description="Seconds the sandboxes were alive.")
    cost: float = Field(description="By the price table, in its currency.")


class UsageTotalsPublic(BaseModel):
    num_calls: int
    prompt_tokens: int
    sampled_tokens: int
    trained_tokens: int
    sft_tokens: int
    sandbox_s: float
    cost: float


class PricesPublic(BaseModel):
    currency: str
    prompt_per_mtok: float
    sampled_per_mtok: float
    trained_per_mtok: float = Field(description="For trained and SFT tokens alike.")
    sandbox_per_hour: float


class UsageRecountPublic(BaseModel):
    """A run's tokens counted again from the trace store: the model calls of its rollouts and
    the sampled tokens of the rollouts its steps trained."""

    num_calls: int
    prompt_tokens: int
    sampled_tokens: int
    trained_tokens: int
    matches: bool = Field(description="Whether the metered figures (sources rollout and trainer) equal these.")


class UsageReport(BaseModel):
    tenant: str | None
    run: str | None
    since: datetime | None
    until: datetime | None
    prices: PricesPublic
    items: list[UsageRowPublic] = Field(description="By tenant, run and source.")
    totals: UsageTotalsPublic
    recount: UsageRecountPublic | None = None


class UsageBucketPublic(UsageTotalsPublic):
    """What was used in one time bucket, with its cost by the price table."""

    start: datetime = Field(description="Inclusive.")
    end: datetime = Field(description="Exclusive.")
    num_counts: int = Field(description="Counts summed (rollouts, steps, requests).")


class UsageOverTimeReport(BaseModel):
    tenant: str | None
    run: str | None
    since: datetime
    until: datetime
    bucket: str
    bucket_s: int
    prices: PricesPublic
    items: list[UsageBucketPublic] = Field(description="Every bucket of the range in time order, those without "
                                                       "counts too (zero); the first and the last may reach beyond it "
                                                       "(only counts within it are summed).")


class ApiKeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scopes: list[Literal["read", "write", "admin"]] = Field(min_length=1, max_length=3, description="read: GET; "
                                                            "write: publish tasks, change runs, sample; admin: keys.")
    name: str = Field("", max_length=200, description="For people: what the key is for.")
    tenant: Annotated[str, Field(max_length=MAX_NAME_CHARS, json_schema_extra=_schema(KEY_PATTERN)),
                      AfterValidator(tenant_name)] | None = Field(
        None, description="Whose key: with an API key, its own tenant (the default); the service token and an "
                          "open gateway name it.")


class ApiKeyPublic(BaseModel):
    id: str
    tenant: str
    scopes: list[str]
    name: str
    created_at: datetime
    revoked_at: datetime | None

    @classmethod
    def of(cls, record: events.ApiKey) -> ApiKeyPublic:
        return cls(id=record.id, tenant=record.tenant, scopes=list(record.scopes), name=record.name,
                   created_at=record.created_at, revoked_at=record.revoked_at)


class ApiKeyCreated(ApiKeyPublic):
    key: str = Field(description="The key itself, fw_<id>_<secret>: shown this once, stored nowhere.")


class ApiKeyPage(BaseModel):
    items: list[ApiKeyPublic]


class HubFilePublic(BaseModel):
    filename: str
    kind: Literal["wheel", "sdist"]
    sha256: str
    size_bytes: int
    url: str = Field(description="Where to download it (the package index's link).")


class HubVersionPublic(BaseModel):
    env_id: str
    version: str
    sha256: str = Field(description="The version's content hash: its wheel's sha256 (a run pins it).")
    summary: str = ""
    pushed_by: str | None = Field(None, description="The API key's id; null from an open gateway.")
    created_at: datetime
    files: list[HubFilePublic] = []


class HubVersionDetail(HubVersionPublic):
    readme: str = Field("", description="The package's README, as pushed.")


class HubForkPublic(BaseModel):
    id: str
    owner: str
    forked_from: str = Field(description="owner/name@version it was forked from.")


class HubEnvironmentPublic(BaseModel):
    id: str = Field(description="owner/name")
    owner: str
    project: str = Field(description="Its package's name on the index: pip install --only-binary :all: --index-url "
                                     "<gateway>/hub/simple <project>.")
    private: bool
    forked_from: str | None = Field(None, description="owner/name@version it was forked from (its lineage).")
    latest_version: str | None = None
    summary: str = ""
    created_at: datetime


class HubEnvironmentPage(BaseModel):
    items: list[HubEnvironmentPublic]


class HubEnvironmentDetail(HubEnvironmentPublic):
    readme: str = Field("", description="The newest version's README.")
    versions: list[HubVersionDetail] = Field(description="Newest first.")
    forks: list[HubForkPublic] = Field(description="Forks the caller may see.")


class HubVisibility(BaseModel):
    model_config = ConfigDict(extra="forbid")

    private: bool = Field(description="true: seen, installed and evaluated by the owner's keys alone.")


class HubEvalCreate(BaseModel):
    """An eval's summary, as ``flywheel eval`` writes it (``*.summary.json``), for one version."""

    model_config = ConfigDict(extra="forbid")

    version: str = Field(max_length=64, json_schema_extra={"pattern": r"^[0-9]+\.[0-9]+\.[0-9]+$"},
                         description="The environment version evaluated.")
    model: str = Field(min_length=1, max_length=500, description="The model evaluated.")
    num_tasks: int = Field(ge=1, le=2**31 - 1)
    num_rollouts: int = Field(ge=1, le=2**31 - 1)
    reward_mean: float | None = Field(None, allow_inf_nan=False)
    reward_stderr: float | None = Field(None, ge=0, allow_inf_nan=False)
    pass_at: dict[Annotated[str, Field(pattern=r"^pass@[1-9][0-9]{0,3}$")],
                  Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None] = Field(
        default_factory=dict, max_length=64, description="pass@k by k, as 'pass@1': 0.5.")
    prompt_tokens: int = Field(0, ge=0, le=2**62)
    completion_tokens: int = Field(0, ge=0, le=2**62)
    summary: dict[str, Any] = Field(default_factory=dict, description="The rest of the eval's summary, kept as is.")


class HubEvalPublic(BaseModel):
    id: int
    env_id: str
    version: str
    model: str
    reward_mean: float | None
    reward_stderr: float | None
    pass_at: dict[str, float | None]
    num_tasks: int
    num_rollouts: int
    prompt_tokens: int
    completion_tokens: int
    tenant: str = Field(description="Who pushed it.")
    created_at: datetime


class HubEvalPage(BaseModel):
    items: list[HubEvalPublic] = Field(description="The leaderboard: best reward first.")


class ErrorPublic(BaseModel):
    detail: str


class FieldError(BaseModel):
    field: str
    message: str


class ValidationErrorPublic(BaseModel):
    detail: str = Field(description="Every problem, as 'field: message', joined by '; '.")
    errors: list[FieldError]


class HealthPublic(BaseModel):
    status: Literal["ok", "unavailable"]
    checks: dict[str, str] = Field(description="'ok', or why the dependency is down.")
