"""Flywheel: the package every service and every user program imports.

Light on purpose: importing ``flywheel`` pulls in nothing heavy. The parts:
``events`` (the bus contract), ``bus`` (JetStream streams, publish, the consumer loop),
``service`` (process lifecycle: signals, heartbeats, shutdown), ``settings``,
``natsserver`` (a local nats-server for the embedded stack and tests),
``client`` (publish tasks from Python), ``cli`` (the ``flywheel`` command).
"""

__version__ = "0.1.0"
