"""Scorer: runs reward functions on rollouts and publishes one Score per reward.

    scorer.py     the consumer: rewards of a rollout -> Scores, run-config weights, composition root
    __main__.py   ``python -m flywheel_scorer [--function MODULE:FUNCTION --env ENV]``

The built-in scorer runs the rewards, metrics and group rewards of each run's environment (as
the run config loads and overrides it) on its rollouts; a custom scorer is one more durable
consumer of the same stream, with one user function (a reward or a group reward).
"""
