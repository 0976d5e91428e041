"""The contract: what every service needs to take part in the bus.

``events`` (every message on the bus), ``bus`` (streams, publishing, the one consumer loop,
dead letters, watches), ``service`` (process lifecycle: signals, heartbeats, shutdown),
``heap`` (a service's heap frozen out of the garbage collector), ``settings`` (typed
settings), ``runs`` (run state in its KV bucket, when a run ended), ``weights`` (weight
blobs, verified), ``config`` (a run's config). Imports nothing of the SDK or the
operator's tools, and nothing heavy.
"""
