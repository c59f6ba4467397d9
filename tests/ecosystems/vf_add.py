"""A single-turn verifiers taskset for the adapter's tests: "What is a + b?", scored by
its own ``@vf.reward`` (the exact sum in the reply) and a ``@vf.metric``."""

import verifiers.v1 as vf

__all__ = ["AdditionTaskset"]


class AdditionData(vf.TaskData):
    answer: int


class AdditionTask(vf.Task[AdditionData]):
    @vf.reward
    async def exact_sum(self, trace: vf.Trace) -> float:
        return float(str(self.data.answer) in (trace.last_reply or "").split())

    @vf.metric
    async def reply_words(self, trace: vf.Trace) -> float:
        return float(len((trace.last_reply or "").split()))


class AdditionTaskset(vf.Taskset[AdditionTask, vf.TasksetConfig]):
    def load(self) -> list[AdditionTask]:
        return [
            AdditionTask(AdditionData(prompt=f"What is {i} + {i + 1}?", answer=2 * i + 1))
            for i in range(10)
        ]
