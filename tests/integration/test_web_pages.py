"""The gateway's web pages (flywheel_gateway.web) without a browser, against a real nats-server:
under API keys they refuse no key (401) and answer another tenant's run and rollout as ones
that do not exist (404), and a listing shows the caller's own runs alone; bad ids and missing
things are message pages, never a 500; the pages stay out of the OpenAPI schema, so the
schema's walks do not cover them here.
The browser tier (tests/browser) drives them in Chromium."""

from __future__ import annotations

import dataclasses
import html
import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from flywheel.contract import events, keys
from flywheel.contract.bus import Bus
from flywheel.contract.service import Service
from flywheel_gateway import web
from flywheel_gateway.hub import inspect_package
from flywheel_gateway.store import Store
from tests.unit.test_hub import wheel
from tests.unit.test_store import T0, rollout

RUN = "team/owned-by-a"
ROLLOUT = "rollout-of-a"
PAGES = ["/runs", f"/runs/{RUN}", f"/rollouts/{ROLLOUT}"]



@pytest.fixture
async def owned(keyed_app: FastAPI) -> dict[str, str]:
    """Tenant a's run with a step and a rollout; keys of a and of b."""
    bus: Bus = keyed_app.state.bus
    store: Store = keyed_app.state.store
    state = events.RunState(id=RUN, tenant="a", status="running")
    await (await bus.runs_kv()).put(RUN, events.encode(state))
    await store.upsert_runs([state])
    await store.record([rollout(ROLLOUT, run=RUN),
                        events.WeightUpdate(run=RUN, version=1, uri="file:///w", sha256="0" * 64, size_bytes=1,
                                            trainer_step=1, metrics={"reward_mean": 0.25})])
    return {name: (await keys.create_key(bus, tenant, ["read"]))[0] for name, tenant in [("a", "a"), ("b", "b")]}


async def get(app: FastAPI, url: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        return await client.get(url, headers=headers)


async def test_pages_take_the_apis_keys_and_tenants(keyed_app: FastAPI, owned: dict[str, Any]) -> None:
    paths = keyed_app.openapi()["paths"]
    assert not any(path == "/runs" or path.startswith(("/runs/", "/rollouts/")) for path in paths)
    for url in PAGES:
        for key in (None, "not a key"):
            refused = await get(keyed_app, url, key)
            assert refused.status_code == 401, (url, refused.text)
            assert refused.headers["content-type"].startswith("text/html") and "API key" in refused.text
            assert refused.headers["www-authenticate"] == "Bearer"
        mine = await get(keyed_app, url, owned["a"])
        assert mine.status_code == 200 and RUN in mine.text, (url, mine.text)
    listed = await get(keyed_app, "/runs", owned["b"])
    assert listed.status_code == 200 and RUN not in listed.text and "No runs yet" in listed.text
    for url in PAGES[1:]:
        other = await get(keyed_app, url, owned["b"])  # as one that does not exist
        assert other.status_code == 404 and "not found" in other.text, (url, other.text)
        assert ROLLOUT not in other.text.replace(f"rollout &#39;{ROLLOUT}&#39;", "")  # named in the refusal only
    run = (await get(keyed_app, f"/runs/{RUN}", owned["a"])).text
    assert f'href="/rollouts/{ROLLOUT}"' in run and 'data-run="team/owned-by-a"' in run
    assert '<table id="services">' in run and "<td>gateway</td>" in run, run  # what the run waits on, beating
    trace = (await get(keyed_app, f"/rollouts/{ROLLOUT}", owned["a"])).text
    assert trace.count('class="branch"') == 1 and "2+2?" in trace and f'href="/runs/{RUN}"' in trace


async def test_bad_input_is_a_message_page_never_a_500(keyed_app: FastAPI, owned: dict[str, Any]) -> None:
    key = owned["a"]
    cases = {
        "/runs/bad.id": (422, "run_id: a run id is 1 to 128 letters, digits"),
        "/runs/" + "r" * 129: (422, "run_id: "),
        "/runs/%00": (422, "run_id: "),
        "/runs/%F0%9F%94%A5": (422, "run_id: "),
        "/runs/no-such-run": (404, "run &#39;no-such-run&#39; not found"),
        "/rollouts/no-such-rollout": (404, "rollout &#39;no-such-rollout&#39; not found"),
        "/rollouts/" + "x" * 1025: (422, "rollout_id: "),
        "/rollouts/%00%FF": (404, "not found"),
        f"/runs/{RUN}?limit=-1&x=%00": (200, RUN),  # query strings the pages do not read are ignored
    }
    for url, (status, text) in cases.items():
        response = await get(keyed_app, url, key)
        assert response.status_code == status and text in response.text, (url, response.status_code, response.text)
        assert response.headers["content-type"].startswith("text/html"), url
    assert (await get(keyed_app, "/static/web.js", None)).status_code == 200  # no tenant's data: no key
    assert (await get(keyed_app, "/", key)).headers["location"] == "/runs"


async def test_hub_and_usage_pages_show_the_callers_own_and_the_public(keyed_app: FastAPI,
                                                                       owned: dict[str, Any]) -> None:
    store: Store = keyed_app.state.store
    package = inspect_package("a/quiz", "0.1.0", dict([wheel("a_quiz", "0.1.0", "a/quiz")]), 1 << 20)
    await store.hub_push(package, "a", private=True, pushed_by=None)
    await store.hub_add_eval("a/quiz", "0.1.0", {
        "model": "tiny-model", "reward_mean": 0.625, "reward_stderr": 0.05, "pass_at": {"pass@1": 0.5},
        "num_tasks": 8, "num_rollouts": 16, "prompt_tokens": 10, "completion_tokens": 5, "summary": {}}, "a", None)
    await store.record([events.Usage(run=RUN, source="trainer", step=1, trained_tokens=4096, rollout_ids=[ROLLOUT])])
    for url in ("/environments", "/environments/a/quiz", "/usage"):
        assert (await get(keyed_app, url, None)).status_code == 401, url
    page = (await get(keyed_app, "/environments/a/quiz", owned["a"])).text
    assert "tiny-model" in page and "0.625" in page and "<h1>word-quiz</h1>" in page and "a_quiz-0.1.0" in page, page
    assert 'href="/environments/a/quiz"' in (await get(keyed_app, "/environments", owned["a"])).text
    other = await get(keyed_app, "/environments/a/quiz", owned["b"])
    assert other.status_code == 404 and "tiny-model" not in other.text
    assert "a/quiz" not in (await get(keyed_app, "/environments", owned["b"])).text
    assert (await get(keyed_app, "/environments/A/quiz", owned["a"])).status_code == 422
    assert (await get(keyed_app, "/environments/a/nothing", owned["a"])).status_code == 404
    usage = (await get(keyed_app, "/usage", owned["a"])).text
    assert "4096" in usage and f'href="/runs/{RUN}"' in usage, usage
    assert "4096" not in (await get(keyed_app, "/usage", owned["b"])).text


HOSTILE_README = """# Word quiz

Answer *one* word.

- first
- second

```python
print("<b>not bold</b>")
```

<script>alert("readme")</script>
<img src="x" onerror="alert('img')">
[click me](javascript:alert('link')) [also](JavaScript:alert(1)) [entity](jav&#x61;script:alert(1))
<javascript:alert('autolink')>
![pixel](javascript:alert('image'))
[docs](https://example.com/docs) [local](./tasks.md) [section](#usage)
![tracker](https://tracker.example/pixel.png) ![also](//tracker.example/p.png) ![diagram](./diagram.png)
"""


async def test_a_hub_readme_renders_as_markdown_with_no_script_a_stranger_wrote(keyed_app: FastAPI,
                                                                                owned: dict[str, Any]) -> None:
    """A README is Markdown: headings, lists and code render; its raw HTML shows as text, a link
    or image whose URL is neither http(s) nor relative is no link, and an image from another
    server is a link to it."""
    store: Store = keyed_app.state.store
    package = inspect_package("a/quiz", "0.1.0", dict([wheel("a_quiz", "0.1.0", "a/quiz")]), 1 << 20)
    await store.hub_push(dataclasses.replace(package, readme=HOSTILE_README), "a", private=False, pushed_by=None)
    page = (await get(keyed_app, "/environments/a/quiz", owned["b"])).text
    readme = page[page.index('id="readme"'):]
    assert "<h1>Word quiz</h1>" in readme and "<em>one</em>" in readme and "<li>second</li>" in readme, readme
    assert '<code class="language-python">print(&quot;&lt;b&gt;not bold&lt;/b&gt;&quot;)' in readme, readme
    readme = readme[:readme.index("</main>")]
    assert "&lt;script&gt;" in readme and "&lt;img" in readme, readme  # shown as text
    tags = re.findall(r"<[a-zA-Z][^>]*>", readme)
    assert not [tag for tag in tags if re.match(r"<(script|iframe)", tag, re.I) or re.search(r"\son\w*=", tag)]
    # An image is one only from this gateway (relative); one from elsewhere is a link to it, so
    # opening the page fetches nothing from a stranger's server (no tracking pixel).
    assert [tag for tag in tags if tag.lower().startswith("<img")] == ['<img src="./diagram.png" alt="diagram" />']
    urls = [url for tag in tags for url in re.findall(r"""\s(?:href|src)\s*=\s*["']?([^"'\s>]*)""", tag, re.I)]
    assert urls == ["https://example.com/docs", "./tasks.md", "#usage", "https://tracker.example/pixel.png",
                    "//tracker.example/p.png", "./diagram.png"], urls


async def test_a_person_signs_in_with_a_key_kept_for_reading_and_the_run_buttons(keyed_app: FastAPI,
                                                                                 owned: dict[str, Any]) -> None:
    bus: Bus = keyed_app.state.bus
    writer, _ = await keys.create_key(bus, "a", ["read", "write"])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=keyed_app), base_url="http://gateway") as client:
        assert "Sign in with an API key" in (await client.get("/runs")).text
        form = await client.get("/login")
        assert form.status_code == 200 and 'name="key"' in form.text
        wrong = await client.post("/login", data={"key": "fw_0123456789abcdef_not-a-real-key-at-all"})
        assert wrong.status_code == 401 and "API key" in wrong.text and 'id="message"' in wrong.text, wrong.text
        assert "flywheel_key" not in wrong.headers.get("set-cookie", "")
        signed = await client.post("/login", data={"key": writer})
        assert signed.status_code == 303 and signed.headers["location"] == "/runs"
        cookie = signed.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict"), cookie
        runs = await client.get("/runs")  # the client keeps the cookie, as a browser does
        assert runs.status_code == 200 and RUN in runs.text
        assert (await client.get(f"/v1/runs/{RUN}")).status_code == 200  # the pages' script reads the API
        assert 'data-action="pause"' in runs.text and 'data-action="stop"' in runs.text  # its buttons, running
        # A change with the cookie alone: only the run list's buttons, from a page of the gateway itself.
        stop = await client.post(f"/v1/runs/{RUN}/stop")  # no Origin: not from a page
        assert stop.status_code == 401, stop.text
        foreign = await client.post(f"/v1/runs/{RUN}/stop", headers={"Origin": "http://elsewhere.example"})
        assert foreign.status_code == 401, foreign.text
        tasks = await client.post("/v1/tasks", json={"run": RUN, "env": "math", "data": {}},
                                  headers={"Origin": "http://gateway"})
        assert tasks.status_code == 401, tasks.text  # not a button's
        paused = await client.post(f"/v1/runs/{RUN}/pause", headers={"Origin": "http://gateway"})
        assert paused.status_code == 200 and paused.json()["status"] == "paused", paused.text
        assert 'data-action="resume"' in (await client.get("/runs")).text
        # Reached the run (the key's): this one, with no config, has nothing to resume.
        resumed = await client.post(f"/v1/runs/{RUN}/resume", headers={"Origin": "http://gateway"})
        assert resumed.status_code == 409 and "nothing to resume" in resumed.text, resumed.text
        out = await client.get("/logout")
        assert out.status_code == 303
        assert (await client.get("/runs")).status_code == 401


async def test_the_run_page_filters_its_rollouts_as_the_trace_api_does(keyed_app: FastAPI,
                                                                       owned: dict[str, Any]) -> None:
    store: Store = keyed_app.state.store
    await store.record([rollout("rollout-late", run=RUN, policy_version=7)])
    page = (await get(keyed_app, f"/runs/{RUN}?min_policy_version=5&env=&reward=", owned["a"])).text
    assert 'href="/rollouts/rollout-late"' in page and f'href="/rollouts/{ROLLOUT}"' not in page, page
    assert 'name="min_policy_version" value="5"' in page
    none = (await get(keyed_app, f"/runs/{RUN}?min_policy_version=99", owned["a"])).text
    assert "No rollouts match these filters" in none
    for query, said in (("min_reward=lots", "min_reward: "), ("error=perhaps", "error: "), ("status=lost", "status: "),
                        ("min_reward=0.9&max_reward=0.1", "min_reward: is greater")):
        bad = await get(keyed_app, f"/runs/{RUN}?{query}", owned["a"])
        assert bad.status_code == 422 and said in bad.text, (query, bad.text)


async def test_usage_over_time_by_bucket_in_the_api_and_on_the_page(keyed_app: FastAPI, owned: dict[str, Any]) -> None:
    store: Store = keyed_app.state.store
    keyed_app.state.prices = keyed_app.state.prices.model_copy(update={"trained_per_mtok": 2.0})
    day = datetime(2026, 11, 2, tzinfo=UTC)
    await store.record([events.Usage(id=f"u{i}", run=RUN, source="trainer", step=i, trained_tokens=1000 * i,
                                     created_at=day + timedelta(hours=i)) for i in (1, 3)])
    query = f"since={day.isoformat()}&until={(day + timedelta(hours=4)).isoformat()}".replace("+", "%2B")
    report = (await get(keyed_app, f"/v1/usage/over-time?{query}", owned["a"])).json()
    assert (report["tenant"], report["bucket"], report["bucket_s"]) == ("a", "1h", 3600)
    assert [(b["start"], b["trained_tokens"], b["cost"]) for b in report["items"]] == [
        ("2026-11-02T00:00:00Z", 0, 0.0), ("2026-11-02T01:00:00Z", 1000, 0.002), ("2026-11-02T02:00:00Z", 0, 0.0),
        ("2026-11-02T03:00:00Z", 3000, 0.006)]
    daily = (await get(keyed_app, f"/v1/usage/over-time?{query}&bucket=1d", owned["a"])).json()["items"]
    assert [(b["start"], b["end"], b["trained_tokens"]) for b in daily] == [
        ("2026-11-02T00:00:00Z", "2026-11-03T00:00:00Z", 4000)]
    assert len((await get(keyed_app, "/v1/usage/over-time", owned["a"])).json()["items"]) in (168, 169)  # 7 days
    assert (await get(keyed_app, f"/v1/usage/over-time?{query}", owned["b"])).json()["items"][1]["trained_tokens"] == 0

    page = await get(keyed_app, f"/usage?{query}&bucket=", owned["a"])
    assert page.status_code == 200 and 'id="tokens-chart"' in page.text and 'data-page="usage"' in page.text
    data = page.text.split('<script type="application/json" id="usage-data">')[1].split("</script>")[0]
    assert json.loads(data)["items"] == report["items"]
    assert "From 2026-11-02 00:00:00 to 2026-11-02 04:00:00 UTC, by 1h" in page.text
    assert "4000" in page.text  # the table, over the same range
    assert "4000" not in (await get(keyed_app, "/usage?since=2026-11-03T00:00:00Z", owned["a"])).text
    cases = {"bucket=1w": "bucket: &#39;1w&#39; is not a bucket", "bucket=0h": "bucket: ",
             "bucket=1m&since=2026-01-01T00:00:00Z&until=2026-02-01T00:00:00Z": "bucket: 1m buckets from",
             "since=yesterday": "since: ", "since=2026-01-01T00:00:00": "since: input should have timezone",
             "since=1900-01-01T00:00:00Z": "since: 1900-01-01T00:00:00+00:00 is out of range",
             "since=2026-01-02T00:00:00Z&until=2026-01-01T00:00:00Z": "until: 2026-01-01T00:00:00+00:00 is not after"}
    for bad, said in cases.items():
        shown = await get(keyed_app, f"/usage?{bad}", owned["a"])
        assert shown.status_code == 422 and said in shown.text, (bad, shown.text)
        api = await get(keyed_app, f"/v1/usage/over-time?{bad}", owned["a"])
        assert api.status_code == 422 and api.json()["detail"].startswith(said.split(":")[0] + ": "), (bad, api.text)


async def test_the_runs_page_pages_to_older_runs(keyed_app: FastAPI, owned: dict[str, Any],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(web, "NUM_RUNS", 2)
    store: Store = keyed_app.state.store
    await store.upsert_runs([events.RunState(id=f"team/older-{i}", tenant="a", created_at=T0 + timedelta(minutes=i))
                             for i in range(3)])
    shown: list[str] = []
    url: str | None = "/runs"
    while url is not None:
        page = await get(keyed_app, url, owned["a"])
        assert page.status_code == 200, page.text
        shown += re.findall(r'<tr data-run="([^"]+)">', page.text)
        assert ('id="newest"' in page.text) == (url != "/runs")
        older = re.search(r'href="(/runs\?before=[^"]+)" id="older"', page.text)
        url = html.unescape(older.group(1)) if older else None
    assert shown == [RUN, "team/older-2", "team/older-1", "team/older-0"]  # newest first, each once
    for bad in ("/runs?before=nonsense", "/runs?before=" + "x" * 2000):
        refused = await get(keyed_app, bad, owned["a"])
        assert refused.status_code == 422 and "before: " in refused.text, refused.text
    assert (await get(keyed_app, "/runs?before=", owned["a"])).status_code == 200  # an empty field is none


async def test_the_run_page_shows_its_tenants_environment_workers_alone(keyed_app: FastAPI,
                                                                         owned: dict[str, Any]) -> None:
    bus: Bus = keyed_app.state.bus
    state = events.RunState(id=RUN, tenant="a", status="running",
                            config={"run": RUN, "envs": [{"id": "acme/qa@2.0"}, {"id": "math"}]})
    await (await bus.runs_kv()).put(RUN, events.encode(state))
    held = [{"environment": "acme/qa@2.0", "tenant": "a", "pid": 4101, "in_flight": 2, "calls": 17, "started_at": 0},
            {"environment": "math", "tenant": "a", "pid": 4102, "in_flight": 0, "calls": 3, "started_at": 0},
            {"environment": "math", "tenant": "b", "pid": 4103, "in_flight": 1, "calls": 9, "started_at": 0},
            {"environment": "arithmetic", "tenant": "a", "pid": 4104, "in_flight": 0, "calls": 1, "started_at": 0}]
    service = Service("inference", bus, info={"workers": lambda: held}, handle_signals=False)
    await service.beat()
    page = (await get(keyed_app, f"/runs/{RUN}", owned["a"])).text
    table = page[page.index('<table id="workers">'):]
    table = table[:table.index("</table>")]
    assert "<td>acme/qa@2.0</td>" in table and '<td class="num">4101</td>' in table
    assert '<td class="num">17</td>' in table and '<td class="num">4102</td>' in table
    assert "4103" not in page and "4104" not in page  # another tenant's, another environment's
    held.clear()
    await service.beat()
    page = (await get(keyed_app, f"/runs/{RUN}", owned["a"])).text
    assert '<table id="workers">' not in page and "No environment worker of this run is up" in page
