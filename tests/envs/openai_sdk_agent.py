"""A test environment whose harness is a program: tests/envs/openai_agent.py, run unchanged, in
a subprocess or, with runtime sandbox, inside the rollout's sandbox. ``probe_url``: a URL the
agent tries to fetch after its conversation (it records whether it got there)."""

from pathlib import Path

from flywheel.sdk.environment import Environment, Reward
from flywheel.sdk.harness import ProgramHarness


def answered(state: dict) -> float:
    return float(len(state.get("answers", [])) == 3)


def load_environment(probe_url: str | None = None) -> Environment:
    return Environment(
        name="openai_sdk_agent",
        tasks=[{"text": "abc"}, {"text": "cab"}],
        prompt=lambda task: task["text"],
        harness=ProgramHarness(["{python}", "openai_agent.py"], timeout_s=120,
                               files={"openai_agent.py": Path(__file__).with_name("openai_agent.py")},
                               env={"PROBE_URL": probe_url} if probe_url else {}),
        rewards=[Reward(answered)],
    )
