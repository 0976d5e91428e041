"""Gateway: the HTTP API (publish tasks, trace API, web pages) and the recorder.

The recorder is a consumer of every stream that writes the trace store; it runs as its
own process (``python -m flywheel_gateway recorder``) so the API keeps serving while it
restarts. Entry points live in ``__main__``.
"""
