"""The training API's overhead and its sharing of one base, measured with the real ``tinker`` SDK.

    python benchmarks/training_api.py --json out/training_api.json [--steps 20] [--sessions 4]

Two figures, each a ratio of one run (this machine's noise moves the seconds, less the ratios):

- ``api_overhead_ratio``: the wall seconds of one ``forward_backward`` + ``optim_step`` of a
  rank-8 LoRA adapter of the tiny model (8 reverse-text rows), through the SDK against
  ``python -m flywheel_trainer.tinker_api`` on loopback (a process of its own, as users run it),
  over the same step done in this process on :class:`flywheel_trainer.adapter_host.Base`
  directly, the two stepping in turn (one of each, and again) so that both see the same machine.
  Medians of ``--steps`` steps after two warm-up steps each. Target at most 1.2.
- ``shared_trainer_speedup_<N>``: steps a second of ``--sessions`` sessions training at once, each
  its own adapter, on one API process (one copy of the base) over the same sessions each on an
  API process of its own (``--sessions`` copies of the base), with the resident memory of the
  API processes (``shared_rss_mb``, ``separate_rss_mb``, from /proc); medians of four alternate
  rounds of each. Target at least 1.5 (N = 4).

The API processes meter their usage as deployed: on a nats-server of the benchmark's own.

Writes the figures as JSON to ``--json`` and prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 4  # alternate rounds of the shared and the separate sessions
WORDS = ["abc", "hello", "stone", "river", "cloud", "apple", "tiger", "lemon"]


def free_port() -> int:
    from flywheel.runtime.natsserver import free_port as port

    return port()


def start_api(data_dir: Path, nats_url: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "FLYWHEEL_DATA_DIR": str(data_dir), "FLYWHEEL_NATS_URL": nats_url}
    process = subprocess.Popen([sys.executable, "-m", "flywheel_trainer.tinker_api", "--port", str(port)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the training API did not start on {url}")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def rows(tok: Any) -> list[tuple[list[int], list[int], list[float]]]:
    out = []
    for word in WORDS:
        prompt, answer = tok.encode(f"reverse {word}:"), tok.encode(word[::-1]) + [tok.eos_token_id]
        tokens = prompt + answer
        out.append((tokens[:-1], tokens[1:], [0.0] * (len(prompt) - 1) + [1.0] * len(answer)))
    return out


def sdk_data(data: list[tuple[list[int], list[int], list[float]]]) -> list[Any]:
    from tinker import types

    return [types.Datum(model_input=types.ModelInput.from_ints(model_input),
                        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(np.asarray(targets, np.int64)),
                                        "weights": types.TensorData.from_numpy(np.asarray(weights, np.float32))})
            for model_input, targets, weights in data]


class SdkStepper:
    """One SDK session's LoRA model on the API at ``url``: ``step()`` is a forward_backward +
    optim_step, submitted together as the SDK recommends."""

    def __init__(self, url: str, data: list[Any], seed: int) -> None:
        import tinker

        self.data = data
        self.service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        self.training = self.service.create_lora_training_client(base_model="tiny", rank=8, seed=seed).result()

    def step(self) -> float:
        from tinker import types

        started = time.perf_counter()
        done = self.training.forward_backward(self.data, "cross_entropy")
        stepped = self.training.optim_step(types.AdamParams(learning_rate=1e-3))
        done.result()
        stepped.result()
        return time.perf_counter() - started

    def close(self) -> None:
        self.service.close("success").result()


class DirectStepper:
    """The same step on the adapter host in this process."""

    def __init__(self, data_dir: Path, data: list[tuple[list[int], list[int], list[float]]]) -> None:
        from flywheel_trainer.adapter_host import Base, Datum

        self.base = Base("tiny", data_dir)
        self.adapter = self.base.add("bench", 8, 0, True, True, True)
        self.datums = [Datum(list(m), {"target_tokens": np.asarray(t, np.int64),
                                       "weights": np.asarray(w, np.float32)}) for m, t, w in data]

    def step(self) -> float:
        started = time.perf_counter()
        self.base.forward_backward(self.adapter, self.datums, "cross_entropy", False)
        self.base.optim_step(self.adapter, 1e-3, 0.9, 0.95, 1e-12, 0.0, 0.0)
        return time.perf_counter() - started


def interleaved(direct: DirectStepper, api: SdkStepper, steps: int) -> tuple[list[float], list[float]]:
    """Seconds of each step of both, one after the other (two warm-up steps each first), so that
    both see the same machine: what else runs on it slows both alike."""
    for _ in range(2):
        direct.step()
        api.step()
    pairs = [(direct.step(), api.step()) for _ in range(steps)]
    return [d for d, _ in pairs], [a for _, a in pairs]


def steps_per_s(steppers: list[SdkStepper], steps: int) -> float:
    """Steps a second of the sessions stepping at once, ``steps`` each (one thread a session)."""
    started = time.perf_counter()
    threads = [threading.Thread(target=lambda s=stepper: [s.step() for _ in range(steps)]) for stepper in steppers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(steppers) * steps / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sessions", type=int, default=4)
    args = parser.parse_args()
    from flywheel.runtime.natsserver import NatsServer
    from flywheel.sdk.models import load_model, resolve_model

    with tempfile.TemporaryDirectory(prefix="flywheel-bench-api-") as scratch:
        data_dir = Path(scratch)
        nats = NatsServer(data_dir / "nats").start()
        try:
            _, tok = load_model(resolve_model("tiny", data_dir))
            data = rows(tok)
            apis = [start_api(data_dir, nats.url) for _ in range(1 + args.sessions)]
            try:
                url = apis[0][1]
                single = SdkStepper(url, sdk_data(data), seed=0)
                direct, through = interleaved(DirectStepper(data_dir, data), single, args.steps)
                single.close()
                # The sessions on one API process (one base), and each on its own: in alternate
                # rounds, so that both see the same machine.
                shared = [SdkStepper(url, sdk_data(data), seed=i) for i in range(args.sessions)]
                apart = [SdkStepper(u, sdk_data(data), seed=i) for i, (_, u) in enumerate(apis[1:])]
                for group in (shared, apart):
                    steps_per_s(group, 2)  # warm-up
                per_round = max(1, args.steps // ROUNDS)
                shared_rates, apart_rates = [], []
                for _ in range(ROUNDS):
                    shared_rates.append(steps_per_s(shared, per_round))
                    apart_rates.append(steps_per_s(apart, per_round))
                shared_rss = rss_mb(apis[0][0].pid)
                separate_rss = sum(rss_mb(p.pid) for p, _ in apis[1:])
                for stepper in (*shared, *apart):
                    stepper.close()
            finally:
                for process, _ in apis:
                    process.kill()
                    process.wait()
        finally:
            nats.stop()
    figures = {
        "step_s_direct": statistics.median(direct), "step_s_api": statistics.median(through),
        "api_overhead_ratio": statistics.median(through) / statistics.median(direct),
        "sessions": args.sessions, "shared_steps_per_s": statistics.median(shared_rates),
        "separate_steps_per_s": statistics.median(apart_rates),
        f"shared_trainer_speedup_{args.sessions}": statistics.median(shared_rates) / statistics.median(apart_rates),
        "shared_rss_mb": shared_rss,
        "separate_rss_mb": separate_rss,
        "steps": args.steps, "cpus": os.cpu_count(),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(figures, indent=2) + "\n")
    for key, value in figures.items():
        print(f"{key:24} {value:.4g}" if isinstance(value, float) else f"{key:24} {value}")


if __name__ == "__main__":
    main()
