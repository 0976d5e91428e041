"""Baseline: Hugging Face TRL's GRPOTrainer on reverse-text or a reasoning-gym task, on CPU, step by step.

    .venv-trl/bin/python benchmarks/trl_grpo.py --model DIR --tasks TASKS.jsonl --seed S --steps N \\
        --out OUT.jsonl [--reward reverse-text|reasoning-gym] [--latency none|lognormal] \\
        [--group-size 16] [--prompts-per-step 8] [--lr 5e-4] [--max-tokens 16] [--threads 1]

The other half of a comparison with Flywheel: the same model, tasks, reward and GRPO
algorithm, trained by TRL instead (``.venv-trl``, built by ``scripts/setup-trl.sh``). This
script imports nothing from Flywheel (stdlib, torch, transformers, datasets and trl only),
so the run measures TRL alone. What it measures: wall seconds and CPU seconds per optimizer
step, start-up time, memory, and the reward curve (to check that both sides learn alike).

Inputs:

- ``--model DIR``: a Hugging Face folder with a chat template (Flywheel writes the tiny
  model's: ``flywheel.sdk.models.resolve_model('tiny', data_dir)``); loaded in float32 on CPU.
- ``--tasks``: JSONL, one task a line, in the order the file gives (the trainer shuffles
  them, by ``--seed``)::

      {"prompt": [{"role": "system", "content": "Reverse the text."},
                  {"role": "user", "content": "abcd"}], "text": "abcd"}

  Conversational prompts: TRL renders them with the chat template and the generation prompt.

Reward (``--reward reverse-text``, the default): ``difflib.SequenceMatcher(None,
completion.strip(), text[::-1]).ratio()``, the content of the assistant message; ``exact``
(``completion.strip() == text[::-1]``) is a second reward function of weight 0, so TRL logs it
without training on it.

``--reward reasoning-gym``: the tasks are reasoning-gym's, a row ``{"prompt": [...], "rg":
"<JSON>"}`` whose ``rg`` names the item (``task``, ``config``, ``seed``, ``size``, ``index``,
``question``: Flywheel's ``reasoning_tasks`` rows); the reward ``score`` regenerates the item
(``reasoning_gym.create_dataset(task, seed=seed, size=size, **config)[index]``, its question
checked) and scores the text of the reply's last ``<answer>...</answer>`` with the task's own
``score_answer`` (no tags, or an answer its scorer cannot read, scores 0), as Flywheel's
environment does; ``correct`` (the score is 1) has weight 0. A ``composite`` task is not read.

``--latency lognormal`` makes each completion's reward wait ``min(1.0, exp(N(ln 0.05, 1.0)))``
seconds (median 50 ms, capped at 1 s; seeded by ``f"{seed}-{step}-{index}"``: the same waits
in every run of a seed), as a remote scorer or sandbox would. TRL 1.16 accepts ``async``
reward functions: it runs them on an event loop in a daemon thread and awaits them with
``asyncio.gather`` (``GRPOTrainer._calculate_rewards``). So the similarity reward is an
``async def`` that awaits the waits of all 128 completions of the step together: a step
waits about as long as its slowest completion, not the sum. TRL scores only after the
whole batch is generated and trains only after it is scored (it is synchronous), which is
what the comparison with Flywheel's asynchronous pipeline is about.

Output (``--out``, one JSON object a line, each flushed as written):

- first ``{"event": "start", "t", "cpu_s", "rss_mb"}``, when training begins (after the
  imports, the model, the dataset and the trainer are built);
- then one line per optimizer step: ``{"step", "t", "reward", "exact", "cpu_s", "rss_mb",
  "peak_rss_mb"}``;
- last ``{"event": "end", "t", "cpu_s", "rss_mb", "peak_rss_mb", "steps"}``.

Keys:

- ``step``: the optimizer step, from 1 (TRL's ``global_step`` after that step);
- ``t``: wall seconds from the start of this process (the script's first statement, before
  the heavy imports; the interpreter's own start-up, tens of ms, is before it) to the end
  of the step (``on_step_end``) or the event. ``t`` of step 1 includes start-up; per-step
  seconds are differences of ``t``;
- ``reward``: mean reward of the step's completions (``--prompts-per-step`` x
  ``--group-size``, 128 by default), as TRL logs it (``rewards/similarity/mean``, or
  ``rewards/similarity_after_wait/mean`` with ``--latency lognormal``);
- ``exact``: the fraction of those completions that are exactly the reversed text (with
  ``--reward reasoning-gym``: that are correct);
- ``completion_tokens``: tokens of the step's completions (TRL's ``completions/mean_length``
  times their number): what the step trained on;
- ``cpu_s``: user + system CPU seconds of this process since it started, all threads
  (``getrusage(RUSAGE_SELF)``);
- ``rss_mb``: resident memory of the process now, MiB; ``peak_rss_mb``: its peak so far;
- ``steps``: optimizer steps done.

Each step also prints one line to stdout.

The GRPO settings (``grpo_config``) follow Flywheel's algorithm: 8 prompts x 16 completions
per optimizer step, one optimizer step per generated batch, on policy (ratio 1),
advantages = reward - group mean (no std), PPO clipping at 0.2, loss summed over the
completion tokens of the whole batch and divided by their number, AdamW with weight decay 0
at a constant learning rate, gradients clipped to norm 1, no KL term, sampling at
temperature 1, top-p 1, no top-k, at most 16 new tokens. Where TRL cannot match, the
function says so.
"""

import time

t0 = time.monotonic()  # first: start-up is measured from here, before the heavy imports

import argparse  # noqa: E402
import asyncio  # noqa: E402
import difflib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import resource  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model folder with a chat template")
    p.add_argument("--tasks", required=True, help="JSONL of {prompt: [messages], text} (or rg: see --reward)")
    p.add_argument("--reward", choices=["reverse-text", "reasoning-gym"], default="reverse-text",
                   help="what scores a completion (see the module's docs)")
    p.add_argument("--seed", type=int, required=True, help="seeds TRL (sampling, task order) and the latencies")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps")
    p.add_argument("--out", required=True, help="JSONL written: a start line, one line per step, an end line")
    p.add_argument("--latency", choices=["none", "lognormal"], default="none",
                   help="a wait per completion's reward (lognormal: median 50 ms, capped at 1 s)")
    p.add_argument("--group-size", type=int, default=16, help="completions per prompt")
    p.add_argument("--prompts-per-step", type=int, default=8, help="prompts per optimizer step")
    p.add_argument("--lr", type=float, default=5e-4, help="learning rate (constant)")
    p.add_argument("--max-tokens", type=int, default=16, help="new tokens per completion at most")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return p.parse_args()


# Parsed before torch is imported, so the thread count is set right after the import, before
# transformers and trl import (and before any op runs); `--help` answers without torch.
ARGS = parse_args()

import torch  # noqa: E402

torch.set_num_threads(ARGS.threads)

# trl is only in .venv-trl: the static checks run in .venv, without it (hence the ignores).
import datasets  # noqa: E402
import transformers  # noqa: E402
import trl  # type: ignore[import-not-found]  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

LATENCY_MEDIAN_S = 0.05  # lognormal: median of the wait, seconds
LATENCY_SIGMA = 1.0  # lognormal: sigma of the log of the wait
LATENCY_CAP_S = 1.0  # no wait is longer


def load_tasks(path: str, reward: str) -> datasets.Dataset:
    """The tasks in the file's order: columns ``prompt`` (messages) and ``text`` (reverse-text)
    or ``rg`` (reasoning-gym: the item, as JSON text)."""
    column = "text" if reward == "reverse-text" else "rg"
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows.append({"prompt": row["prompt"], column: row[column]})
    return datasets.Dataset.from_list(rows)


def _content(completion: list[dict] | str) -> str:
    # Conversational prompts give conversational completions: [{"role": "assistant", "content": ...}].
    return completion[-1]["content"] if isinstance(completion, list) else completion


def _similarity(completion: list[dict] | str, text: str) -> float:
    return difflib.SequenceMatcher(None, _content(completion).strip(), text[::-1]).ratio()


def exact(completions: list, text: list[str], **kwargs: Any) -> list[float]:
    """Logged as ``rewards/exact/mean``; weight 0: not trained on."""
    return [float(_content(c).strip() == t[::-1]) for c, t in zip(completions, text, strict=True)]


_RG_DATASETS: dict[str, Any] = {}


def _rg_score(completion: str, item: dict) -> float:
    """reasoning-gym's ``score_answer`` of the reply's last answer tags on the item ``item`` names."""
    import reasoning_gym  # in .venv-trl (and .venv's reasoning extra)
    from reasoning_gym.utils import extract_answer

    key = json.dumps([item["task"], item["config"], item["seed"], item["size"]], sort_keys=True)
    if key not in _RG_DATASETS:
        _RG_DATASETS[key] = reasoning_gym.create_dataset(item["task"], seed=item["seed"], size=item["size"],
                                                         **item["config"])
    dataset = _RG_DATASETS[key]
    entry = dataset[item["index"]]
    if entry["question"] != item["question"]:
        raise ValueError(f"reasoning-gym generates another question for {item}: another version or config")
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    try:
        return float(dataset.score_answer(answer, entry))
    except Exception:  # an answer its scorer cannot read is a wrong one (as in Flywheel's environment)
        return 0.0


def score(completions: list, rg: list[str], **kwargs: Any) -> list[float]:
    """reasoning-gym's score of each completion: the reward trained on."""
    return [_rg_score(_content(c), json.loads(r)) for c, r in zip(completions, rg, strict=True)]


def correct(completions: list, rg: list[str], **kwargs: Any) -> list[float]:
    """Logged as ``rewards/correct/mean``; weight 0: not trained on."""
    return [float(_rg_score(_content(c), json.loads(r)) == 1.0) for c, r in zip(completions, rg, strict=True)]


def reward_functions(args: argparse.Namespace) -> list[Callable[..., Any]]:
    """The reward TRL trains on, then the metric it logs at weight 0."""
    if args.reward == "reasoning-gym":
        if args.latency != "none":
            raise SystemExit("--latency lognormal is for --reward reverse-text")
        return [score, correct]
    return [make_similarity(args.latency, args.seed), exact]


def make_similarity(latency: str, seed: int) -> Callable[..., Any]:
    """The reward TRL trains on. TRL logs it as ``rewards/<function name>/mean``: ``similarity``,
    or ``similarity_after_wait`` with ``latency == "lognormal"``: an async function that
    awaits one seeded wait per completion, all of the batch's waits at once
    (``asyncio.gather``), then scores."""
    if latency == "none":
        def similarity(completions: list, text: list[str], **kwargs: Any) -> list[float]:
            return [_similarity(c, t) for c, t in zip(completions, text, strict=True)]
        return similarity

    async def similarity_after_wait(completions: list, text: list[str], trainer_state: Any,
                                    **kwargs: Any) -> list[float]:
        step = trainer_state.global_step  # optimizer steps done before this batch: 0 for the first

        async def one(index: int, completion: list[dict] | str, t: str) -> float:
            rng = random.Random(f"{seed}-{step}-{index}")
            await asyncio.sleep(min(LATENCY_CAP_S, rng.lognormvariate(math.log(LATENCY_MEDIAN_S), LATENCY_SIGMA)))
            return _similarity(completion, t)

        pairs = zip(completions, text, strict=True)
        return list(await asyncio.gather(*(one(i, c, t) for i, (c, t) in enumerate(pairs))))
    return similarity_after_wait


def grpo_config(args: argparse.Namespace, output_dir: str) -> GRPOConfig:
    batch = args.prompts_per_step * args.group_size  # completions per optimizer step: 128
    return GRPOConfig(
        output_dir=output_dir,  # stays empty: nothing is saved (save_strategy "no", report_to none)
        # One generation batch of `batch` completions (prompts_per_step prompts x group_size)
        # per optimizer step, trained in one forward/backward, no accumulation: the loss and
        # gradient are those of the whole step.
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        generation_batch_size=batch,
        num_generations=args.group_size,
        num_iterations=1,  # each batch trains once: on policy, the importance ratio is exactly 1
        max_steps=args.steps,
        # Optimizer: AdamW (betas 0.9/0.999, eps 1e-8) with weight decay 0, as Flywheel's
        # torch engine; constant learning rate, no warm-up; gradients clipped to norm 1.
        optim="adamw_torch",
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
        # Sampling: temperature 1, top-p 1, top-k off (0), at most max_tokens new tokens,
        # ending at the model's EOS (which counts as a completion token, as in Flywheel).
        # Not matched: Flywheel seeds one torch.Generator per rollout; TRL samples the whole
        # batch with the global RNG (seeded once by `seed`), so the same seed does not draw
        # the same completions on both sides.
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_completion_length=args.max_tokens,
        # Algorithm: no KL term (no reference model); advantage = reward - group mean, not
        # divided by the group's std; PPO's clipped surrogate at eps 0.2 (inactive on policy);
        # "dapo": per-token losses summed over the batch and divided by the number of
        # completion tokens in the whole generation batch ("bnpo" divides by the local
        # micro-batch's; the same here, with one micro-batch). Truncated completions train.
        # Not matched: Flywheel's ratio is against the logprobs inference sampled with, ~1
        # but not exactly 1 on the same weights; here it is exactly 1, so nothing clips.
        beta=0.0,
        scale_rewards="none",
        loss_type="dapo",
        epsilon=0.2,
        mask_truncated_completions=False,
        reward_weights=[1.0, 0.0],  # the reward (similarity or score), then its metric (exact or correct)
        # CPU, float32, one process, no vLLM; no activation (gradient) checkpointing: GRPOConfig
        # turns it on by default; Flywheel does not use it, and it only costs time on a model
        # this small. (`gradient_checkpointing` is the deprecated name in transformers 5.)
        use_cpu=True,
        bf16=False,
        fp16=False,
        use_vllm=False,
        activation_checkpointing=False,
        dataloader_num_workers=0,
        # Task order: TRL shuffles the dataset with `seed`. Not matched: Flywheel draws its own
        # order from its task seed, so the two runs see the tasks in different orders.
        seed=args.seed,
        data_seed=args.seed,
        shuffle_dataset=True,
        # Every step logged (the callback reads the rewards from the logs), nothing else.
        logging_steps=1,
        logging_strategy="steps",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        log_completions=False,
    )


def rss_mb() -> float:
    """Resident memory now, MiB (Linux: /proc/self/statm; elsewhere the peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return peak_rss_mb()


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class StepLog(TrainerCallback):
    """Writes the JSONL lines: the time and resources at each step's end, the rewards from
    the log line TRL writes right after it (logging_steps=1), matched by step number."""

    def __init__(self, path: str, reward_name: str, metric_name: str, batch: int):
        self.out = open(path, "w", encoding="utf-8")  # closed by on_train_end
        self.reward_key = f"rewards/{reward_name}/mean"
        self.metric_key = f"rewards/{metric_name}/mean"
        self.batch = batch
        self.at_step_end: dict[int, dict] = {}

    def _write(self, record: dict) -> None:
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()

    def _now(self) -> dict:
        return {"t": round(time.monotonic() - t0, 4), "cpu_s": round(cpu_s(), 3), "rss_mb": round(rss_mb(), 1)}

    def on_train_begin(self, args, state, control, **kwargs):
        self._write({"event": "start", **self._now()})

    def on_step_end(self, args, state, control, **kwargs):
        self.at_step_end[state.global_step] = self._now()

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if self.reward_key not in logs:  # the summary log at the end of training
            return
        step = state.global_step
        now = self.at_step_end.pop(step)
        record = {"step": step, "t": now["t"], "reward": logs[self.reward_key],
                  "exact": logs[self.metric_key], "cpu_s": now["cpu_s"], "rss_mb": now["rss_mb"],
                  "completion_tokens": round(logs["completions/mean_length"] * self.batch),
                  "peak_rss_mb": round(peak_rss_mb(), 1)}
        self._write(record)
        print(f"step {step}: t {record['t']:.2f}s reward {record['reward']:.4f} exact {record['exact']:.3f} "
              f"cpu {record['cpu_s']:.1f}s rss {record['rss_mb']:.0f}MiB", flush=True)

    def on_train_end(self, args, state, control, **kwargs):
        self._write({"event": "end", **self._now(), "peak_rss_mb": round(peak_rss_mb(), 1),
                     "steps": state.global_step})
        self.out.close()


def main(args: argparse.Namespace) -> None:
    print(f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    rewards = reward_functions(args)
    log = StepLog(args.out, rewards[0].__name__, rewards[1].__name__, args.prompts_per_step * args.group_size)
    with tempfile.TemporaryDirectory(prefix="trl_grpo-") as output_dir:
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=rewards,
            args=grpo_config(args, output_dir),
            train_dataset=load_tasks(args.tasks, args.reward),
            processing_class=tokenizer,
            callbacks=[log],
        )
        # With disable_tqdm the trainer prints every log dict; stdout keeps the step lines only.
        trainer.remove_callback(PrinterCallback)
        trainer.train()


if __name__ == "__main__":
    main(ARGS)
