"""A test environment whose harness is a program: tests/envs/openai_agent.py, run unchanged."""

from pathlib import Path

from flywheel.sdk.environment import Environment, Reward
from flywheel.sdk.harness import ProgramHarness


def answered(state: dict) -> float:
    return float(len(state.get("answers", [])) == 3)


def load_environment() -> Environment:
    return Environment(
        name="openai_sdk_agent",
        tasks=[{"text": "abc"}, {"text": "cab"}],
        prompt=lambda task: task["text"],
        harness=ProgramHarness(["{python}", str(Path(__file__).with_name("openai_agent.py"))], timeout_s=120),
        rewards=[Reward(answered)],
    )
