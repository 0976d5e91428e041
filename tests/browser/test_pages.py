"""The gateway's web pages in headless Chromium (Debian's, driven by Playwright), served for real
against a real nats-server under API keys: a run's reward curve grows on its page as the
trainer's steps are recorded; a multi-turn tool-calling rollout's trace page shows its
branches and, with tokens on, the tokens of GET /v1/traces/{id}; another tenant's key sees none
of it. Each page's screenshot is written under the test's tmp_path (two are in docs/img)."""

from __future__ import annotations

import json
import math
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import msgspec
import pytest

from flywheel.contract import events, keys
from flywheel.contract import runs as runs_module
from flywheel.contract.bus import Bus
from flywheel_gateway.store import Store
from tests.browser.conftest import Gateway

if TYPE_CHECKING:
    from playwright.async_api import Browser, Page

pytestmark = pytest.mark.browser

RUN = "team/web-run"
ROLLOUT = "rollout-tools"
ENVS = ("reverse_text", "arithmetic")
WAIT_MS = 15_000


async def owned(gateway: Gateway) -> dict[str, str]:
    """Tenant a's run of two environments; read keys of a and of b."""
    bus: Bus = gateway.app.state.bus
    store: Store = gateway.app.state.store
    config = {"run": RUN, "envs": [{"id": f"flywheel/{env}"} for env in ENVS]}
    state = events.RunState(id=RUN, tenant="a", status="running", config=config)
    await (await bus.runs_kv()).put(RUN, events.encode(state))
    await store.upsert_runs([state])
    return {name: (await keys.create_key(bus, tenant, ["read"]))[0] for name, tenant in [("a", "a"), ("b", "b")]}


def step(number: int) -> events.WeightUpdate:
    """A trainer step as the recorder stores it: a weight update with the step's figures."""
    reward = {env: min(1.0, 0.1 + 0.05 * number * (i + 1)) for i, env in enumerate(ENVS)}
    metrics = {f"env.{env}.reward_mean": value for env, value in reward.items()}
    metrics |= {"reward_mean": sum(reward.values()) / len(reward), "staleness_mean": 0.5, "staleness_max": 1.0,
                "num_dropped_stale": float(number % 2), "num_dropped_scorer_error": 0.0, "step_s": 1.25}
    return events.WeightUpdate(id=f"{RUN}-{number}", run=RUN, version=number, uri="file:///weights",
                               sha256="0" * 64, size_bytes=1, trainer_step=number, metrics=metrics)


# Tokens' texts as inference decodes them; model output, shown as text whatever it looks like.
TOKEN_TEXTS = {4: "<img src=x onerror=\"document.title='pwned'\">", 5: " warm\n"}


def span(token_ids: list[int], sampled: bool) -> events.TokenSpan:
    logprobs = [-(i % 7) * 0.4 if sampled else 0.0 for i in range(len(token_ids))]
    return events.TokenSpan(token_ids=token_ids, logprobs=logprobs, loss_mask=[sampled] * len(token_ids),
                            policy_version=4 if sampled else None,
                            texts=[TOKEN_TEXTS.get(t, f"w{t}") for t in token_ids])


def chain(parent: events.Node | None, *messages: tuple[events.Message, list[int]]) -> list[events.Node]:
    nodes = []
    for message, token_ids in messages:
        tokens = span(token_ids, message.role == "assistant")
        parent_id = parent.id if parent else None
        parent = events.Node(id=events.node_id(parent_id, message, tokens), parent_id=parent_id, message=message,
                             tokens=tokens)
        nodes.append(parent)
    return nodes


def tool_rollout() -> events.Rollout:
    """Two turns with a tool call each, and a retried first answer: two branches."""
    call = events.ToolCall(id="call_1", name="lookup", arguments='{"city": "Paris"}')
    again = events.ToolCall(id="call_2", name="convert", arguments='{"celsius": 21}')
    system, user = chain(None, (events.Message(role="system", content="Use the tools."), [1, 2, 3]),
                         (events.Message(role="user", content="How warm is Paris, in Fahrenheit?"), [4, 5, 6, 7]))
    retried = chain(user, (events.Message(role="assistant", content="I think 70."), [80, 81, 82]))
    final = chain(user,
                  (events.Message(role="assistant", tool_calls=[call]), list(range(100, 112))),
                  (events.Message(role="tool", tool_call_id="call_1", name="lookup", content="21 C"), [20, 21]),
                  (events.Message(role="assistant", tool_calls=[again]), list(range(120, 130))),
                  (events.Message(role="tool", tool_call_id="call_2", name="convert", content="69.8 F"), [30, 31]),
                  (events.Message(role="assistant", content="It is 69.8 °F in Paris."), list(range(140, 152))))
    return events.Rollout(id=ROLLOUT, run=RUN, env=ENVS[0], task_id="t1", group_id="g1", index=0, policy_version=4,
                          nodes=[system, user, *retried, *final], status="completed", metrics={"num_turns": 3.0})


async def page_of(browser: Browser, gateway: Gateway, key: str | None) -> Page:
    """A page whose every request, the script's fetch calls too, carries the key as a bearer token."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    context = await browser.new_context(base_url=gateway.url, extra_http_headers=headers,
                                        viewport={"width": 1100, "height": 900})
    return await context.new_page()


async def test_the_run_page_draws_a_reward_curve_that_grows(browser: Browser, gateway: Gateway,
                                                            screenshots: Path) -> None:
    from playwright.async_api import expect

    made = await owned(gateway)
    store: Store = gateway.app.state.store
    await store.record([step(n) for n in range(1, 11)])
    page = await page_of(browser, gateway, made["a"])
    runs = await page.goto("/runs")
    assert runs is not None and runs.status == 200
    row = page.locator(f'tr[data-run="{RUN}"]')
    await expect(row).to_contain_text("running")
    await expect(row).to_contain_text("flywheel/reverse_text + flywheel/arithmetic")
    await expect(row.locator("td.num").first).to_have_text("10")
    await page.screenshot(path=screenshots / "runs.png")

    started = time.monotonic()
    await page.goto(f"/runs/{RUN}")
    reward = page.locator('#reward-chart polyline[data-series="reward"]')
    await expect(reward).to_have_attribute("data-num-points", "10", timeout=WAIT_MS)
    drawn_ms = (time.monotonic() - started) * 1000
    for env in ENVS:
        await expect(page.locator(f'#reward-chart polyline[data-series="{env}"]')).to_have_attribute(
            "data-num-points", "10")
    # The evals the run's owner ran at steps 5 and 10, written to the run's state as the owner writes
    # them: drawn where they are, with their figures on hover; one added later reaches the open page.
    bus: Bus = gateway.app.state.bus
    for at in (5, 10):
        await runs_module.add_eval_point(bus, RUN, events.EvalPoint(
            eval="held_out", step=at, run=f"{RUN}-eval-held_out-{at}", reward_mean=0.2 + 0.02 * at,
            reward_stderr=0.01, num_rollouts=16, num_errors=1))
    evals = page.locator("#reward-chart circle[data-eval='held_out']")
    await expect(evals).to_have_count(2, timeout=WAIT_MS)
    await expect(page.locator("#reward-chart circle[data-eval='held_out'][data-step='10'] title")).to_have_text(
        f"eval held_out at step 10: reward 0.400 ± 0.010 over 16 rollouts, 1 errors (eval run {RUN}-eval-held_out-10)")
    await expect(page.locator('[data-figure="staleness"]')).to_have_text("0.50 / 1")
    await expect(page.locator('[data-figure="dropped"]')).to_have_text("5 (stale 5)")

    await store.record([step(n) for n in range(11, 16)])  # the trainer goes on while the page is open
    await expect(reward).to_have_attribute("data-num-points", "15", timeout=WAIT_MS)
    await runs_module.add_eval_point(bus, RUN, events.EvalPoint(eval="held_out", step=15, run=f"{RUN}-eval-15",
                                                                reward_mean=0.5, num_rollouts=16))
    await expect(evals).to_have_count(3, timeout=WAIT_MS)
    await expect(page.locator('[data-figure="step"]')).to_have_text("15")
    points = (await reward.get_attribute("points") or "").split()
    assert len(points) == 15 and float(points[-1].split(",")[1]) < float(points[0].split(",")[1])  # rising
    await expect(page.locator("body")).to_have_attribute("data-live", "stream")  # not polling
    await page.screenshot(path=screenshots / "run.png", full_page=True)
    print(f"run page drawn in {drawn_ms:.0f} ms")

    # Where the stream fails (a proxy that buffers it), the page polls the metrics instead.
    polled = await page_of(browser, gateway, made["a"])
    await polled.route("**/stream?*", lambda route: route.abort())
    await polled.goto(f"/runs/{RUN}")
    await expect(polled.locator("body")).to_have_attribute("data-live", "polling", timeout=WAIT_MS)
    await store.record([step(16)])
    await expect(polled.locator('#reward-chart polyline[data-series="reward"]')).to_have_attribute(
        "data-num-points", "16", timeout=WAIT_MS)
    # The run ends: the stream says so and closes.
    await (await gateway.app.state.bus.runs_kv()).put(RUN, events.encode(events.RunState(
        id=RUN, tenant="a", status="finished", config={"run": RUN})))
    await expect(page.locator("h1 .status")).to_have_text("finished", timeout=WAIT_MS)
    await expect(page.locator("body")).to_have_attribute("data-live", "ended")
    await expect(reward).to_have_attribute("data-num-points", "16")


async def test_a_trace_page_shows_branches_and_the_apis_tokens(browser: Browser, gateway: Gateway,
                                                               screenshots: Path) -> None:
    from playwright.async_api import expect

    made = await owned(gateway)
    store: Store = gateway.app.state.store
    rollout = tool_rollout()
    await store.record([rollout, events.Score(id="s1", run=RUN, env=ENVS[0], rollout_id=ROLLOUT, group_id="g1",
                                              scorer="exact", value=1.0, components={"format": 1.0})])
    page = await page_of(browser, gateway, made["a"])
    await page.goto(f"/runs/{RUN}")
    await page.click(f'a[href="/rollouts/{ROLLOUT}"]')
    started = time.monotonic()
    await expect(page.locator(".branch")).to_have_count(2)
    loaded_ms = (time.monotonic() - started) * 1000
    final = page.locator(".branch", has_text="final")
    await expect(final.locator(".message-node")).to_have_count(7)
    await expect(final.locator(".tool-call")).to_have_count(2)
    await expect(final.locator(".tool-call").first).to_contain_text('lookup({"city": "Paris"})')
    await expect(final.locator(".message-node.tool").last).to_contain_text("69.8 F")
    await expect(page.locator("#scores")).to_contain_text("exact")

    await page.check("#show-tokens")
    await expect(page.locator("body")).to_have_attribute("data-tokens", "shown", timeout=WAIT_MS)
    async with httpx.AsyncClient(base_url=gateway.url, headers={"Authorization": f"Bearer {made['a']}"}) as client:
        trace = (await client.get(f"/v1/traces/{ROLLOUT}", params={"tokens": "true"})).json()
    assert len(trace["nodes"]) == 8 and len(trace["leaves"]) == 2
    for node in trace["nodes"]:
        tokens = page.locator(f'[data-node="{node["id"]}"]').first.locator(".tok")
        assert await tokens.locator(".tok-id").all_text_contents() == [str(t) for t in node["tokens"]["token_ids"]]
        shown = await tokens.locator(".tok-text").all_text_contents()  # beside each id, control characters escaped
        assert shown == [json.dumps(text, ensure_ascii=False)[1:-1] for text in node["tokens"]["texts"]], node
    assert await page.locator(".tokens img").count() == 0 and await page.title() != "pwned"
    sampled = page.locator(".tok.trained").first
    assert math.isclose(float(await sampled.get_attribute("data-logprob") or "nan"), 0.0)
    assert "policy version 4" in (await final.locator(".message-node.assistant .tokens .note").first.inner_text())
    await page.screenshot(path=screenshots / "trace.png", full_page=True)
    await page.uncheck("#show-tokens")
    await expect(page.locator(".tokens").first).to_be_hidden()
    print(f"trace page shown in {loaded_ms:.0f} ms")


async def test_a_running_rollouts_trace_page_grows_without_a_reload(browser: Browser, gateway: Gateway,
                                                                     screenshots: Path) -> None:
    """Inference publishes a running rollout's trace nodes (TraceNode events, once it has run
    for live_trace_after_s), which the recorder stores: the page draws what is stored, then
    adds each new node of the live stream in place; the rollout landing reloads it, scored."""
    from playwright.async_api import expect

    made = await owned(gateway)
    bus: Bus = gateway.app.state.bus
    store: Store = gateway.app.state.store
    final = tool_rollout()
    nodes = [n for n in final.nodes if n.message.content != "I think 70."]  # the branch that ends final
    live = "rollout-live"

    async def publish(*published: events.Node) -> None:  # as inference and the recorder do
        traced = [events.TraceNode(run=RUN, rollout_id=live, node=n) for n in published]
        await bus.publish_many(traced, events.MSGPACK)
        await store.record(traced)

    await publish(*nodes[:3])
    page = await page_of(browser, gateway, made["a"])
    await page.goto(f"/rollouts/{live}")
    await expect(page.locator("#running")).to_be_visible()
    await expect(page.locator("body")).to_have_attribute("data-live", "following")
    await expect(page.locator(".message-node")).to_have_count(3)
    await page.evaluate("window.notReloaded = true")
    await publish(nodes[3])  # the tool's result
    added = page.locator(f'[data-node="{nodes[3].id}"]')
    await expect(added).to_contain_text("21 C", timeout=WAIT_MS)
    await expect(added).to_contain_text("result of call_1")
    await publish(nodes[4])  # the next call
    await expect(page.locator(".message-node")).to_have_count(5, timeout=WAIT_MS)
    await expect(page.locator(".message-node").last.locator(".tool-call")).to_contain_text('convert({"celsius": 21})')
    await expect(page.locator(".branch .num-messages")).to_have_text("5")
    assert await page.evaluate("window.notReloaded") is True  # drawn in place
    await page.screenshot(path=screenshots / "trace-live.png", full_page=True)
    await page.check("#show-tokens")  # the new nodes' tokens come from the API like the others'
    await expect(added.locator(".tok")).to_have_count(2, timeout=WAIT_MS)

    landed = msgspec.structs.replace(final, id=live, nodes=nodes)
    await store.record([landed, events.Score(id="s-live", run=RUN, env=ENVS[0], rollout_id=live, group_id="g1",
                                             scorer="exact", value=1.0)])
    await bus.publish(landed, events.MSGPACK)  # recorded first: the page reloads once the stream brings it
    await expect(page.locator("#scores")).to_contain_text("exact", timeout=WAIT_MS)  # reloaded once it landed
    await expect(page.locator("#running")).to_have_count(0)
    await expect(page.locator(".message-node")).to_have_count(len(nodes))


async def test_another_tenants_key_sees_none_of_it(browser: Browser, gateway: Gateway, screenshots: Path) -> None:
    from playwright.async_api import expect

    made = await owned(gateway)
    store: Store = gateway.app.state.store
    await store.record([step(1), tool_rollout()])
    page = await page_of(browser, gateway, made["b"])
    listed = await page.goto("/runs")
    assert listed is not None and listed.status == 200
    await expect(page.locator("main")).to_contain_text("No runs yet")
    for url, what in ((f"/runs/{RUN}", "run"), (f"/rollouts/{ROLLOUT}", "rollout")):
        refused = await page.goto(url)  # as one that does not exist
        assert refused is not None and refused.status == 404, url
        await expect(page.locator("#message")).to_contain_text(f"{what} '")
        await expect(page.locator("#message")).to_contain_text("not found")
        assert await page.locator(".branch, #reward-chart").count() == 0
    await page.screenshot(path=screenshots / "refused.png")
    # The script's own calls, from b's page, are refused too.
    status = await page.evaluate(f"fetch('/v1/runs/{RUN}/metrics').then(r => r.status)")
    assert status == 404
    anonymous = await page_of(browser, gateway, None)
    refused = await anonymous.goto(f"/runs/{RUN}")
    assert refused is not None and refused.status == 401
    await expect(anonymous.locator("#message")).to_contain_text("API key")


async def test_hub_and_usage_pages(browser: Browser, gateway: Gateway, screenshots: Path) -> None:
    from playwright.async_api import expect

    from flywheel_gateway.hub import inspect_package
    from tests.unit.test_hub import wheel

    made = await owned(gateway)
    store: Store = gateway.app.state.store
    for env_id, forked_from in (("a/quiz", None), ("a/quiz-hard", "a/quiz@0.1.0")):
        project = env_id.replace("/", "_").replace("-", "_")
        package = inspect_package(env_id, "0.1.0", dict([wheel(project, "0.1.0", env_id)]), 1 << 20)
        await store.hub_push(package, "a", private=env_id == "a/quiz-hard", pushed_by=None, forked_from=forked_from)
    for model, reward in (("small", 0.25), ("large", 0.75)):
        await store.hub_add_eval("a/quiz", "0.1.0", {
            "model": model, "reward_mean": reward, "reward_stderr": 0.04, "pass_at": {"pass@1": reward},
            "num_tasks": 16, "num_rollouts": 32, "prompt_tokens": 900, "completion_tokens": 300, "summary": {}},
            "a", None)
    await store.record([events.Usage(run=RUN, source="trainer", step=1, trained_tokens=4096)])
    page = await page_of(browser, gateway, made["a"])
    await page.goto("/environments")
    await expect(page.locator("#environments tbody tr")).to_have_count(2)
    await page.click('a[href="/environments/a/quiz"]')
    await expect(page.locator("#leaderboard tbody tr").first).to_contain_text("large")
    await expect(page.locator("#forks")).to_contain_text("a/quiz-hard")
    await expect(page.locator("#readme")).to_contain_text("The README.")
    await expect(page.locator("#readme h1")).to_have_text("word-quiz")  # Markdown, rendered
    await page.screenshot(path=screenshots / "environment.png", full_page=True)
    await page.goto("/usage")  # the last 7 days by the hour: 169 buckets, usage in the last one alone
    await expect(page.locator("#usage")).to_contain_text("4096")
    trained = page.locator('#tokens-chart rect[data-series="trained"]')
    await expect(trained).to_have_count(1)
    await expect(trained).to_have_attribute("data-value", "4096")
    # Drawn from the first bucket with usage on: this hour spans the chart, not a sliver of a week.
    await expect(page.locator("#tokens-chart")).to_have_attribute("data-num-buckets", "1")
    assert float(await trained.get_attribute("width") or 0) > 500
    await store.record([events.Usage(run=RUN, source="trainer", step=0, trained_tokens=1024,
                                     created_at=events.utc_now() - timedelta(days=2))])
    await page.goto("/usage?bucket=1d")  # usage two days ago too: from that day to today
    await expect(page.locator("#tokens-chart")).to_have_attribute("data-num-buckets", "3")
    await expect(page.locator("#tokens-legend")).to_contain_text("prompt")
    await expect(page.locator("#cost-legend")).to_contain_text("cost (USD)")
    await page.screenshot(path=screenshots / "usage.png")
    other = await page_of(browser, gateway, made["b"])
    await other.goto("/environments")
    await expect(other.locator("#environments tbody tr")).to_have_count(1)  # a's public one alone
    refused = await other.goto("/environments/a/quiz-hard")
    assert refused is not None and refused.status == 404
    await other.goto("/environments/a/quiz")
    await expect(other.locator("#forks")).to_have_count(0)  # the private fork is not shown to b


async def test_a_person_signs_in_and_the_pages_read_with_the_key(browser: Browser, gateway: Gateway) -> None:
    from playwright.async_api import expect

    made = await owned(gateway)
    store: Store = gateway.app.state.store
    await store.record([step(n) for n in range(1, 4)])
    page = await page_of(browser, gateway, None)  # a person's browser: no header of its own
    refused = await page.goto(f"/runs/{RUN}")
    assert refused is not None and refused.status == 401
    await page.click('a[href="/login"] >> nth=-1')
    await page.fill("#key", made["a"])
    await page.click("#login button")
    await expect(page.locator(f'tr[data-run="{RUN}"]')).to_be_visible()
    await page.goto(f"/runs/{RUN}")
    await expect(page.locator('#reward-chart polyline[data-series="reward"]')).to_have_attribute(
        "data-num-points", "3", timeout=WAIT_MS)  # the script's reads carry the login too
    assert (await page.context.cookies())[0]["httpOnly"] is True
    await page.goto("/logout")
    after = await page.goto(f"/runs/{RUN}")
    assert after is not None and after.status == 401


async def test_the_run_list_pauses_a_run_with_the_signed_in_key(browser: Browser, gateway: Gateway) -> None:
    from playwright.async_api import expect

    await owned(gateway)
    writer, _ = await keys.create_key(gateway.app.state.bus, "a", ["read", "write"])
    reader, _ = await keys.create_key(gateway.app.state.bus, "a", ["read"])
    page = await page_of(browser, gateway, None)
    for key in (reader, writer):
        await page.goto("/login")
        await page.fill("#key", key)
        await page.click("#login button")
        row = page.locator(f'tr[data-run="{RUN}"]')
        await expect(row.locator(".status")).to_have_text("running")
        await row.locator('button[data-action="pause"]').click()
        if key == reader:  # the key's scopes rule: a read key's click is refused, and the page says why
            await expect(page.locator("#problem")).to_contain_text("needs 'write'", timeout=WAIT_MS)
    await expect(row.locator(".status")).to_have_text("paused", timeout=WAIT_MS)  # the page reloaded
    await expect(row.locator('button[data-action="resume"]')).to_be_visible()
    state = await (await gateway.app.state.bus.runs_kv()).get(RUN)
    assert msgspec.json.decode(state.value)["status"] == "paused"
