"""A test environment on the RLM harness whose preamble asks the model twice through
``llm_query`` before the first turn: with a model that writes no code (the tiny one), its
rollouts still hold sub-calls, made from inside the sandbox, for tests of how they are recorded
and trained."""

from flywheel.sdk.environment import Environment, Reward
from flywheel.sdk.rlm import RLMHarness

PREAMBLE = "a = llm_query('Say a word.')\nb = llm_query('Say another word.')\nprint('asked twice')"


def load_environment() -> Environment:
    return Environment(
        name="rlm_subcalls",
        tasks=[{"question": "How many lines?", "context": "line\n" * 500}],
        prompt=lambda task: task["question"],
        harness=RLMHarness(max_turns=1, preamble=PREAMBLE, system_prompt="Answer with code."),
        rewards=[Reward(lambda state: float(state.get("sub_calls") == 2), name="asked")],
    )
