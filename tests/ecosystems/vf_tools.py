"""A verifiers taskset with a tool for the adapter's tests: the ``add`` tool of
``vf_calculator`` (served over MCP to verifiers' chat harness), scored by the exact sum."""

import verifiers.v1 as vf
from vf_calculator import Calculator

__all__ = ["AddToolTaskset"]


class AddToolData(vf.TaskData):
    answer: int


class AddToolTask(vf.Task[AddToolData]):
    @vf.reward
    async def exact_sum(self, trace: vf.Trace) -> float:
        return float(str(self.data.answer) in (trace.last_reply or "").split())


class AddToolConfig(vf.TasksetConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class AddToolTaskset(vf.Taskset[AddToolTask, AddToolConfig]):
    @classmethod
    def toolsets(cls, config: AddToolConfig) -> list[vf.Toolset]:
        return [Calculator(config.tools)]

    def load(self) -> list[AddToolTask]:
        return [
            AddToolTask(AddToolData(prompt=f"Use the tool: what is {i} + 7?", answer=i + 7))
            for i in range(10)
        ]
