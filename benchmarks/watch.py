"""CPU the reward-hacking watch spends per scored rollout (``flywheel_scorer.watch.Watch.see``).

    python benchmarks/watch.py --json out/watch.json [--steps 60] [--seed 0]

The load is the embedded training run's (``benchmarks/vs_trl.py``: reverse-text, 128 rollouts
a step in 8 groups of 16, 16 sampled tokens): each rollout has the trained reward
(``similarity``, rising over the run with noise) and the metric ``exact`` (weight 0, 1 with a
chance that grows with the reward), as the reverse-text environment scores it, and a
completion of 4 to 40 characters. The watch runs with its defaults (a window of 256 rollouts),
one policy version a step. The stream is made first; only ``see`` is timed
(``time.process_time``), after ``--warmup`` steps that fill the window.

Keys: ``us_per_rollout`` (the headline), ``cpu_s_per_step`` (times 128 rollouts),
``flagged`` (rollouts any detector flagged: the stream games nothing, but noise trips the
divergence detector now and then, 1 of 7,424 rollouts at seed 0), ``rollouts``.

Measured here: 71 us of CPU a rollout, 0.009 CPU-s a step; 94 us for the code before its medians
were kept sorted and the drift check tested the rollout first, the same hour.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from flywheel.contract import events
from flywheel_scorer.watch import Watch

ROLLOUTS_PER_STEP, GROUP_SIZE = 128, 16
ALPHABET = "abcdefghijklmnopqrstuvwxyz "


def stream(steps: int, seed: int) -> list[tuple[events.Rollout, str, list[events.Score]]]:
    rng = random.Random(seed)
    out = []
    for i in range(steps * ROLLOUTS_PER_STEP):
        step = i // ROLLOUTS_PER_STEP
        group = f"g{i // GROUP_SIZE}"
        rollout = events.Rollout(id=f"r{i}", run="bench", env="reverse_text", task_id=f"t{i // GROUP_SIZE}",
                                 group_id=group, index=i % GROUP_SIZE, policy_version=step, status="completed")
        reward = min(1.0, max(0.0, rng.gauss(0.3 + 0.4 * step / steps, 0.15)))
        scores = [events.Score(run="bench", env="reverse_text", rollout_id=rollout.id, group_id=group,
                               scorer="similarity", value=reward, weight=1.0),
                  events.Score(run="bench", env="reverse_text", rollout_id=rollout.id, group_id=group,
                               scorer="exact", value=float(rng.random() < reward ** 4), weight=0.0)]
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(4, 40)))
        out.append((rollout, text, scores))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=2, help="steps seen before the timing starts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps}: more than --warmup ({args.warmup})")
    items = stream(args.steps, args.seed)
    watch = Watch()
    warm = args.warmup * ROLLOUTS_PER_STEP
    for rollout, text, scores in items[:warm]:
        watch.see(rollout, text, scores)
    flagged = 0
    started = time.process_time()
    for rollout, text, scores in items[warm:]:
        flagged += bool(watch.see(rollout, text, scores))
    cpu_s = time.process_time() - started
    timed = len(items) - warm
    result = {"us_per_rollout": cpu_s / timed * 1e6, "cpu_s_per_step": cpu_s / timed * ROLLOUTS_PER_STEP,
              "flagged": flagged, "rollouts": timed}
    print(f"watch: {result['us_per_rollout']:.1f} us of CPU a rollout, {result['cpu_s_per_step']:.4f} CPU-s a step of "
          f"{ROLLOUTS_PER_STEP}, {flagged} of {timed} rollouts flagged")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
