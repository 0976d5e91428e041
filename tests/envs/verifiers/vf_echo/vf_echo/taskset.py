"""A single-turn verifiers v1 taskset, as ``vf-init vf-echo`` scaffolds one: say the word the prompt names."""

import verifiers.v1 as vf

WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "piano"]


class VfEchoData(vf.TaskData):
    word: str


class VfEchoTask(vf.Task[VfEchoData]):
    @vf.reward(weight=1.0)
    async def says_word(self, trace: vf.Trace) -> float:
        return float(self.data.word in trace.last_reply.lower())

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return 1.0 if len(trace.last_reply.split()) <= 3 else 0.0

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class VfEchoConfig(vf.TasksetConfig):
    num_tasks: int = 8
    """How many tasks to build."""


class VfEchoTaskset(vf.Taskset[VfEchoTask, VfEchoConfig]):
    def load(self) -> list[VfEchoTask]:
        return [VfEchoTask(VfEchoData(prompt=f"Say the word {w}.", word=w), self.config.task)
                for w in WORDS[: self.config.num_tasks]]
