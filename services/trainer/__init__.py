"""Trainer: joins a run's rollouts with their scores, computes advantages and the loss,
publishes weight updates; asynchronous RL with bounded staleness. One process per run.

Files, in the order data flows through them:

- ``__main__.py``: ``python -m flywheel_trainer --run RUN`` (thin: heavy imports wait)
- ``service.py``: the composition root and the training loop (consume, step, checkpoint, publish)
- ``join.py``: rollouts meet their scores; readiness, staleness and drops; whole groups out
- ``ledger.py``: the run folder on disk: journal of received work, checkpoints, metrics.jsonl
- ``advantages.py``: ``ADVANTAGES`` (group_mean, leave_one_out), chosen by ``trainer.advantage``
- ``batch.py``: token sequences to padded tensors; the recomputed logprobs
- ``losses.py``: ``LOSSES`` (clipped, masked), chosen by ``trainer.loss``
- ``learner.py``: one optimizer step, and the SFT warm-up
- ``engines.py``: ``ENGINES`` (torch, deepspeed), chosen by ``trainer.engine``
"""
