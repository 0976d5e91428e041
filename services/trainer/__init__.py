"""Trainer: joins rollouts with their scores, computes advantages and the loss, publishes
weight updates. Not built yet: see the README's roadmap."""
