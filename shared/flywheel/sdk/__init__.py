"""The SDK environment authors use: ``environment`` (task sets, rewards, the Environment),
``harness`` (how the model acts: chat tool loop, programs), ``rollout`` (the one runner of a
harness on a task, for inference and eval), ``scoring`` (the one scoring core, and what a
rollout's reward is), ``messages`` (chat messages as the OpenAI API and chat templates take
them), ``tracegraph`` (a rollout's graph: branch walks and token joins for every caller),
``models`` (the model folders Flywheel builds and loads), ``sandbox`` (the sandbox client and
its messages), ``sandbox_tools`` (bash and python tools over a rollout's sandbox, test runs
for rewards). Imports the contract, never the operator's tools.
"""
