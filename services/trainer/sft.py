"""Supervised fine-tuning as a job of its own: ``flywheel sft CONFIG`` runs
``python -m flywheel_trainer.sft``.

It trains the run config's model (``model.name``) with its engine (``trainer.engine``) for
``[sft]`` ``steps`` steps of ``batch_size`` examples at ``lr``, cross-entropy on what the
assistant says, on a JSON Lines file (``sft.data``, or ``--data``), or without one on the run's
environments' reference answers (as the warm-up of a training run learns them: a quick way to
make a teacher). Each line of a file is one of:

- a chat, ``{"messages": [...]}`` in the OpenAI chat shape (``tools`` beside them when its
  calls need them): every assistant message is learned, in the context of the messages
  before it, as the model's chat template renders them (what inference gives the model);
- a line of the trace API's export (``GET /v1/rollouts/export``, filtered as the listing is,
  for example ``?run=RUN&min_reward=0.8``: a run's own best rollouts): its ``messages`` are
  a chat as above; exported with ``tokens=true`` its token layer is learned exactly as it was
  sampled (the sampled tokens in the context the model saw, no re-rendering), which is what
  rejection-sampling fine-tuning wants. A complete export's last line, ``{"end":
  {"num_rollouts": N}}``, is skipped; a cut export's ``{"error": ...}`` line is refused
  (export again). A file saved without the end line (a gateway killed mid-export, ``curl``
  cut off) cannot be told here from chats or a filtered export: check the end line where
  the file is written (``TraceAPI.export`` does).

Examples are shuffled with the run's seed (``seed``, else 0) and drawn epoch after epoch.
It writes ``<data_dir>/runs/<run>/`` as a training run does: ``config.json``,
``checkpoint/`` (every ``trainer.checkpoint_every`` steps and at the last, the newest
``trainer.keep_checkpoints`` kept: ``flywheel export RUN`` takes the weights away),
``metrics.jsonl`` (one line a step: ``loss``, tokens, ``epoch``), ``summary.json`` and
``loss.png``. No bus and no other service: the job runs where the data and the model are.
A ``datasets`` dataset (``sft.dataset``, or ``--dataset``: a hub id, a folder that
``Dataset.save_to_disk`` wrote, a folder of JSON Lines or Parquet files; ``sft.split``,
``--split``) is read row by row as lines of a file. Not covered: resuming a job part way (run
it again under a new id), packing several examples into one row, a dataset's other shapes
(prompt and completion columns: write them as chats).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from flywheel.contract.checkpoints import CheckpointState
from flywheel.contract.config import RunConfig
from flywheel.contract.service import setup_logging
from flywheel.contract.settings import Settings, WorkersSettings
from flywheel.runtime.environments import WorkerPool
from flywheel.runtime.overrides import config_with, parse_sets
from flywheel.runtime.reporting import save_plot
from flywheel.runtime.runs import load_run_environments
from flywheel.sdk import models
from flywheel.sdk.environment import EnvironmentLoadError
from flywheel_trainer.chats import DataError, batches, sft_examples
from flywheel_trainer.engines import build_engine, with_adapter
from flywheel_trainer.join import Tokens
from flywheel_trainer.learner import Example, reference_examples, reference_steps, seed_torch, sft_step
from flywheel_trainer.ledger import RunFolder


def plot_loss(steps: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path | None:
    """``loss.png``: the loss of each step; None where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([s["step"] for s in steps], [s["loss"] for s in steps], linewidth=1)
    return save_plot(fig, ax, path, title, "step", "cross-entropy per learned token")


async def references(cfg: RunConfig, workers: WorkersSettings, data_dir: Path) -> list[Example]:
    """The warm-up's reference examples of the run's environments, from their workers."""
    pool = WorkerPool(workers, data_dir, name="sft")
    try:
        envs = [found.env for found in (await load_run_environments(pool, cfg, cfg.tenant)).values()]
        return await reference_examples(envs, cfg)
    finally:
        await pool.close()


def run(cfg: RunConfig, data_dir: Path, micro_batch_size: int, micro_batch_tokens: int | None = None,
        workers: WorkersSettings | None = None) -> dict[str, Any]:
    """The job (see the module's docstring); its summary. Without ``sft.data`` or ``sft.dataset``:
    the environments' reference answers (their environments in workers of ``workers``; None: the
    defaults)."""
    assert cfg.sft.steps > 0
    folder = RunFolder(data_dir, cfg.run, cfg.trainer.keep_checkpoints)
    if folder.checkpoints.latest() is not None or folder.metrics.path.exists():
        raise ValueError(f"run {cfg.run!r} already has a folder with steps in it ({folder.root}); give the job a new "
                         "--run-id")
    started = time.perf_counter()
    seed_torch(cfg.task_seed)
    model, tok = models.load_model(models.resolve_model(cfg.model.name, data_dir), "float32")
    model = with_adapter(model, cfg.trainer)
    data = cfg.sft.data or (f"{cfg.sft.dataset} (split {cfg.sft.split})" if cfg.sft.dataset else None)
    if data is not None:
        if cfg.sft.dataset:  # a hub id may take a while to fetch, or to fail to
            print(f"sft {cfg.run}: loading the dataset {data}", flush=True)
        examples = sft_examples(cfg.sft, tok, getattr(model.config, "max_position_embeddings", None))
        source = f"{len(examples)} examples from {data}"
        drawn = batches(len(examples), cfg.sft.batch_size, cfg.task_seed)
        steps: Iterator[tuple[int, list[Tokens]]] = ((epoch, [examples[i] for i in indices])
                                                     for epoch, indices in drawn)
    else:
        given = asyncio.run(references(cfg, workers or WorkersSettings(), data_dir))
        source = f"the reference answers of {cfg.env_ids}"
        examples = [t for batch in reference_steps(tok, given, cfg) for t in batch]
        steps = ((0, examples[i:i + cfg.sft.batch_size]) for i in range(0, len(examples), cfg.sft.batch_size))
    folder.root.mkdir(parents=True, exist_ok=True)
    (folder.root / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2) + "\n")
    engine = build_engine(model, cfg.trainer.model_copy(update={"lr": cfg.sft.lr}), cfg.model.dtype)
    print(f"sft {cfg.run}: {source}, {cfg.sft.steps} steps of {cfg.sft.batch_size}, model {cfg.model.name}; run "
          f"folder {folder.root}", flush=True)

    lines: list[dict[str, Any]] = []
    for step in range(1, cfg.sft.steps + 1):
        epoch, sequences = next(steps)
        figures = sft_step(engine, sequences, tok.pad_token_id, micro_batch_size, micro_batch_tokens,
                           cfg.trainer.pack)
        line = {"step": step, "version": step, "epoch": epoch, "loss": figures["loss"],
                "num_loss_tokens": figures["num_loss_tokens"], "num_tokens": figures["num_tokens"],
                "grad_norm": figures["grad_norm"], "step_s": figures["step_s"],
                "elapsed_s": time.perf_counter() - started}
        folder.metrics.append(line)
        lines.append(line)
        print(f"sft step {step:>4}/{cfg.sft.steps}  loss {line['loss']:.4f}  epoch {epoch}  tokens "
              f"{int(line['num_loss_tokens'])}/{int(line['num_tokens'])}  t {line['elapsed_s']:.1f}s", flush=True)
        if step % cfg.trainer.checkpoint_every == 0 or step == cfg.sft.steps:
            folder.checkpoints.write(CheckpointState(step=step, version=step), engine.weights(), engine.save)
    k = max(1, len(lines) // 4)
    summary = {
        "run": cfg.run, "kind": "sft", "model": cfg.model.name, "data": data or "reference answers",
        "examples": len(examples),
        "steps": len(lines), "epochs": lines[-1]["epoch"] + 1,
        "loss_first": sum(s["loss"] for s in lines[:k]) / k, "loss_last": sum(s["loss"] for s in lines[-k:]) / k,
        "window_steps": k, "elapsed_s": time.perf_counter() - started, "run_dir": str(folder.root),
    }
    (folder.root / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_loss(lines, folder.root / "loss.png", f"{cfg.run}: supervised fine-tuning of {cfg.model.name}")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="flywheel sft",
        description="Supervised fine-tuning of a run config's model on a JSON Lines file of chats or a trace API "
                    "export; writes the run folder (checkpoints, metrics, summary, loss plot). Other settings come "
                    "from FLYWHEEL_* environment variables.")
    parser.add_argument("config", help="the run config (TOML): model, [sft], trainer.engine and checkpoints")
    parser.add_argument("--data", help="the JSON Lines file (default: sft.data of the config; neither it nor a "
                                       "dataset: the environments' reference answers, as the warm-up learns them)")
    parser.add_argument("--dataset", help="a `datasets` dataset instead: a hub id, a folder Dataset.save_to_disk "
                                          "wrote, or a folder of JSON Lines or Parquet files (default: sft.dataset)")
    parser.add_argument("--split", help="the dataset's split (default: sft.split, 'train')")
    parser.add_argument("--run-id", help="the job's run id (default: the config's run)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set sft.steps=50 (JSON values; repeatable)")
    args = parser.parse_args(argv)
    try:
        settings = Settings.load()
        cfg = config_with(args.config, parse_sets(args.set), args.run_id, settings.trusted_modules)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    if args.data and args.dataset:
        parser.error("--data and --dataset: give one of them")
    update: dict[str, Any] = {}
    if args.data or args.dataset:  # the command line's source replaces the config's
        update.update(data=args.data, dataset=args.dataset)
    if args.split:
        update["split"] = args.split
    if update:
        cfg = cfg.model_copy(update={"sft": cfg.sft.model_copy(update=update)})
    if not cfg.sft.steps:
        parser.error("sft.steps is 0: give the number of steps (--set sft.steps=200)")
    setup_logging(settings.log_level)
    try:
        summary = run(cfg, Path(settings.data_dir), settings.trainer.micro_batch_size,
                      settings.trainer.micro_batch_tokens, settings.workers)
    except (DataError, EnvironmentLoadError, ValueError) as exc:
        print(f"flywheel sft: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(f"  {k.ljust(12)}  {v:.4f}" if isinstance(v, float) else f"  {k.ljust(12)}  {v}"
                    for k, v in summary.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
