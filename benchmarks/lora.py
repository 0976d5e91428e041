"""LoRA runs on one shared base against each run on a model of its own, in the inference service's
own sampling path.

    python benchmarks/lora.py --json out/lora.json [--model tiny|smollm2|DIR] [--runs 4] [--rounds 6]
                              [--rank 16] [--group 8] [--max-tokens 24]

One process, CPU. ``--runs`` LoRA adapters (rank ``--rank`` on every attention and MLP
projection, random, so each changes what is sampled) are served two ways, as the inference
worker serves them:

- shared: one base (``TransformersBackend``) holding every adapter, one batching loop
  (``Batcher``) for every run's policy, so the runs' rows batch together, each with its own
  adapter;
- separate: one backend per run with its adapter merged into its weights, each with its own
  batching loop (what inference did for every run before adapters were shared).

Each round, every run asks for one group (``--group`` samples of one prompt, ``--max-tokens``
tokens) at once; the two ways alternate round by round so drift on a shared machine hits both.

Keys: ``shared_base_speedup_<runs>`` (seconds per round separate / shared; target >= 1.5 at 4
runs), ``shared_round_s``, ``separate_round_s``; ``adapter_swap_ms`` (median time to load a new
version of one run's adapter into the shared base, blob to usable; target <= 50) and
``full_swap_ms`` (loading full weights into a backend, the same model, for comparison);
``adapter_bytes`` (one adapter's blob), ``model_bytes`` (one full set of weights),
``shared_param_bytes`` / ``separate_param_bytes`` (weights held in memory both ways).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from flywheel.contract import events
from flywheel.sdk import models
from flywheel_inference.adapters import AdapterView
from flywheel_inference.backends import TransformersBackend
from flywheel_inference.policy import Batcher, Policy

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapter_blob(model_dir: Path, rank: int, seed: int) -> bytes:
    model = models.add_adapter(models.load_model(model_dir)[0], rank, 2 * rank, TARGETS)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return models.save_weights(model)


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


async def no_fetch(update: events.WeightUpdate) -> bytes:
    raise AssertionError("the benchmark loads weights itself")


async def round_s(policies: list[Policy], prompt: list[int], group: int, sampling: events.Sampling) -> float:
    started = time.perf_counter()
    await asyncio.gather(*(p.sample([prompt] * group, sampling) for p in policies))
    return time.perf_counter() - started


async def main(args: argparse.Namespace) -> dict[str, Any]:
    data_dir = Path(tempfile.mkdtemp(prefix="flywheel-lora-bench-"))
    model_dir = Path(models.resolve_model(args.model, data_dir))
    blobs = [adapter_blob(model_dir, args.rank, seed) for seed in range(args.runs)]
    sampling = events.Sampling(temperature=1.0, max_tokens=args.max_tokens)

    shared_backend = TransformersBackend.build(model_dir, "float32")
    batcher = Batcher(shared_backend, max_batch_size=args.runs * args.group)
    shared = [Policy(f"run{i}", AdapterView(shared_backend, f"run{i}"), no_fetch, args.group, batcher=batcher,
                     adapter=f"run{i}") for i in range(args.runs)]
    own = [TransformersBackend.build(model_dir, "float32") for _ in range(args.runs)]
    separate = [Policy(f"run{i}", backend, no_fetch, args.group) for i, backend in enumerate(own)]
    for policy in [*shared, *separate]:
        for blob in blobs:  # a few versions, as a run's updates come; the last is the run's own
            await policy.swap(blob, 0)
        await policy.swap(blobs[int(policy.run.removeprefix("run"))], 1)
    tok = shared_backend.tokenizer
    prompt = models.render_prompt(tok, [events.Message(role="user", content="Reverse the text: flywheel")])

    await round_s(shared, prompt, args.group, sampling)  # warm-up, both ways
    await round_s(separate, prompt, args.group, sampling)
    shared_s, separate_s = [], []
    for _ in range(args.rounds):
        shared_s.append(await round_s(shared, prompt, args.group, sampling))
        separate_s.append(await round_s(separate, prompt, args.group, sampling))

    swap_ms, full_ms = [], []
    full = models.save_weights(models.load_model(model_dir)[0])
    for i in range(args.rounds * 3):
        started = time.perf_counter()
        await shared[0].swap(blobs[i % len(blobs)], 2 + i)
        swap_ms.append(1000 * (time.perf_counter() - started))
        started = time.perf_counter()
        await separate[0].swap(full, 2 + i)
        full_ms.append(1000 * (time.perf_counter() - started))
    for policy in [*shared, *separate]:
        await policy.close()
    await batcher.close()

    base_bytes = param_bytes(shared_backend.model)
    adapters_held = sum(a.num_bytes for a in shared_backend.adapters.adapters.values())
    shared_round, separate_round = statistics.median(shared_s), statistics.median(separate_s)
    return {
        "model": args.model, "runs": args.runs, "rounds": args.rounds, "rank": args.rank, "group": args.group,
        "max_tokens": args.max_tokens, "torch_threads": torch.get_num_threads(),
        f"shared_base_speedup_{args.runs}": separate_round / shared_round,
        "shared_round_s": shared_round, "separate_round_s": separate_round,
        "adapter_swap_ms": statistics.median(swap_ms), "full_swap_ms": statistics.median(full_ms),
        "adapter_bytes": len(blobs[0]), "model_bytes": len(full),
        "shared_param_bytes": base_bytes + adapters_held, "separate_param_bytes": args.runs * base_bytes,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the figures")
    parser.add_argument("--model", default="tiny", help="tiny, smollm2 or a model folder")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    figures = asyncio.run(main(args))
    print(json.dumps(figures, indent=2))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(figures, indent=2) + "\n")
