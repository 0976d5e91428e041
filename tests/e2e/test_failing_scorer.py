"""A custom scorer that fails on some rollouts costs only those rollouts, and says so.

On a ``flywheel up`` stack, ``flywheel scorer`` runs a function that raises on about 5% of
rollouts (those whose id hashes so), named in the run's reward; ``flywheel run`` trains
the shipped reverse-text example for a few steps. A rollout a required scorer failed on is
dropped (never trained), but its group still trains the rest, so nothing more is made for
it: before, each drop was replaced and given its allowance back, sampling ran ahead of the
trainer and the extra rollouts went stale (581 stale against 148 failed in a 40-step run,
0 stale without failures; 0 stale in 3 runs since). The run's screen names the failure once
with an example, and its summary, the run state and the run page group the failures by kind
with a count. At the run's end its trainer's durables go (they expire once it stopped); the
scorer's durables, kept for its return, are removed with ``flywheel consumers rm`` once it
stopped (refused while it runs).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from flywheel.contract.runs import trainer_durables
from tests.e2e.conftest import stack_up
from tests.e2e.test_run_owner import flywheel, state
from tests.e2e.test_up import Output, nats_login, poll

ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "examples" / "reverse-text.toml"
RUN = "flaky-scorer"
NUM_STEPS = 12
BATCH_SIZE = 64  # the example's trainer.batch_size
FLAKY = textwrap.dedent('''
    import hashlib


    def short(completion, rollout):
        """1.0 for an answer of at most 8 characters; raises on about 5% of rollouts."""
        if int(hashlib.sha256(rollout.id.encode()).hexdigest(), 16) % 20 == 0:
            raise RuntimeError("flaky scorer: this one fails on purpose")
        return 1.0 if len(str(completion)) <= 8 else 0.0
''')


def consumers(env: dict[str, str], stream: str) -> dict[str, dict[str, object]]:
    done = flywheel("status", "--json", env=env)
    assert done.returncode == 0, done.stderr
    return {c["consumer"]: c for c in json.loads(done.stdout)["consumers"] if c["stream"] == stream}


@pytest.mark.long
@pytest.mark.timeout(600)
def test_a_failing_custom_scorer_costs_only_its_rollouts_and_is_grouped_on_the_runs_screen(
        readable: Path, clean_env: dict[str, str]) -> None:
    code, data = readable / "code", readable / "data"  # environment workers (users of their own) read both
    code.mkdir()
    (code / "flaky.py").write_text(FLAKY)
    # The scorer's workers see the folder on PYTHONPATH, read-only.
    env = clean_env | {"PYTHONPATH": str(code), "FLYWHEEL_DATA_DIR": str(data)}
    with stack_up(data, env) as ports:
        env |= {"FLYWHEEL_NATS_PORT": str(ports["nats"])}
        scorer = subprocess.Popen([sys.executable, "-m", "flywheel.ops.cli", "scorer", "flaky:short", "--env",
                                   "reverse_text"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=env, cwd=code)
        scored = Output(scorer)
        try:
            scored.wait_for(r"this replica consumes partitions", 120)
            run = subprocess.run(
                [sys.executable, "-m", "flywheel.ops.cli", "run", str(CONFIG), "--run-id", RUN, "--data-dir", str(data),
                 "--nats-port", str(ports["nats"]), "--gateway-port", str(ports["gateway"]), "--inference-port",
                 str(ports["inference"]), "--set", f"trainer.num_steps={NUM_STEPS}", "--set", "sft.steps=20",
                 "--set", "scorers.short=0.1", "--set", "seed=3"],
                capture_output=True, text=True, env=env, cwd=ROOT, timeout=420, check=False)
            assert run.returncode == 0, run.stdout + run.stderr
            out = run.stdout
            # Said once on the run's screen, with an example; grouped with its count at the end.
            said = [line for line in out.splitlines() if "scorer short failed on rollout" in line]
            assert len(said) == 1 and "RuntimeError: flaky scorer: this one fails on purpose" in said[0], out
            summary = json.loads((data / "runs" / RUN / "summary.json").read_text())
            failed, stale = int(summary["num_dropped_scorer_error"]), int(summary["num_dropped_stale"])
            assert failed > 0, out
            assert stale <= BATCH_SIZE, f"{stale} rollouts went stale beside the {failed} the scorer failed on"
            groups = state(nats_login(data, ports["nats"]), RUN).errors
            assert [(g.source, g.count) for g in groups] == [("scorer short", failed)], groups
            assert f"  {failed}  scorer short: reward 'short' failed: RuntimeError: flaky scorer" in out, out
            page = httpx.get(f"http://127.0.0.1:{ports['gateway']}/runs/{RUN}", timeout=30)
            assert page.status_code == 200 and 'id="errors"' in page.text
            assert f"/rollouts/{groups[0].example}" in page.text

            # The ended run's trainer durables go (LET_GO_S after it stopped); the running
            # scorer's cannot be removed.
            durables = trainer_durables(RUN)
            poll(lambda: durables["ROLLOUTS"] not in consumers(env, "ROLLOUTS")
                 and durables["SCORES"] not in consumers(env, "SCORES"), 60, "the ended run's durables to go")
            assert consumers(env, "ROLLOUTS")["scorer-short-p0"]["pulled"]
            refused = flywheel("consumers", "rm", "ROLLOUTS", "scorer-short-*", env=env)
            assert refused.returncode == 1 and "a process reads scorer-short-p0" in refused.stderr, refused.stderr
        finally:
            scorer.send_signal(signal.SIGINT)
            scored.exit_status(scorer, 60)
        # Stopped: its durables stay (idle) until removed.
        poll(lambda: not any(c["pulled"] for name, c in consumers(env, "ROLLOUTS").items()
                             if name.startswith("scorer-short-")), 60, "the stopped scorer's pulls to expire")
        removed = flywheel("consumers", "rm", "ROLLOUTS", "scorer-short-*", env=env)
        assert removed.returncode == 0, removed.stderr
        assert removed.stdout.count("deleted ROLLOUTS/scorer-short-p") == 8
        assert not [name for name in consumers(env, "ROLLOUTS") if name.startswith("scorer-short-")]
