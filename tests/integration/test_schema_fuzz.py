"""Schema fuzzing of the gateway: requests generated from its own OpenAPI schema, answered
by the real app (uvicorn, a real nats-server, a SQLite store), must never be a server
error and must conform to that schema.

schemathesis generates, for every operation, requests that fit the schema (positive) and
requests that break it (negative); each answer goes through its checks: no 5xx, a
documented status code, content type, headers and body. The test also asserts that some
requests were accepted (2xx), so a schema that nothing satisfies cannot pass it. The
examples are derandomized (the same ones every run) and bounded in number, so the test
takes about half a minute here; for a longer search, widen ``EXAMPLES``, or serve a gateway and
run ``st run http://HOST:PORT/openapi.json`` (all phases, stateful included).

Not covered: schemathesis' stateful phase (links between operations), request bodies
larger than the schema bounds (tests/integration/test_gateway_api.py tests the size
limits), the live trace stream beyond its 404 (no rollout the fuzzer names is on the bus),
and a run's stream beyond its first second.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import hypothesis
import pytest
import requests
import schemathesis
import uvicorn
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.errors import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from flywheel.contract import events
from flywheel.contract.settings import Settings
from flywheel.runtime.natsserver import NatsServer, free_port
from flywheel_gateway import api_runs
from flywheel_gateway.app import create_app
from flywheel_gateway.migrate import migrate
from flywheel_gateway.store import Store
from tests.unit.test_store import rollout, score, task

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]
EXAMPLES = 8  # per operation and mode (positive, negative): about 20 s here for all of them
REQUEST_TIMEOUT_S = 10.0
START_TIMEOUT_S = 30.0


@pytest.fixture
def gateway_url(nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The gateway served by uvicorn on a free port, in a thread with its own event loop
    (schemathesis calls it synchronously), its store holding a few tasks, rollouts and scores
    for the listings to show. A run's stream ends within a second: the runs that POST
    /v1/tasks creates never run, and their streams would stay open (schemathesis reads a
    response to its end)."""
    monkeypatch.setattr(api_runs, "STREAM_MAX_S", 1.0)
    settings = Settings(nats_url=nats_server.url, data_dir=tmp_path / "data")
    asyncio.run(_record(settings.resolved_database_url, [task(1), rollout("ro1"), rollout("ro2", policy_version=0),
                                                          score("s1", "ro1", 1.0)]))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    serving = threading.Thread(target=server.run, name="gateway", daemon=True)
    serving.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        assert serving.is_alive() and time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.05)  # noqa: sleep - the polling interval of this bounded wait (a thread, no event loop here)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        serving.join(START_TIMEOUT_S)


async def _record(url: str, batch: list[events.Event]) -> None:
    await migrate(url)
    store = Store.open(url)
    try:
        await store.record(batch)
    finally:
        await store.close()


@pytest.mark.long
def test_the_gateway_answers_what_its_schema_says(gateway_url: str) -> None:
    schema = schemathesis.openapi.from_url(f"{gateway_url}/openapi.json")
    statuses: Counter[int] = Counter()
    session = requests.Session()
    num_operations = 0
    failures: list[str] = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result.err()  # the schema of every operation loads
        operation = result.ok()
        num_operations += 1
        takes_input = any((operation.path_parameters, operation.query, operation.headers, operation.body))
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if takes_input else (GenerationMode.POSITIVE,):

            @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
            @hypothesis.settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                                 suppress_health_check=list(hypothesis.HealthCheck), print_blob=True)
            def check(case: schemathesis.Case) -> None:
                response = case.call(base_url=gateway_url, session=session, timeout=REQUEST_TIMEOUT_S)
                statuses[response.status_code] += 1
                case.validate_response(response, checks=CHECKS)

            try:
                check()
            except Unsatisfiable:
                if mode is GenerationMode.POSITIVE:
                    raise
                # Nothing of its input can break the schema in a way HTTP carries (a path
                # parameter with no constraint): no negative cases to send.
            except (FailureGroup, Exception) as exc:
                failures.append(f"{operation.label} ({mode.value} cases): {exc}")
    print(f"statuses of {sum(statuses.values())} requests: {dict(sorted(statuses.items()))}")
    assert not failures, "\n\n".join(failures)
    assert num_operations >= 13
    assert not [status for status in statuses if status >= 500], statuses
    assert sum(n for status, n in statuses.items() if 200 <= status < 300) > 0, statuses
