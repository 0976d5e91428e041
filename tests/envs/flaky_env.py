"""A test environment whose harness fails on some rows, and whose rows have a schema."""

from flywheel.sdk.environment import Environment, Reward, TaskSet
from flywheel.sdk.harness import ChatHarness, RolloutContext


class FlakyHarness(ChatHarness):
    async def run(self, env: Environment, ctx: RolloutContext) -> None:
        await super().run(env, ctx)  # the model is called, then the harness fails
        if ctx.task["fail"]:
            raise RuntimeError("the tool server is down")


def load_environment() -> Environment:
    return Environment(
        name="flaky_env",
        tasks=TaskSet.from_rows([{"text": "ab", "fail": False}], schema={"text": str, "fail": bool}),
        prompt=lambda task: task["text"],
        harness=FlakyHarness(max_turns=1),
        rewards=[Reward(lambda completion: 1.0, name="one")],
    )
