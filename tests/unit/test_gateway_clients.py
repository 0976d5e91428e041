"""One way to the gateway: every HTTP client of the platform's code, listed with what it talks to.

A client of the gateway's API is made by :mod:`flywheel.sdk.gateway` alone (the hub client, the
trace API client, ``flywheel run --remote``, the training API's quota, ``flywheel up``'s and
``flywheel status``'s health checks), so they agree on the URL, the key and a refusal's words.
A module that makes an HTTP client of its own is listed here, with the server it talks to.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
CLIENTS = {
    "shared/flywheel/sdk/gateway.py": "the gateway: every client of its API",
    "shared/flywheel/sdk/harness.py": "a harness's model endpoint (its rollout's interception URL)",
    "shared/flywheel/sdk/egress.py": "an environment's network, through its worker's egress",
    "shared/flywheel/runtime/environments.py": "the egress of environment workers, to the world outside",
    "shared/flywheel/runtime/envworker.py": "the worker's host, over its channel",
    "shared/flywheel/runtime/relay.py": "a sandbox's one way out, to its rollout's model endpoint",
    "shared/flywheel/runtime/evalproxy.py": "the endpoint an eval evaluates (any OpenAI-compatible server)",
    "shared/flywheel/runtime/evaluation.py": "the endpoint an eval evaluates: its /models",
    "shared/flywheel/ops/evalmodel.py": "the local inference service, until it serves the model an eval asked for",
    "shared/flywheel/ops/scaffold.py": "a scripted model, in the tests it writes (no network)",
    "services/inference/rollouts.py": "the interception endpoint, in process",
}
MAKES_CLIENT = re.compile(r"httpx\.(Async)?Client\(")


def test_every_http_client_is_listed_with_its_server() -> None:
    found = {str(p.relative_to(ROOT)) for folder in ("shared", "services") for p in (ROOT / folder).rglob("*.py")
             if MAKES_CLIENT.search(p.read_text())}
    assert found - set(CLIENTS) == set(), ("an HTTP client made outside the list: a client of the gateway comes from "
                                           "flywheel.sdk.gateway; another server's goes in CLIENTS with its reason")
    assert set(CLIENTS) - found == set(), "listed modules that make no client any more: take them off"
