"""A multi-turn verifiers v1 taskset with a tool, as ``vf-init vf-lookup -T`` scaffolds one: the
model looks a room's access code up with the ``lookup`` tool (an MCP tool server), then answers it."""

import verifiers.v1 as vf

from vf_lookup.servers.tool import CODES, VfLookupToolset


class VfLookupData(vf.TaskData):
    room: str
    code: str


class VfLookupTaskConfig(vf.TaskConfig):
    """Knobs the task reads from ``self.config``; configure them under ``--env.taskset.task.*``."""
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class VfLookupTask(vf.Task[VfLookupData, vf.State, VfLookupTaskConfig]):
    @classmethod
    def toolsets(cls, config: VfLookupTaskConfig) -> list[vf.Toolset]:
        return [VfLookupToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(self.data.code in trace.last_reply)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(sum(1 for m in trace.messages if m.role == "tool"))


class VfLookupConfig(vf.TasksetConfig):
    num_tasks: int = 5
    """How many tasks to build."""
    task: VfLookupTaskConfig = VfLookupTaskConfig()


class VfLookupTaskset(vf.Taskset[VfLookupTask, VfLookupConfig]):
    def load(self) -> list[VfLookupTask]:
        rooms = sorted(CODES)[: self.config.num_tasks]
        return [VfLookupTask(VfLookupData(prompt=f"What is the access code of room {room}? Look it up, then answer "
                                                 "with the code.", room=room, code=CODES[room]), self.config.task)
                for room in rooms]
