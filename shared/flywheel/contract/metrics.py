"""Prometheus metrics of every service, in one place: served at ``/metrics`` on the setting
``metrics_port`` (``FLYWHEEL_METRICS_PORT``; unset: not served, 0: a free port, which the
service's heartbeat names as ``info["metrics_port"]``).

One registry a process (``prometheus_client``'s default). The bus layer counts what every
consumer does (:class:`flywheel.contract.bus.Consumer`: outcomes, messages in flight, its lag as
of its last fetch, handler time) and what is published; the services add their own figures
below (tokens sampled, rollouts, admission, scoring, training steps, HTTP requests). Names
follow Prometheus' conventions: ``flywheel_<what>_<unit>``, counters end in ``_total``.

Each figure's labels are bounded by what the deployment runs: a consumer's durable, a run, a
reward's name, a route's template (never a raw path).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from opentelemetry import propagate, trace
from prometheus_client import Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)
_TRACER = trace.get_tracer(__name__)  # HTTP server spans (no-op unless tracing is set up)

# --- the bus layer (every service) ----------------------------------------------------------
MESSAGES = Counter("flywheel_consumer_messages_total", "Messages a consumer finished, by outcome "
                   "(acked, naked for a retry, dead_lettered, handed_back)", ["durable", "outcome"])
IN_FLIGHT = Gauge("flywheel_consumer_in_flight", "Messages a consumer fetched and has not finished", ["durable"])
PENDING = Gauge("flywheel_consumer_pending", "Messages on a consumer's subjects not yet delivered to it (its lag), "
                "as of its last fetch", ["durable"])
HANDLE_SECONDS = Histogram("flywheel_consumer_handle_seconds", "Time a consumer's handler took on a message or "
                           "a batch", ["durable"], buckets=(.005, .02, .1, .5, 1, 2.5, 10, 30, 120))
PUBLISHED = Counter("flywheel_published_events_total", "Events published, by stream", ["stream"])

# --- inference ------------------------------------------------------------------------------
TOKENS = Counter("flywheel_tokens_generated_total", "Tokens sampled by this inference replica", ["run"])
ROLLOUTS = Counter("flywheel_rollouts_total", "Rollouts this inference replica published, by status",
                   ["run", "status"])
ADMISSION = Gauge("flywheel_admission_rollouts", "A run's admission counters in this replica (issued, "
                  "in_flight, waiting, max_issued)", ["run", "counter"])

# --- scorer ---------------------------------------------------------------------------------
REWARD_SECONDS = Histogram("flywheel_reward_seconds", "Time a reward function took (a group reward: "
                           "on the whole group)", ["reward"], buckets=(.001, .01, .1, .5, 1, 5, 30, 120))
PARTITIONS = Gauge("flywheel_scorer_partitions", "Rollout partitions this scorer replica consumes", ["durable"])

# --- trainer --------------------------------------------------------------------------------
STEP_SECONDS = Histogram("flywheel_trainer_step_seconds", "Wall time of a training step (the update, not the "
                         "wait for rollouts)", ["run"], buckets=(.1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300))
VERSION = Gauge("flywheel_trainer_weights_version", "The latest weights version the trainer published", ["run"])
ROLLOUTS_TRAINED = Counter("flywheel_trainer_rollouts_total", "Rollouts the trainer took, by outcome "
                           "(trained, dropped)", ["run", "outcome"])

# --- gateway --------------------------------------------------------------------------------
HTTP_REQUESTS = Counter("flywheel_http_requests_total", "HTTP requests answered, by route template, method and "
                        "status", ["route", "method", "status"])
HTTP_SECONDS = Histogram("flywheel_http_request_seconds", "Time to answer an HTTP request (a stream: until its "
                         "headers)", ["route", "method"], buckets=(.005, .025, .1, .5, 1, 5, 30))

_served: dict[str, int] = {}  # "port": the port this process serves /metrics on, once it does


def serve(port: int | None, host: str = "127.0.0.1") -> int | None:
    """Serve ``/metrics`` on ``host``:``port`` (0: a free port), once a process; returns the
    port (None when ``port`` is None: not served). A port in use is an OSError naming it."""
    if port is None or "port" in _served:
        return _served.get("port")
    try:
        server, _ = start_http_server(port, addr=host)
    except OSError as exc:
        raise OSError(f"metrics_port {port}: cannot serve /metrics there ({exc}); choose a free port, or 0 for any "
                      "(FLYWHEEL_METRICS_PORT)") from exc
    _served["port"] = int(server.server_port)
    log.info("metrics at http://%s:%d/metrics", host, _served["port"])
    return _served["port"]


def served_port() -> int | None:
    """The port this process serves ``/metrics`` on (None: not served)."""
    return _served.get("port")


class ObservedHTTP:
    """ASGI middleware of a service's HTTP API: a server span a request, under the caller's
    trace when its ``traceparent`` header carries one, and the request's count and time to its
    response headers, labelled by the route's template (``/v1/runs/{run_id}``, never the path)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        started = time.monotonic()
        answered: dict[str, Any] = {"status": 500, "after_s": None}

        async def sent(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                answered.update(status=message["status"], after_s=time.monotonic() - started)
            await send(message)

        with _TRACER.start_as_current_span(f"{method}", context=propagate.extract(carrier),
                                           kind=trace.SpanKind.SERVER) as span:
            try:
                await self.app(scope, receive, sent)
            finally:
                route = getattr(scope.get("route"), "path", None) or "unmatched"
                span.update_name(f"{method} {route}")
                span.set_attribute("http.route", route)
                span.set_attribute("http.response.status_code", answered["status"])
                HTTP_REQUESTS.labels(route, method, str(answered["status"])).inc()
                after_s = answered["after_s"]
                HTTP_SECONDS.labels(route, method).observe(time.monotonic() - started if after_s is None else after_s)
