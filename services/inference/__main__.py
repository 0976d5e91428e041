"""``python -m flywheel_inference``: the inference worker and its OpenAI-compatible API, one process.

Settings come from FLYWHEEL_* (see :mod:`flywheel.contract.settings`; the worker's bounds and
timeouts are section ``inference``: ``FLYWHEEL_INFERENCE__<FIELD>``); the HTTP server listens on
inference_host:inference_port (``--host``/``--port`` override them). torch,
transformers, fastapi and uvicorn are imported only once the arguments are parsed, so
``--help`` is instant.
"""

from __future__ import annotations

import argparse
import sys

from flywheel.contract.settings import Settings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m flywheel_inference",
        description="Flywheel inference: rolls out tasks from the bus with each run's policy, swaps in weight "
                    "updates, and serves the policies over an OpenAI-compatible API. Other settings come from "
                    "FLYWHEEL_* environment variables.")
    parser.add_argument("--host", help="HTTP address (setting inference_host, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="HTTP port (setting inference_port, default 8421)")
    args = parser.parse_args(argv)

    from flywheel.contract.service import setup_logging, setup_telemetry, setup_torch_threads

    try:
        settings = Settings.load()
    except ValueError as exc:
        parser.error(str(exc))
    args.host = args.host or settings.inference_host
    args.port = args.port or settings.inference_port
    setup_logging(settings.log_level)
    setup_telemetry("inference", settings)
    setup_torch_threads(settings.torch_threads)

    import uvicorn

    from flywheel_inference.app import create_app

    server: uvicorn.Server | None = None

    def stop_server() -> None:
        assert server is not None
        server.should_exit = True

    app = create_app(settings, url=f"http://{args.host}:{args.port}", on_worker_exit=stop_server)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=settings.log_level.lower()))
    server.run()
    if not server.started or getattr(app.state, "worker_failed", False):
        sys.exit(1)


if __name__ == "__main__":
    from flywheel.contract.heap import enable_heap_freeze

    enable_heap_freeze()  # this process is the service's own (not a test calling main())
    main()
