"""Flywheel: the package every service and every user program imports, in four layers.

Each layer imports only the ones before it (``tests/unit/test_layout.py`` checks it):

- :mod:`flywheel.contract`: what every service needs to take part in the bus: the events,
  the bus layer, the service lifecycle, settings, run state, weight blobs, the run config.
  Light: it pulls in no torch, fastapi or sqlalchemy.
- :mod:`flywheel.sdk`: what environment authors use: environments, harnesses, messages,
  the trace graph, models, the sandbox client and sandbox tools.
- :mod:`flywheel.runtime`: how the platform runs code it did not write: environment workers
  (sandboxed processes with no credential) and the pool that starts them, sandboxes, the
  model relay.
- :mod:`flywheel.ops`: the operator's tools: the ``flywheel`` command, the embedded stack,
  ``flywheel run``, ``flywheel eval``, the environment scaffold, the local nats-server
  runner, the Python client.

Importing ``flywheel`` itself pulls in nothing.
"""

__version__ = "0.1.0"
