"""Evaluating: ``flywheel eval``, ``flywheel optimize`` and ``flywheel scorer`` (a custom scorer)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from flywheel.ops.commands.options import NATS_SETTINGS, add_settings, settings_from
from flywheel.ops.eval import format_summary


def add(commands: Any) -> None:
    """Add this module's commands to ``commands`` (the parser's subparsers)."""
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
    add_settings(scorer, NATS_SETTINGS + ("log_level",))
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
    add_settings(evaluate, ("data_dir", "inference_host", "inference_port", "gateway_url") + NATS_SETTINGS)
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
    add_settings(opt, ("data_dir", "inference_host", "inference_port"))
    opt.set_defaults(func=cmd_optimize)



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
