"""Another tenant's thing answers exactly as a thing that does not exist: every route of the
gateway (its API, the package index, the web pages) and of inference, walked from the apps' own
route tables, so a route added later is walked too (real nats-server, the real apps, keys on).

For each route, tenant ``b``'s key asks once for ``a``'s thing and once for one that exists
nowhere; the two answers must be the same (status, content type, body but for the id), and a
404, except where the route refuses by the name alone whatever exists (a key changes its own
tenant's environments only; a key's listings are its tenant's: 403 for both). Inference's
``model`` is ``RUN`` and ``RUN@STEP``; the interception endpoints take a rollout's own key as
their credential, so there a key of a's rollout that ended answers as one never made (401). A
route whose parameter the tables here do not know fails the test, naming it.

Found: 403 for another tenant's, 404 for a missing one, so any key could tell which run,
rollout, task, key and environment ids other tenants use.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute, iter_route_contexts

from flywheel.contract import events
from flywheel.contract.bus import Bus
from flywheel.runtime.natsserver import NatsServer
from tests.security.fail_closed import (
    MISSING,
    OWNED,
    RUN,
    call,
    completion,
    keyed_gateway,
    keyed_inference,
    make_keys,
    own_things,
    same_answer,
)

# Routes that name nothing of a tenant's in their path or query (listings, the login, probes,
# the docs); the gateway's auth tests show that a key sees its own tenant's alone in them.
NAMES_NOTHING = {"/healthz", "/", "/runs", "/environments", "/usage", "/login", "/logout", "/v1/keys",
                 "/v1/hub/environments", "/hub/simple/", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc",
                 "/v1/models"}
# Query parameters that name a tenant's thing (-> the key of its value in OWNED and MISSING).
QUERIES = {"run": "run_id", "tenant": "tenant"}
# Refused by the owner in the path alone, the same whether or not that environment exists.
BY_OWNER_NAME = {("PATCH", "/v1/hub/environments/{owner}/{name}"),
                 ("POST", "/v1/hub/environments/{owner}/{name}/versions")}
# POST /v1/tasks and POST /v1/runs create the run they name when it is new: run ids are one namespace, so that one
# is taken shows (a 409 naming no owner), as a taken user name shows at a sign-up.
CREATES = {("POST", "/v1/tasks"), ("POST", "/v1/runs")}
BODIES = {("PATCH", "/v1/hub/environments/{owner}/{name}"): {"private": False},
          ("POST", "/v1/hub/environments/{owner}/{name}/evals"): {"version": "0.1.0", "reward_mean": 1.0,
                                                                   "num_tasks": 1, "num_rollouts": 1}}


def routes_of(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) of every route of ``app`` that FastAPI handles (API and pages, the included
    routers' too), as the app's own table lists them."""
    return [(method, str(ctx.path)) for ctx in iter_route_contexts(app.routes)
            if isinstance(ctx.original_route, APIRoute) for method in sorted((ctx.methods or set()) - {"HEAD"})]


def fill(path: str, values: dict[str, str]) -> str:
    return re.sub(r"\{(\w+)(?::path)?\}", lambda m: values[m.group(1)], path)


def walked(app: FastAPI, owned: dict[str, str]) -> list[tuple[str, str, str, str]]:
    """(method, route, url of a's thing, url of the missing one) for every route that names
    something: each path parameter, and each query parameter of ``QUERIES`` the route takes."""
    spec = app.openapi()["paths"]
    missing = MISSING | {"node_id": owned["node_id"]}  # a node of a rollout that does not exist
    found = []
    for method, path in routes_of(app):
        if (method, path) in CREATES:
            continue
        params = re.findall(r"\{(\w+)(?::path)?\}", path)
        operation = spec.get(re.sub(r":path\}", "}", path), {}).get(method.lower(), {})
        queries = [p["name"] for p in operation.get("parameters", []) if p["in"] == "query"]
        named = [q for q in queries if q in QUERIES]
        if not params and not named:
            assert path in NAMES_NOTHING, f"{method} {path}: which of a tenant's things does it name? add it here"
            continue
        unknown = [p for p in params if p not in owned]
        assert not unknown, f"{method} {path}: add a value of {unknown} to OWNED and MISSING"
        if params:
            found.append((method, path, fill(path, owned), fill(path, missing)))
        for query in named:
            found.append((method, path, f"{fill(path, owned)}?{query}={owned[QUERIES[query]]}",
                          f"{fill(path, missing)}?{query}={missing[QUERIES[query]]}"))
    return found


def renamed(owned: dict[str, str]) -> dict[str, str]:
    """Each missing id -> a's, the longest first (a project name holds an environment's name)."""
    pairs = {MISSING[name]: value for name, value in owned.items() if name in MISSING and MISSING[name] != value}
    return dict(sorted(pairs.items(), key=lambda pair: -len(pair[0])))


async def test_the_gateway_answers_another_tenants_as_a_missing_one(nats_server: NatsServer, tmp_path: Path) -> None:
    async with keyed_gateway(nats_server.url, tmp_path / "data") as app:
        made = await make_keys(app.state.bus)
        owned = OWNED | {"node_id": await own_things(app), "key_id": made.id_of("a")}
        routes = walked(app, owned)
        covered = {(method, route) for method, route, _, _ in routes}
        assert {("GET", "/v1/runs/{run_id:path}"), ("POST", "/v1/runs/{run_id:path}/stop"),
                ("GET", "/v1/traces/{rollout_id}/stream"), ("GET", "/v1/tasks/{task_id}"),
                ("GET", "/v1/usage"), ("DELETE", "/v1/keys/{key_id}"), ("GET", "/hub/simple/{project}/"),
                ("GET", "/hub/files/{filename}"), ("GET", "/v1/hub/environments/{owner}/{name}/evals"),
                ("GET", "/runs/{run_id:path}"), ("GET", "/environments/{owner}/{name}")} <= covered
        names = renamed(owned)
        for method, route, owned_url, missing_url in routes:
            body: Any = BODIES.get((method, route))
            theirs = await call(app, method, owned_url, made["b"], json=body)
            missing = await call(app, method, missing_url, made["b"], json=body)
            what = f"{method} {owned_url}"
            # A key's listings are its tenant's: another tenant asked for is a 403 whatever exists.
            expected = 403 if (method, route) in BY_OWNER_NAME or "?tenant=" in owned_url else 404
            if theirs.status_code == 200 and "?run=" in owned_url:  # a listing filtered to a's run: b's, so empty
                # (an export of nothing is its end line alone)
                assert theirs.json() in ({"end": {"num_rollouts": 0}}, ) or theirs.json().get("items") == [], (
                    what, theirs.text)
            else:
                assert theirs.status_code == expected, (what, theirs.text)
            same_answer(theirs, missing, names)
            if method == "GET" and not route.endswith("/stream"):  # the url does name a's thing
                mine = await call(app, method, owned_url, made["a"])
                assert mine.status_code == 200, (what, mine.text)
        # The run of another tenant, and one whose owner cannot be read, are alike too.
        await (await app.state.bus.runs_kv()).put(RUN, b"not a run state")
        for key in (made["a"], made["b"]):
            same_answer(await call(app, "GET", f"/v1/runs/{RUN}", key),
                        await call(app, "GET", f"/v1/runs/{MISSING['run_id']}", key), names)


async def test_inference_answers_another_tenants_model_as_a_missing_one(nats_server: NatsServer, bus: Bus,
                                                                        tmp_path: Path, tiny_model_dir: Path) -> None:
    made = await make_keys(bus)
    async with keyed_inference(nats_server.url, tmp_path / "data", bus, tiny_model_dir) as app:
        interception = app.state.interception
        ended = interception.open(RUN, "rollout-of-a", None, events.Sampling(), None).key
        interception.close(ended)  # a's rollout key, once live: now as good as one never made
        walked_routes = set()
        for method, path in routes_of(app):
            if path in NAMES_NOTHING:
                continue
            walked_routes.add((method, path))
            pairs: list[tuple[str, str, dict[str, Any] | None, dict[str, Any] | None, dict[str, str]]]
            if "{key}" in path:
                pairs = [(path.replace("{key}", ended), path.replace("{key}", "fw-never-made"),
                          None, None, {"fw-never-made": ended})]
            else:
                assert path in ("/v1/chat/completions", "/v1/completions"), \
                    f"{method} {path}: which of a's things does it name? add it here"
                chat = {"messages": [{"role": "user", "content": "abc"}]} if "chat" in path else {}
                pairs = [(path, path, completion(model) | chat, completion(missing) | chat,
                          {"no-such-run": RUN}) for model, missing in ((RUN, "no-such-run"),
                                                                       (f"{RUN}@0", "no-such-run@0"))]
            for owned_url, missing_url, owned_body, missing_body, names in pairs:
                theirs = await call(app, method, owned_url, made["b"], json=owned_body)
                missing = await call(app, method, missing_url, made["b"], json=missing_body)
                what = f"{method} {owned_url} {owned_body}"
                assert theirs.status_code == (401 if "{key}" in path else 404), (what, theirs.text)
                assert "choices" not in theirs.text, what
                same_answer(theirs, missing, names)
                if owned_body is not None:  # the body does name a's run: a's key is served
                    mine = await call(app, method, owned_url, made["a"], json=owned_body)
                    assert mine.status_code == 200 and mine.json()["choices"], (what, mine.text)
        assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                ("POST", "/intercept/{key}/v1/chat/completions")} <= walked_routes
