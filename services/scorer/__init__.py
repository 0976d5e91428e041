"""Scorer: runs an environment's reward functions on rollouts and publishes scores.
Not built yet: see the README's roadmap."""
