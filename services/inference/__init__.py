"""Inference: hosts the policy, rolls out tasks from the TASKS stream, publishes rollouts
and trace nodes, swaps in weight updates. Not built yet: see the README's roadmap."""
