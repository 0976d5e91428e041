"""A test environment whose harness is tests/envs/sdk_agent.py, run unchanged: an agent on the
Responses API or on the Messages API, as its task says."""

from pathlib import Path

from flywheel.sdk.environment import Environment, Reward
from flywheel.sdk.harness import ProgramHarness


def answered(state: dict) -> float:
    return float(len(state.get("answers", [])) == 3)


def load_environment() -> Environment:
    return Environment(
        name="sdk_agents",
        tasks=[{"text": "abc", "api": "responses"}, {"text": "cab", "api": "messages"}],
        prompt=lambda task: task["text"],
        harness=ProgramHarness(["{python}", str(Path(__file__).with_name("sdk_agent.py"))], timeout_s=120),
        rewards=[Reward(answered)],
    )
