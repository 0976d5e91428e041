"""The pages of a real run, and the documentation's screenshots made from them.

``flywheel up`` on free ports; ``flywheel run`` trains the shipped reverse-text example for a
short run with a held-out eval every ``EVAL_EVERY`` steps, to its end. The run page then draws
the reward curve from the steps the recorder stored, and the eval points the run's owner wrote
in its state; a rollout's trace page shows its token layer, each token's text beside its id.
The screenshots go to the test's folder, or, with ``FLYWHEEL_SCREENSHOTS=DIR``, to ``DIR`` as
``run-page.png`` and ``trace-page.png``, the images the docs show::

    FLYWHEEL_SCREENSHOTS=docs/img scripts/test.sh --browser -k real_run
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.e2e.conftest import stack_up

if TYPE_CHECKING:
    from playwright.async_api import Browser

ROOT = Path(__file__).parents[2]
RUN = "reverse-text-demo"
NUM_STEPS = 150  # the example learns within it: the curve the docs show rises
EVAL_EVERY = 50
WAIT_MS = 15_000
# The mean reward of the first and the last 10 steps, as the page fetched them.
FIRST_AND_LAST_REWARD = """async (run) => {
  const steps = (await (await fetch(`/v1/runs/${run}/metrics?limit=500`)).json()).items
    .filter((r) => r.metrics.reward_mean !== undefined);
  const mean = (rows) => rows.reduce((s, r) => s + r.metrics.reward_mean, 0) / rows.length;
  return [mean(steps.slice(0, 10)), mean(steps.slice(-10))];
}"""
EVALS = f"""
# Held-out evals while training: the weights of every {EVAL_EVERY}th step (and of the last).
[[evals]]
id = "reverse_text"
every = {EVAL_EVERY}
num_tasks = 16
"""


@pytest.mark.browser
@pytest.mark.timeout(600)
async def test_a_real_runs_pages_and_the_docs_screenshots(browser: Browser, readable: Path, tmp_path: Path) -> None:
    from playwright.async_api import expect

    shots = Path(os.environ.get("FLYWHEEL_SCREENSHOTS") or tmp_path)
    config = readable / "reverse-text.toml"
    config.write_text((ROOT / "examples" / "reverse-text.toml").read_text() + EVALS)
    data = readable / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_") or k == "FLYWHEEL_NATS_SERVER_BIN"}
    env |= {"FLYWHEEL_DATA_DIR": str(data)}
    with stack_up(data, env) as ports:
        argv = [sys.executable, "-m", "flywheel.ops.cli", "run", str(config), "--run-id", RUN, "--nats-port",
                str(ports["nats"]), "--gateway-port", str(ports["gateway"]), "--inference-port",
                str(ports["inference"]), "--set", f"trainer.num_steps={NUM_STEPS}", "--set", "seed=0"]
        run = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, env=env, cwd=ROOT,
                                      timeout=480, check=False)
        assert run.returncode == 0, run.stdout + run.stderr
        gateway = f"http://127.0.0.1:{ports['gateway']}"
        context = await browser.new_context(base_url=gateway, viewport={"width": 1100, "height": 900})
        page = await context.new_page()
        await page.goto(f"/runs/{RUN}")
        await expect(page.locator("h1 .status")).to_have_text("finished")
        first, last = await page.evaluate(FIRST_AND_LAST_REWARD, RUN)
        assert last > first + 0.05, (first, last)  # it learned: 10-step means, measured 0.40 -> 0.57
        reward = page.locator('#reward-chart polyline[data-series="reward"]')
        await expect(reward).to_have_attribute("data-num-points", str(NUM_STEPS), timeout=WAIT_MS)
        await expect(page.locator('[data-figure="step"]')).to_have_text(str(NUM_STEPS))
        evals = page.locator("#reward-chart circle[data-eval='reverse_text']")
        steps = [int(await evals.nth(i).get_attribute("data-step") or "-1") for i in range(await evals.count())]
        assert set(range(EVAL_EVERY, NUM_STEPS + 1, EVAL_EVERY)) <= set(steps), steps
        await page.screenshot(path=shots / "run-page.png")

        async with httpx.AsyncClient(base_url=gateway) as client:
            listed = (await client.get("/v1/rollouts", params={"run": RUN, "limit": 1})).json()  # the newest
        (best,) = listed["items"]
        await page.goto(f"/rollouts/{best['id']}")
        await page.check("#show-tokens")
        await expect(page.locator("body")).to_have_attribute("data-tokens", "shown", timeout=WAIT_MS)
        texts = await page.locator(".tok-text").all_text_contents()
        assert texts and all(texts), texts  # every token has its text beside its id
        await page.screenshot(path=shots / "trace-page.png")
        await context.close()
