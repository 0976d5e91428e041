"""Settings shared by every service and the CLI.

One name per setting, everywhere: ``FLYWHEEL_<NAME>`` in the environment, ``<name>`` in a
TOML file named by ``FLYWHEEL_CONFIG``, or the matching ``flywheel up`` option. Nothing
reads settings at import time: entry points build a :class:`Settings` (:meth:`Settings.load`)
and pass it on.

Two kinds of setting:

- flat ones (``gateway_port``, ``inference_host``, ``sandbox_image``, ...): where the stack
  is, what it runs on, the caps a deployment sets. Compose files, ``.env`` files and
  ``flywheel up`` options pass them by these names, so they keep them.
- sections, one per service process (``inference``, ``trainer``, ``scorer``, ``recorder``,
  ``sandbox``): its bounds and timeouts, the tuning a deployment rarely changes. A field
  of a section is ``FLYWHEEL_<SECTION>__<FIELD>`` in the environment
  (``FLYWHEEL_SCORER__MAX_HELD=2048``) and ``<field>`` under ``[<section>]`` in the TOML
  file. Each service's composition root reads its own section; its default is written
  here and nowhere else (tests build a section with other values).

Every field has a description, a type and its bounds: a bad value is refused at start,
naming the field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from flywheel.contract import natsusers

# One rollout's harness, in inference and in `flywheel eval` (flywheel.sdk.rollout), so that an
# environment gets the same rules in both.
ROLLOUT_TIMEOUT_S = 600.0
# One reward function, in the scorer and in `flywheel eval` (flywheel.sdk.scoring).
REWARD_TIMEOUT_S = 120.0


class _Section(BaseModel):
    """A service process's settings: its fields are FLYWHEEL_<SECTION>__<FIELD>, or [<section>] in TOML."""

    model_config = ConfigDict(extra="forbid")  # a misspelt field is refused, not ignored


class InferenceSettings(_Section):
    """The inference process: its task consumer and each rollout (section ``[inference]``)."""

    snapshots_kept: int = Field(2, ge=1, description="Weights of past steps (`model = RUN@STEP` on the OpenAI "
                                "API, which evals during training use) kept loaded, each in a model of its own; "
                                "the least recently used beyond these is unloaded.")
    max_tasks_in_flight: int = Field(32, ge=1, description="Tasks of one run that inference holds at once, each "
                                     "rolling out its group or waiting for the run's admission: enough for "
                                     "several groups to share a batch. Each run has slots of its own (a consumer "
                                     "of its tasks, shared by the replicas): a run that waits (paused, far ahead "
                                     "of its trainer, flooded with tasks) holds only its own.")
    tenant_max_rollouts_in_flight: int = Field(256, ge=1, description="Rollouts of one tenant's runs rolled out "
                                               "at once in one inference process, all its runs together (each run "
                                               "is bounded by its config's inference.max_rollouts_in_flight too): "
                                               "the tenant's quota, so that one tenant's runs, however many or "
                                               "slow, leave places to the others'. A rollout over it waits, and "
                                               "its run's screen says so.")
    ack_wait_s: float = Field(5.0, gt=0, description="How soon the tasks a process held when it died are "
                              "delivered to another one. A task still being rolled out is kept alive every "
                              "third of it, so a long rollout is not redelivered.")
    max_deliver: int = Field(5, ge=1, description="Deliveries of a task that keeps failing (the model does not "
                             "build, the bus fails) before it is dead-lettered with the last error.")
    backoff_s: tuple[NonNegativeFloat, ...] = Field(
        (1.0, 5.0, 15.0, 30.0), min_length=1, description="Seconds before each redelivery of a task that failed: "
        "the first before the second delivery, and so on; the last one repeats.")
    grace_s: float = Field(10.0, ge=0, description="At shutdown, how long tasks in flight may finish before "
                           "they are handed back to the other replicas.")
    rollout_timeout_s: float = Field(ROLLOUT_TIMEOUT_S, gt=0, description="How long a rollout's harness may run "
                                     "before it is cancelled and its rollout recorded as an error (the same "
                                     "default as `flywheel eval`).")
    live_trace_after_s: float = Field(1.0, ge=0, description="A rollout's trace nodes go on the bus as its calls "
                                      "complete once it has run this long (0: from its first call), so a live "
                                      "viewer follows it. A rollout that ends sooner sends its nodes only in its "
                                      "rollout event: no trace message per call where rollouts are short.")
    teacher_max_in_flight: int = Field(128, ge=1, description="Rollouts one teacher of a run holds at once in one "
                                       "process, being scored or waiting for its model (or for the weights "
                                       "version it serves): the bound of its durable consumer.")
    teacher_batch_size: int = Field(64, ge=1, description="Rollouts a teacher takes from the bus at once and "
                                    "scores together, in forward passes of its max_batch_size sequences; at "
                                    "most teacher_max_in_flight.")
    teacher_device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where teachers' models run "
                                                           "(auto: cuda when there is one, else cpu).")
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="Largest request body the OpenAI API "
                                "and the interception endpoint read; a larger one is refused with 413 before it "
                                "is parsed (and a request without a good key before any of it is read).")


class TrainerSettings(_Section):
    """The trainer process: how a step is cut, and its consumers' bounds (section ``[trainer]``).

    The algorithm (batch size, learning rate, loss, ...) is the run config's ``[trainer]``,
    not this."""

    micro_batch_size: int = Field(128, ge=1, description="Sequences per forward and backward pass, at most: with "
                                  "micro_batch_tokens it bounds activation memory; the gradient does not depend on "
                                  "it. Several ranks get a pass each at least.")
    micro_batch_tokens: int = Field(8192, ge=1, description="Padded tokens per forward and backward pass, at most "
                                    "(rows times the longest; a longer sequence gets a pass of its own): short "
                                    "sequences share a pass, long ones are not cut mid-way.")
    ranks: int = Field(1, ge=1, description="Data-parallel ranks of each run's trainer, on this machine: above 1 "
                       "the run's owner starts it with torch's launcher (gloo on CPU, NCCL with one GPU a rank); "
                       "each rank takes a share of a step's micro-batches, the step is the same as on one rank.")
    max_buffered_rollouts: int = Field(4096, ge=1, description="Rollouts the trainer holds before its rollout "
                                       "consumer waits (the backlog stays in NATS). At least the run's "
                                       "trainer.batch_size plus inference.max_rollouts_in_flight, or groups "
                                       "that inference interleaves could never complete: a run below that is "
                                       "refused at start.")
    consumer_batch_size: int = Field(64, ge=1, description="Rollouts (and scores) fetched from the bus at once; "
                                     "each batch is journalled and fsynced once.")
    consumer_max_in_flight: int = Field(256, ge=1, description="Rollouts (and scores) delivered and not yet "
                                        "journalled, per consumer.")
    ack_wait_s: float = Field(5.0, gt=0, description="How soon what a killed trainer had received and not "
                              "journalled is delivered to its restart.")
    weight_versions_kept: int = Field(4, ge=1, description="Weight versions of the run kept in the weights "
                                      "bucket (each is a full copy of the model); publishing a new one drops "
                                      "the oldest. Inference loads the newest, so a few cover a replica that "
                                      "is still fetching the one before.")
    weights_dir: Path | None = Field(None, description="A folder the run's weight versions go to as files "
                                     "(<folder>/<run>/<version>.safetensors, file:// URIs in the updates), which "
                                     "every inference process must see at the same path: one machine, or a volume "
                                     "they all mount. Unset: the run's JetStream object store bucket. `flywheel up` "
                                     "with a nats-server of its own (no nats_url) sets data_dir/weights: the "
                                     "object store costs its clients and the server about as much CPU again as "
                                     "writing and reading the file.")


class ScorerSettings(_Section):
    """A scorer process, built-in or custom (section ``[scorer]``; its command's options win)."""

    max_in_flight: int = Field(64, ge=1, description="Rollouts being scored at once.")
    max_held: int = Field(1024, ge=1, description="Rollouts held (unacked) waiting for the rest of their group; "
                          "one more, and the oldest incomplete group is scored with what arrived.")
    num_threads: int = Field(8, ge=1, description="Threads that run sync reward functions, in each environment "
                             "worker (set by its first scoring).")
    reward_timeout_s: float = Field(REWARD_TIMEOUT_S, gt=0, description="How long one reward function may run "
                                    "before its score is an error (the same default as `flywheel eval`).")
    group_timeout_s: float = Field(300.0, gt=0, description="A group still incomplete this long after its first "
                                   "rollout arrived is scored with what arrived, with an error naming the "
                                   "missing rollouts.")
    run_config_ttl_s: float = Field(5.0, ge=0, description="How long a run's config, read from the runs bucket, "
                                    "is reused before it is read again.")
    ack_wait_s: float = Field(6.0, gt=0, description="How soon the rollouts a killed scorer held are delivered "
                              "to its restart; held and running ones are kept alive every third of it.")
    watch: bool = Field(True, description="The reward-hacking watch (built-in scorer only): flag rollouts whose "
                        "reward looks gamed (reward up while a metric falls, reward following length or "
                        "repetition, one completion for many tasks, a component pinned at its maximum while "
                        "another falls) with a `watch` score of weight 0.")


class RecorderSettings(_Section):
    """The recorder (the gateway's second process): how it batches its writes (section ``[recorder]``)."""

    # One batch in flight per stream: SQLite takes one writer at a time anyway, and measured
    # (20k rollouts, 2 cores) one batch of 512 records ~4,200/s where four of 256 record ~3,400/s.
    batch_size: int = Field(512, ge=1, description="Events written to the trace store in one transaction, "
                            "per stream.")
    max_in_flight: int = Field(512, ge=1, description="Events delivered and not yet recorded, per stream.")
    ack_wait_s: float = Field(10.0, gt=0, description="How soon what a killed recorder had received and not "
                              "recorded is delivered again (a batch still being written is kept alive).")
    # While a run trains, messages trickle in (a group's rollouts, then its scores), mostly one per
    # fetch. Measured on SQLite with a training run's messages: 2.7 ms of CPU a message written one
    # transaction each, 1.4 ms sixteen to a transaction.
    linger_s: float = Field(0.1, ge=0, description="How long a write waits for more events, from every stream, "
                            "before it goes: what arrives meanwhile is written in the same transaction (0: each "
                            "fetched batch at once). The trace store lags the bus by this much at most.")


class SandboxSettings(_Section):
    """The sandbox service's limits on requests, output and files (section ``[sandbox]``; its caps
    and backend are the flat ``sandbox_*`` settings)."""

    max_requests_in_flight: int = Field(1024, ge=1, description="Requests one sandbox service handles at once; "
                                        "one more is answered with error kind `capacity` at once.")
    max_output_bytes: int = Field(64 * 1024, ge=1, description="Output kept per stream (stdout, stderr) of one "
                                  "exec; the rest is cut and the result says so.")
    max_file_bytes: int = Field(512 * 1024, ge=1, description="Largest file written or read in one request "
                                "(a NATS message carries about 1 MB).")
    exec_grace_s: float = Field(2.0, ge=0, description="How long past an exec's own timeout_s the service waits "
                                "for the sandbox's answer before it destroys the whole sandbox.")
    reap_interval_s: float = Field(0.1, gt=0, description="How often expired sandboxes are destroyed and the "
                                   "warm pool is topped up.")
    num_tombstones: int = Field(4096, ge=0, description="Destroyed sandboxes remembered, so that a request for "
                                "one says it was destroyed and why (not that it is unknown).")
    build_timeout_s: float = Field(600.0, gt=0, le=3600, description="Longest image build (docker backend, a "
                                   "build request's Dockerfile): past it the build is stopped and the request "
                                   "answered with an error that says so.")
    build_max_mb: int = Field(4096, ge=1, description="Largest image a build may make (docker backend); a bigger "
                              "one is removed and the request answered with its size and this limit.")
    build_network: bool = Field(False, description="Whether a build's RUN steps reach the network (the engine's "
                                "default network). Off: they have none, as a sandbox has none; a Dockerfile that "
                                "downloads (apt-get, pip) then fails and says where.")


class WorkersSettings(_Section):
    """Environment workers: the sandboxed processes environment code runs in, started by every
    process that needs an environment (section ``[workers]``)."""

    isolation: Literal["bubblewrap", "none"] = Field("bubblewrap", description="How a worker is isolated: "
                                                     "bubblewrap (no network, no credential, read-only view of the "
                                                     "packages it runs, an unprivileged user of its own when the "
                                                     "service runs as root), or none (a plain process that sees "
                                                     "this machine's files: only for your own code on a machine "
                                                     "only you use).")
    memory_mb: int = Field(2048, ge=64, description="Memory of one worker, every process in it together (a memory "
                        "cgroup where one can be made; else the address space of each process).")
    pids: int = Field(256, ge=8, description="Processes and threads of one worker.")
    cpu: NonNegativeFloat = Field(0.0, description="CPU cores one worker may use (a cpu cgroup where one can be "
                                  "made); 0: no cap.")
    disk_mb: int = Field(512, ge=1, description="Size of each of a worker's writable folders (/work, /tmp, "
                         "/dev/shm; each a tmpfs, counted in its memory).")
    read_only: tuple[str, ...] = Field((), description="Host folders every worker sees, read-only, besides its "
                                       "interpreter and packages: where environments read files given in their args "
                                       "(a task file, a folder of tasks). A folder closed to other users stays "
                                       "unseen where the services run as root (workers run as users of their own).")
    start_timeout_s: float = Field(60.0, gt=0, description="How long a worker may take to start and answer.")
    idle_s: float = Field(300.0, gt=0, description="A worker with nothing to do this long is stopped (started "
                          "again when its environment is next needed).")
    max_per_environment: int = Field(2, ge=1, description="Workers of one environment version (per tenant) in "
                                     "one process: another starts when each one holds max_calls calls.")
    max_calls: int = Field(256, ge=1, description="Calls (rollouts, scorings, ...) one worker holds before its "
                           "environment gets another worker, up to max_per_environment.")
    unresponsive_s: float = Field(30.0, gt=0, description="A worker whose event loop does not answer for this "
                                  "long (environment code blocking it) is killed; its calls fail, each saying so.")
    uid_base: int = Field(300_000, ge=1000, description="First of the user ids workers run as (when the service "
                          "runs as root): each worker takes one of num_uids, never one another process holds.")
    num_uids: int = Field(4096, ge=1, description="How many user ids from uid_base workers may take.")


class QuotaSettings(_Section):
    """What one tenant may start over the gateway's API (section ``[quotas]``); 0: no limit. A
    request over one is answered 429, naming it. Rollouts in flight are bounded per tenant by
    ``inference.tenant_max_rollouts_in_flight`` (a run over it waits, and says so)."""

    runs: int = Field(0, ge=0, description="Runs of one tenant not ended (created, running, paused) at once; "
                      "POST /v1/runs past it is refused.")
    trained_tokens_per_day: int = Field(0, ge=0, description="Tokens one tenant's runs trained on (RL and SFT) "
                                        "since 00:00 UTC; past it POST /v1/runs is refused until the next day.")


class PriceSettings(_Section):
    """The gateway's price table, turning metered tokens into cost in ``GET /v1/usage``
    (section ``[prices]``): a price per million tokens of each kind, in ``currency``. Zero:
    the report gives tokens and a cost of 0."""

    currency: str = Field("USD", min_length=1, description="What the prices are in (a label: the report repeats it).")
    prompt_per_mtok: NonNegativeFloat = Field(0.0, description="Price of a million prompt tokens: every model "
                                              "call's whole prompt, in rollouts and on the OpenAI API.")
    sampled_per_mtok: NonNegativeFloat = Field(0.0, description="Price of a million sampled tokens.")
    trained_per_mtok: NonNegativeFloat = Field(0.0, description="Price of a million trained tokens: the tokens "
                                               "under the loss in a training step (a rollout's sampled tokens, "
                                               "and reference answers of SFT).")
    sandbox_per_hour: NonNegativeFloat = Field(0.0, description="Price of an hour of a rollout's sandbox.")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_", env_nested_delimiter="__", extra="forbid")

    data_dir: Path = Field(Path(".flywheel"), description="Where the embedded stack keeps its state: NATS store, "
                                                          "SQLite file, logs, run folders.")
    nats_url: str | None = Field(None, description="An existing NATS server with JetStream. Unset: `flywheel up` "
                                                   "starts its own.")
    nats_port: int = Field(4233, description="Port of the nats-server that `flywheel up` starts (when nats_url is "
                                             "unset).")
    nats_cluster: int = Field(1, ge=1, le=9, description="Nodes of the nats-server that `flywheel up` starts: 3 runs a "
                              "JetStream cluster on loopback (client ports nats_port to nats_port+2), each stream, KV "
                              "bucket and object store kept on every node, so the bus outlives a node's loss. With "
                              "nats_url (a cluster of your own): the replicas `flywheel up` makes the streams with.")
    nats_user: str | None = Field(None, description="The NATS user to log in as (with nats_password); a deployment "
                                                    "gives each service its own (flywheel.contract.natsusers). Unset: "
                                                    "the user in nats_url, or the operator of `flywheel up`'s server.")
    nats_password: str | None = Field(None, description="The password of nats_user.")
    nats_trainer_password: str | None = Field(None, description="The orchestrator's: the password of NATS user "
                                              "`trainer`, the login of the trainers it starts (never its own). Unset "
                                              "where the orchestrator logs in as a user: it refuses to start.")
    trusted_modules: list[str] = Field(default_factory=list, description="Modules (and their submodules) whose "
                                       "objects a run config may name by import path (`type = \"mypkg.losses:"
                                       "my_loss\"`): the services that read a run's config import them, holding a "
                                       "NATS login, so only code the operator trusts. Default: none, only the "
                                       "built-in types.")
    database_url: str | None = Field(None, description="SQLAlchemy async URL of the trace store. Unset: SQLite in "
                                                       "data_dir.")
    auth: Literal["open", "keys"] = Field("open", description="keys: every HTTP API call (gateway, inference) "
                                          "needs a tenant's API key (`flywheel keys create`); open: no keys, every "
                                          "caller may do everything, allowed on loopback addresses only (a service "
                                          "listening elsewhere refuses to start open).")
    api_key: str | None = Field(None, description="The API key the Python client (TraceAPI) sends to a gateway "
                                                  "that wants keys (`flywheel keys create` prints one).")
    service_token: str | None = Field(None, description="With auth = keys: a secret the deployment's own services "
                                                        "share, which sees every tenant's runs (the orchestrator's "
                                                        "evals call inference with it). Unset: none is accepted.")
    gateway_host: str = Field("127.0.0.1", description="Address the gateway's HTTP API listens on.")
    gateway_port: int = Field(8420, description="Port the gateway's HTTP API listens on.")
    gateway_url: str | None = Field(None, description="Where clients reach the gateway. Unset: "
                                                      "http://gateway_host:gateway_port.")
    gateway_max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024, description="Largest request body the gateway "
                                        "reads; a larger one is refused with 413 (each task must also fit the bus's "
                                        "max payload).")
    inference_host: str = Field("127.0.0.1", description="Address the inference service's OpenAI-compatible API "
                                                         "listens on.")
    inference_port: int = Field(8421, description="Port of the inference service's OpenAI-compatible API.")
    training_api_host: str = Field("127.0.0.1", description="Address the Tinker-compatible training API "
                                   "(python -m flywheel_trainer.tinker_api) listens on; open: loopback only.")
    training_api_port: int = Field(8430, description="Port of the Tinker-compatible training API.")
    inference_url: str | None = Field(None, description="Where the orchestrator reaches the inference API for the "
                                                        "evals of its runs, ending in /v1. Unset: "
                                                        "http://inference_host:inference_port/v1 (a host of 0.0.0.0 "
                                                        "read as 127.0.0.1).")
    torch_threads: int | None = Field(
        1, description="Threads torch may use in inference and trainer processes. 1 suits one machine where they "
                       "share the cores (measured: several times faster than torch's default there); unset: torch "
                       "decides.")
    fork_services: bool = Field(
        True, description="`flywheel up` starts its Python services, and a run's trainer, as forks of one process "
                          "that imported their packages once (torch and transformers included), not each as a new "
                          "interpreter: on a machine of few cores the first training step comes seconds sooner "
                          "(flywheel.runtime.forkserver). false: each imports its own.")
    sandbox_backend: Literal["local", "docker"] = Field(
        "local", description="Where the sandbox service runs code: local (bubblewrap) or docker (a Docker engine).")
    sandbox_image: str = Field("flywheel-sandbox:latest", description="Docker image of sandboxes (docker backend); "
                                                                    "it needs python3.")
    sandbox_max_alive: int = Field(64, ge=1, description="Sandboxes one sandbox service holds at once; more are "
                                                         "refused.")
    sandbox_max_starting: int = Field(4, ge=1, description="Sandboxes being started at once; more wait.")
    sandbox_warm_pool: int = Field(4, ge=0, description="Sandboxes of the default spec kept started, for fast creates.")
    sandbox_allow_network: bool = Field(False, description="Whether a sandbox may ask for network (a spec with "
                                                           "network=true); off, such a request is refused.")
    sandbox_python_path: str = Field(
        "auto", description="Folders of Python packages the local backend binds read-only into every sandbox, on "
                            "PYTHONPATH, for what the host's /usr Python lacks (the openai or anthropic SDK of an "
                            "agent run in a sandbox): folders separated by ':', or auto (the service's own "
                            "site-packages when its Python has the minor version of /usr/bin/python3, else none), "
                            "or empty for none.")
    sandbox_relay_dir: str | None = Field(
        None, description="Folder where the sandbox service makes the Unix socket of each sandbox's model relay (a "
                          "spec with a model_url). The docker backend binds it into the container, so the engine's "
                          "host must see it at the same path (compose binds one); unset: the system's temporary "
                          "folder.")
    run_lease_s: float = Field(60.0, gt=0, description="How long a run outlives its owner (an orchestrator): past "
                                                       "this without a renewal the run is abandoned (its queued "
                                                       "tasks stop holding inference) and another orchestrator may "
                                                       "take it over.")
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Port each service process serves its Prometheus metrics on, at /metrics "
                                          "(queue depth and lag of each consumer, tokens sampled, admission, "
                                          "scoring and step times, HTTP requests). Unset: not served; 0: a free "
                                          "port, named in the process's heartbeat (flywheel status). `flywheel up` "
                                          "gives its services this port and the ports after it, in start order, and "
                                          "a run's trainer a free one.")
    metrics_host: str = Field("127.0.0.1", description="Address the metrics of metrics_port listen on (0.0.0.0: "
                                                       "every address, for a scraper on another machine or "
                                                       "container).")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level of every "
                                                                                   "service process.")
    inference: InferenceSettings = Field(default_factory=InferenceSettings,
                                         description="The inference process's bounds and timeouts.")
    trainer: TrainerSettings = Field(default_factory=TrainerSettings,
                                     description="The trainer process's micro-batches and bounds.")
    scorer: ScorerSettings = Field(default_factory=ScorerSettings, description="A scorer process's bounds.")
    recorder: RecorderSettings = Field(default_factory=RecorderSettings, description="The recorder's batching.")
    sandbox: SandboxSettings = Field(default_factory=SandboxSettings,
                                     description="The sandbox service's limits on requests, output and files.")
    workers: WorkersSettings = Field(default_factory=WorkersSettings,
                                     description="Environment workers: isolation, limits, scaling.")
    prices: PriceSettings = Field(default_factory=PriceSettings, description="The price table of the gateway's "
                                  "usage report.")
    quotas: QuotaSettings = Field(default_factory=QuotaSettings, description="What one tenant may start over the "
                                  "gateway's API.")

    @classmethod
    def load(cls, **overrides: object) -> Settings:
        """The settings from FLYWHEEL_* and FLYWHEEL_CONFIG's file, ``overrides`` on top (a
        command's options); a bad value is a ValueError naming the setting and where to set it."""
        try:
            return cls(**overrides)  # type: ignore[arg-type]  # field values: pydantic validates them just below
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}"
                                 for e in exc.errors())
            nested = next(("__".join(map(str, e["loc"][:2])).upper() for e in exc.errors()
                           if len(e["loc"]) > 1 and e["loc"][0] in SECTIONS), None)
            how = f" (a section's field is FLYWHEEL_<SECTION>__<FIELD>: FLYWHEEL_{nested})" if nested else ""
            raise ValueError(f"bad settings ({problems}); check the options, FLYWHEEL_* variables{how} "
                             "and FLYWHEEL_CONFIG") from exc

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = os.environ.get("FLYWHEEL_CONFIG")
        if config_file:
            if not Path(config_file).is_file():
                raise ValueError(f"FLYWHEEL_CONFIG={config_file!r}: no such file")
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=config_file))
        return tuple(sources)

    @field_validator("nats_url")
    @classmethod
    def _check_nats_url(cls, v: str | None) -> str | None:
        for part in (v.split(",") if v is not None else []):
            if not part.strip().startswith(("nats://", "tls://", "ws://", "wss://")):
                raise ValueError(f"nats_url must start with nats://, tls://, ws:// or wss:// (a cluster's nodes "
                                 f"comma-separated, each so), got {part.strip()!r} in {v!r}")
        return v

    @property
    def nats_ports(self) -> list[int]:
        """The client ports of ``flywheel up``'s own nats-server, one a node."""
        return [self.nats_port + i for i in range(self.nats_cluster)]

    @property
    def nats_server_url(self) -> str:
        """Where the NATS server is, without a login: ``nats_url``, or ``flywheel up``'s own (each
        node of its cluster, comma-separated)."""
        return self.nats_url or ",".join(f"nats://127.0.0.1:{port}" for port in self.nats_ports)

    @property
    def resolved_nats_url(self) -> str:
        """``nats_url`` (unset: the nats-server ``flywheel up`` runs for ``data_dir``), logging in as
        ``nats_user``, or else on that server as its operator when the stack made users
        (:mod:`flywheel.contract.natsusers`)."""
        url = self.nats_server_url
        if self.nats_user:
            return natsusers.with_user(url, self.nats_user, self.nats_password or "")
        passwords = None if self.nats_url else natsusers.read(self.data_dir)
        return natsusers.with_user(url, natsusers.OPERATOR, passwords[natsusers.OPERATOR]) if passwords else url

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite+aiosqlite:///{(self.data_dir / 'flywheel.db').resolve()}"

    @property
    def resolved_gateway_url(self) -> str:
        return self.gateway_url or f"http://{self.gateway_host}:{self.gateway_port}"

    @property
    def resolved_inference_url(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.inference_host, self.inference_host)
        return self.inference_url or f"http://{host}:{self.inference_port}/v1"


SECTIONS: tuple[str, ...] = tuple(name for name, f in Settings.model_fields.items()
                                  if isinstance(f.annotation, type) and issubclass(f.annotation, _Section))
