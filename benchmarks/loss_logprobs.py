"""The trainer's logprobs three ways on a real model: the whole head, the loss's positions alone, and packed.

    python benchmarks/loss_logprobs.py --json out/loss_logprobs.json [--model smollm2] [--repeats 5]

One RL micro-batch of the shape a reasoning task gives (two prompts of 60 and 70 tokens, eight
completions each of 20 to 120 tokens, the prompt shared), forward and backward, computed three
ways in turn in one process: ``token_logprobs`` (the head and the softmax over the vocabulary at
every position), ``loss_logprobs`` (at the loss's positions alone, rows padded) and
``packed_loss_logprobs`` (the same, the rows packed without padding: ``trainer.pack``). Prints
each run's seconds and writes the minimum and median of each and the ratios
(``loss_only_over_whole``, ``packed_over_loss_only``: below 1 is faster), and the largest
difference of each one's logprobs from the whole head's (float rounding). Figures move with
the machine's load; the ratio of runs alternated in one process is what to compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from flywheel.sdk import models
from flywheel_trainer.batch import loss_logprobs, packed_loss_logprobs, pad, token_logprobs
from flywheel_trainer.join import Tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--model", default="smollm2", help="a model name (tiny, smollm2) or an HF folder")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models-dir", type=Path, default=Path(".flywheel/models"))
    args = parser.parse_args()
    model, tok = models.load_model(models.resolve_model(args.model, args.models_dir), dtype="float32")
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    seqs = []
    for prompt_length in (60, 70):
        prompt = torch.randint(3, vocab, (prompt_length,), generator=generator).tolist()
        for n in (20, 40, 60, 80, 100, 120, 30, 90):
            completion = torch.randint(3, vocab, (n,), generator=generator).tolist()
            seqs.append(Tokens(prompt + completion, [-1.0] * (prompt_length + n), [False] * prompt_length + [True] * n))
    batch = pad(seqs, [1.0] * len(seqs), tok.pad_token_id, temperatures=[1.0] * len(seqs), share_prefixes=True)
    ways = (("whole", token_logprobs), ("loss_only", loss_logprobs), ("packed", packed_loss_logprobs))
    seconds: dict[str, list[float]] = {name: [] for name, _ in ways}
    values: dict[str, torch.Tensor] = {}
    for _ in range(args.repeats):
        for name, fn in ways:
            model.zero_grad()
            started = time.perf_counter()
            logprobs = fn(model, batch)[batch.loss_mask]
            logprobs.sum().backward()
            seconds[name].append(time.perf_counter() - started)
            values[name] = logprobs.detach()
            print(f"{name}: {seconds[name][-1]:.2f}s", flush=True)
    result = {"model": args.model, "num_sequences": len(seqs), "num_loss_tokens": int(batch.loss_mask.sum()),
              "vocab_size": vocab, "repeats": args.repeats,
              **{f"{name}_min_s": round(min(s), 3) for name, s in seconds.items()},
              **{f"{name}_median_s": round(statistics.median(s), 3) for name, s in seconds.items()},
              "loss_only_over_whole": round(min(seconds["loss_only"]) / min(seconds["whole"]), 3),
              "packed_over_loss_only": round(min(seconds["packed"]) / min(seconds["loss_only"]), 3),
              "padded_tokens": int(batch.attention_mask.numel() + batch.prefix.attention_mask.numel())
              if batch.prefix is not None else int(batch.attention_mask.numel()),
              "real_tokens": batch.num_tokens,
              **{f"max_logprob_diff_{name}": float((values[name] - values["whole"]).abs().max())
                 for name in ("loss_only", "packed")}}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
