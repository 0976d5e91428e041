"""The runtime: how the platform runs code it did not write, and the pieces every service shares for it.

``isolation`` (a process in a sandbox of its own: bubblewrap, limits, the filesystem it sees),
``channel`` (framed two-way calls over a pipe), ``envworker`` (the environment worker: one
environment version in a sandboxed process, served over a channel), ``environments`` (the host
side: a pool of workers, environments loaded in them, a run's environments). Imports the
contract and the SDK, never the operator's tools.
"""
