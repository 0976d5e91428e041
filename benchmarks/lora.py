"""LoRA runs on one shared base against each run on a model of its own, in the inference service's
own sampling path.

    python benchmarks/lora.py --json out/lora.json [--model tiny|smollm2|DIR] [--runs 4] [--rounds 6]
                              [--rank 16] [--group 8] [--max-tokens 24] [--threads 1]

One process, CPU, ``--threads`` torch threads (default: the services' ``torch_threads``
default). ``--runs`` LoRA adapters (rank ``--rank`` on every attention and MLP projection,
random, so each changes what is sampled) are served two ways, as the inference worker serves
them:

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
``shared_param_bytes`` / ``separate_param_bytes`` (weights held in memory both ways);
``shared_rss_mb`` / ``separate_rss_mb`` (resident memory of a process of its own that holds
one way with every run's adapter loaded, after a round of sampling, as an inference process
would: one base and its adapters, or a model per run; both include what torch and
transformers take themselves).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import torch

from flywheel.contract import events
from flywheel.contract.service import compute
from flywheel.contract.settings import Settings
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


def rss_mb() -> float:
    """This process's resident memory (Linux)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


async def no_fetch(update: events.WeightUpdate) -> bytes:
    raise AssertionError("the benchmark loads weights itself")


async def load_versions(policies: list[Policy], blobs: list[bytes]) -> None:
    for policy in policies:
        for blob in blobs:  # a few versions, as a run's updates come; the last is the run's own
            await policy.swap(blob, 0)
        await policy.swap(blobs[int(policy.run.removeprefix("run"))], 1)


async def round_s(policies: list[Policy], prompt: list[int], group: int, sampling: events.Sampling) -> float:
    started = time.perf_counter()
    await asyncio.gather(*(p.sample([prompt] * group, sampling) for p in policies))
    return time.perf_counter() - started


async def build(way: str, model_dir: Path, blobs: list[bytes], group: int) -> tuple[list[Policy], Batcher | None]:
    """The runs' policies served ``way`` (shared or separate), each with its own adapter loaded;
    and the shared batching loop, if any."""
    if way == "shared":
        backend = await compute(TransformersBackend.build, model_dir, "float32")
        batcher = Batcher(backend, max_batch_size=len(blobs) * group)
        policies = [Policy(f"run{i}", AdapterView(backend, f"run{i}"), no_fetch, group, batcher=batcher,
                           adapter=f"run{i}") for i in range(len(blobs))]
    else:
        batcher = None
        policies = [Policy(f"run{i}", await compute(TransformersBackend.build, model_dir, "float32"), no_fetch, group)
                    for i in range(len(blobs))]
    await load_versions(policies, blobs)
    return policies, batcher


async def memory_mb(way: str, model_dir: Path, blob_files: list[Path], group: int, max_tokens: int) -> float:
    """This (fresh) process's resident memory once it has built ``way``, loaded its adapters and
    sampled a round (weights a model has not touched yet may not be resident)."""
    policies, _ = await build(way, model_dir, [f.read_bytes() for f in blob_files], group)
    await round_s(policies, prompt_of(policies[0]), group, events.Sampling(temperature=1.0, max_tokens=max_tokens))
    return rss_mb()


def prompt_of(policy: Policy) -> list[int]:
    return models.render_prompt(policy.backend.tokenizer,
                                [events.Message(role="user", content="Reverse the text: flywheel")])


def measure_memory(way: str, args: argparse.Namespace, model_dir: Path, blob_files: list[Path]) -> float:
    """:func:`memory_mb` in a process of its own (memory freed in this one would be reused)."""
    command = [sys.executable, __file__, "--json", "-", "--memory-of", way, "--model", str(model_dir),
               "--threads", str(args.threads), "--group", str(args.group), "--max-tokens", str(args.max_tokens),
               *map(str, blob_files)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


async def main(args: argparse.Namespace) -> dict[str, Any]:
    data_dir = Path(tempfile.mkdtemp(prefix="flywheel-lora-bench-"))
    model_dir = Path(await compute(models.resolve_model, args.model, data_dir))
    # Every torch call of this process on the one compute thread, as in the services (see compute).
    blobs = [await compute(adapter_blob, model_dir, args.rank, seed) for seed in range(args.runs)]
    sampling = events.Sampling(temperature=1.0, max_tokens=args.max_tokens)

    blob_files = []
    for i, blob in enumerate(blobs):
        blob_files.append(data_dir / f"adapter{i}.safetensors")
        blob_files[-1].write_bytes(blob)
    rss = {way: measure_memory(way, args, model_dir, blob_files) for way in ("shared", "separate")}

    shared, batcher = await build("shared", model_dir, blobs, args.group)
    assert batcher is not None
    separate, _ = await build("separate", model_dir, blobs, args.group)
    shared_backend = cast(AdapterView, shared[0].backend).base
    prompt = prompt_of(shared[0])

    await round_s(shared, prompt, args.group, sampling)  # warm-up, both ways
    await round_s(separate, prompt, args.group, sampling)
    shared_s, separate_s = [], []
    for _ in range(args.rounds):
        shared_s.append(await round_s(shared, prompt, args.group, sampling))
        separate_s.append(await round_s(separate, prompt, args.group, sampling))

    swap_ms, full_ms = [], []
    full = await compute(lambda: models.save_weights(models.load_model(model_dir)[0]))
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
        "shared_rss_mb": round(rss["shared"], 1), "separate_rss_mb": round(rss["separate"], 1),
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
    parser.add_argument("--threads", type=int, default=Settings.model_fields["torch_threads"].default,
                        help="torch threads (default: the torch_threads setting's default)")
    parser.add_argument("--memory-of", choices=["shared", "separate"],
                        help="(internal) print the memory of one way, the adapters given as files, and exit")
    parser.add_argument("adapter_files", nargs="*", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_of:
        print(asyncio.run(memory_mb(args.memory_of, Path(args.model), args.adapter_files, args.group, args.max_tokens)))
        sys.exit(0)
    figures = asyncio.run(main(args))
    print(json.dumps(figures, indent=2))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(figures, indent=2) + "\n")
