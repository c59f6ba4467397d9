"""ToolEnv: a ready tool-calling env from a task, a set of tools and a verifier.

Each turn the model either calls tools — the episode runs them with the env's
``tool_runner`` (:class:`~rollpipe.agent.tool_runner.ToolRunner`: off the event loop,
each with a time limit, results cut to ``max_result_chars``, bad calls answered with what
was wrong), and ``step`` gets the action with its results and answers with their ``tool``
messages, one per call — or answers in plain content, which ends the episode with the
verifier's reward.
Only the given callables ever run: nothing the model writes is executed as code.
Its episodes get their own system prompt (``system_prompt``, :data:`DEFAULT_TOOL_PROMPT`
unless given) ahead of the template's tools block, not the pipeline's, which is written
for text games.

Examples:
    A custom tool env: a task, a typed tool, a verifier.

    >>> import random
    >>> def multiply(a: int, b: int) -> int:
    ...     '''Multiply two integers.
    ...
    ...     Args:
    ...         a: the first factor
    ...         b: the second factor
    ...     '''
    ...     return a * b
    >>> def task(seed: int) -> tuple[str, int]:
    ...     rng = random.Random(seed)
    ...     a, b = rng.randint(10, 99), rng.randint(10, 99)
    ...     return f"What is {a} * {b}? Use the tool, then answer with the number.", a * b
    >>> env = ToolEnv(task, [multiply], verifier=lambda answer, truth: float(str(truth) in answer))
    >>> prompt, info = env.reset(seed=0)
    >>> env.tools.names, prompt == task(0)[0], info
    (('multiply',), True, {'success': False})
    >>> env.tool_runner.max_result_chars  # the episode runs the tools with it
    16000
    >>> env.close()
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal

from rollpipe.agent.actions import AssistantAction
from rollpipe.agent.tool_runner import DEFAULT_MAX_RESULT_CHARS, ToolRunner, results_of
from rollpipe.agent.tools import Tool, ToolSet, runs_inline
from rollpipe.envs.base import EnvStateError, Info, check_seed

__all__ = ["DEFAULT_TOOL_PROMPT", "ToolEnv"]

Task = Callable[[int], tuple[str, Any]]
Verifier = Callable[[str, Any], float]

DEFAULT_TOOL_PROMPT = (
    "You are an assistant with tools. Call a tool when it helps, then give the final "
    "answer in plain text."
)
"""ToolEnv's system prompt (the pipeline's default is written for text games)."""


class ToolEnv:
    """A task answered with tools (see the module doc).

    Args:
        task: ``task(seed) -> (prompt, truth)``: the first user message and what the
            verifier compares the answer with; the same seed gives the same task. With a
            dataset (``PipelineConfig(dataset=...)``) each episode's row is the task
            instead: ``row[prompt_key]`` the prompt, ``row[answer_key]`` the truth (a
            string row is the prompt, truth None); ``task`` may then be None.
        tools: typed callables with docstrings, or OpenAI schemas (``rollpipe.agent.tools``).
        verifier: ``verifier(answer_content, truth) -> reward``; a reward > 0 is success.
        max_tool_turns: turns of tool calls before the episode is truncated (reward 0).
        tool_timeout_s: limit of one tool call (None: none).
        max_threads: worker threads for blocking tools.
        max_result_chars: a tool result longer than this is cut (counted as
            ``tool/cut``; None: no limit).
        system_prompt: the system message of this env's episodes, before the tools
            block (the pipeline's ``system_prompt`` is for text games); None sends no
            system message of its own (the template still writes the tools block).
        prompt_key / answer_key: a dataset row's fields (as ``PromptTask``'s).

    Examples:
        One turn of tool calls (run as the episode runs them), then the answer:

        >>> import asyncio, attrs
        >>> from rollpipe.agent.actions import ToolCall
        >>> from rollpipe.envs.calculator import calculate
        >>> env = ToolEnv(lambda seed: ("What is 6 * 7?", 42), [calculate],
        ...               verifier=lambda answer, truth: float(str(truth) in answer))
        >>> prompt, info = env.reset(seed=0)
        >>> call = ToolCall.from_json("call_0_0", "calculate", '{"expression": "6 * 7"}')
        >>> calls = AssistantAction("<tool_call>...</tool_call>", "", [call])
        >>> results = asyncio.run(env.tool_runner.run(calls))
        >>> calls = attrs.evolve(calls, tool_results=results)
        >>> messages, reward, done, cut, info = asyncio.run(env.step(calls))
        >>> [m["content"] for m in messages], reward, done, info["metrics"]["tool/calls"]
        (['42'], 0.0, False, 1.0)
        >>> asyncio.run(env.step(AssistantAction.plain("It is 42.")))[1:3]  # reward, terminated
        (1.0, True)
        >>> env.close()
    """

    step_input: ClassVar[Literal["action"]] = "action"

    def __init__(
        self,
        task: Task | None,
        tools: Sequence[Tool],
        verifier: Verifier,
        *,
        max_tool_turns: int = 4,
        tool_timeout_s: float | None = 10.0,
        max_threads: int = 2,
        max_result_chars: int | None = DEFAULT_MAX_RESULT_CHARS,
        system_prompt: str | None = DEFAULT_TOOL_PROMPT,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
    ) -> None:
        if not (task is None or callable(task)) or not callable(verifier):
            raise ValueError(
                f"ToolEnv: task (or None: dataset rows) and verifier must be callables, "
                f"got task={task!r}, "
                f"verifier={verifier!r}"
            )
        if not isinstance(max_tool_turns, int) or max_tool_turns < 1:
            raise ValueError(f"ToolEnv.max_tool_turns must be an int >= 1, got {max_tool_turns!r}")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ValueError(
                f"ToolEnv.system_prompt must be a str or None (no system message), "
                f"got {system_prompt!r}"
            )
        self.system_prompt = system_prompt
        self.tools = ToolSet(tools)
        self.task, self.verifier, self.max_tool_turns = task, verifier, max_tool_turns
        self.prompt_key, self.answer_key = prompt_key, answer_key
        self.tool_runner = ToolRunner(
            self.tools,
            timeout_s=tool_timeout_s,
            max_threads=max_threads,
            max_result_chars=max_result_chars,
        )
        self._truth: Any = None
        self._tool_turns = -1  # -1: not reset, or the episode ended

    @property
    def blocking(self) -> bool:
        """Whether ``reset`` may block (the episode then runs it on an env thread): it
        runs ``task``, unless the task declares ``blocking = False`` (fast and pure, as a
        tool may: ``rollpipe.agent.tools.runs_inline``) or there is none (dataset rows);
        then it runs inline, cheaper than the thread hop. ``step`` is awaited either way;
        the tools and the verifier run on the tool runner's threads.

        Examples:
            >>> def task(seed: int) -> tuple[str, int]:
            ...     return f"What is {seed} + 1?", seed + 1
            >>> env = ToolEnv(task, [], lambda a, t: 0.0)
            >>> env.blocking
            True
            >>> task.blocking = False
            >>> env.blocking
            False
            >>> env.close()
        """
        return self.task is not None and not runs_inline(self.task)

    def reset(self, seed: int, row: Any = None) -> tuple[str, Info]:
        """A new task: the dataset's ``row`` when there is one, else ``task(seed)``.

        Examples:
            >>> env = ToolEnv(lambda seed: (f"What is {seed} + 1?", seed + 1), [], lambda a, t: 0.0)
            >>> env.reset(seed=4)[0], env.reset(seed=0, row={"prompt": "Name a prime."})[0]
            ('What is 4 + 1?', 'Name a prime.')
            >>> env.close()
        """
        check_seed(seed)
        if row is not None:
            prompt, self._truth = self._from_row(row)
        elif self.task is None:
            raise ValueError(
                "ToolEnv(task=None) takes its tasks from dataset rows: set the source's "
                "dataset (PipelineConfig(dataset=...)), or give ToolEnv a task(seed)"
            )
        else:
            prompt, self._truth = self.task(seed)
        if not isinstance(prompt, str):
            raise ValueError(f"ToolEnv.task must return (prompt: str, truth), got {prompt!r}")
        self._tool_turns = 0
        return prompt, {"success": False}

    def _from_row(self, row: Any) -> tuple[Any, Any]:
        """``(prompt, truth)`` of a dataset row (a string row is the prompt)."""
        if isinstance(row, str):
            return row, None
        if not isinstance(row, Mapping) or self.prompt_key not in row:
            fields = sorted(row) if isinstance(row, Mapping) else type(row).__name__
            raise ValueError(
                f"ToolEnv: a dataset row needs a {self.prompt_key!r} field (this row: "
                f"{fields}); set ToolEnv(prompt_key=...)"
            )
        return row[self.prompt_key], row.get(self.answer_key)

    async def step(self, action: AssistantAction) -> tuple[Any, float, bool, bool, Info]:
        """Answer the turn's tool calls with their results (``action.tool_results``, run by
        the episode), or verify its answer (see the module doc).

        Examples:
            >>> import asyncio
            >>> env = ToolEnv(lambda seed: ("Say hi.", "hi"), [], lambda a, t: float(t in a))
            >>> _ = env.reset(seed=0)
            >>> asyncio.run(env.step(AssistantAction.plain("hi!")))
            ('', 1.0, True, False, {'success': True, 'action_valid': True, 'answer': 'hi!'})
            >>> env.close()
        """
        if self._tool_turns < 0:
            raise EnvStateError("ToolEnv.step() called before reset(seed) or after the end")
        if action.calls_tools:
            messages, counts = results_of(action, self)
            self._tool_turns += 1
            truncated = self._tool_turns >= self.max_tool_turns
            if truncated:
                self._tool_turns = -1
            info: Info = {
                "success": False,
                "action_valid": counts["tool/malformed"] == 0,
                "metrics": counts,
                "metrics_agg_mode": dict.fromkeys(counts, "sum"),
            }
            return messages, 0.0, False, truncated, info
        truth, self._tool_turns = self._truth, -1
        runner = self.tool_runner
        verify = runner.threads.call
        reward = float(await verify(self.verifier, action.content, truth, timeout=runner.timeout_s))
        info = {"success": reward > 0, "action_valid": True, "answer": action.content}
        return "", reward, True, False, info

    def close(self) -> None:
        """End the tool threads; the env's tools and verifier run no more.

        Examples:
            >>> import asyncio
            >>> env = ToolEnv(lambda seed: ("Say hi.", "hi"), [], lambda a, t: 1.0)
            >>> _ = env.reset(seed=0)
            >>> env.close()
            >>> asyncio.run(env.step(AssistantAction.plain("hi")))
            Traceback (most recent call last):
            RuntimeError: rollpipe-tools: the env threads were closed
        """
        self.tool_runner.close()
