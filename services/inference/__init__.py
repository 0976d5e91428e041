"""Inference: hosts each run's policy, rolls out tasks from the TASKS stream, publishes trace
nodes and rollouts, swaps in weight updates, and serves the policies over an
OpenAI-compatible HTTP API.

Parts: ``backends`` (the sampling loop behind one interface), ``policy`` (batching and
weight swaps per run), ``admission`` (how far sampling may run ahead of the trainer),
``interception`` (each rollout's OpenAI endpoint, recording the trace graph), ``worker``
(the task consumer, the weights and run-state watchers), ``teacher`` (the runs' teachers:
their logprobs of rollouts as signals), ``api`` (HTTP routes), ``app``
(the composition root); ``__main__`` is the entry point.
"""
