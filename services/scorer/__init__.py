"""Scorer: runs reward functions on rollouts and publishes one Score per reward.

    scorer.py     the consumer: rewards of a rollout -> Scores, run-config weights, composition root
    __main__.py   ``python -m flywheel_scorer [--function MODULE:FUNCTION --env ENV]``

The built-in scorer runs every environment's own rewards on every run's rollouts; a custom
scorer is one more durable consumer of the same stream, with one user function.
"""
