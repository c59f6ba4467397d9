"""reasoning-gym tasks as single-turn rollpipe envs: ``ReasoningGymEnv(task=...)``.

Any procedural task reasoning-gym registers (``basic_arithmetic``, ``chain_sum``,
``sudoku``, ...; :func:`task_names`) by name, with its own config as keyword arguments.
The episode's seed picks the item: ``reset(seed)`` builds the task's dataset with
``seed=seed, size=1`` and asks its one question, so the same seed always gives the same
question, and members of a GRPO group share it. The response is read by reasoning-gym's
own ``extract_answer`` (the last ``<answer>...</answer>``) and scored by the task's own
``score_answer``; the episode ends after that one step.

Mapping: observation = the question and one line saying how to answer; reward = the
task's score (usually 0..1); ``terminated`` after the answer; ``info["action_valid"]``:
an ``<answer>`` was found; ``info["success"]``: score 1.0; metrics ``score`` and
``success`` (``env/{tag}/score``).

Example:
    >>> from rollpipe.envs import make
    >>> env = make("rollpipe.envs.adapters.reasoning_gym:ReasoningGymEnv",
    ...            task="basic_arithmetic", max_terms=2)
    >>> question, _ = env.reset(seed=7)
    >>> env.step("<answer>0</answer>")[1] in (0.0, 1.0)
    True
"""

from __future__ import annotations

import difflib
from typing import Any

from rollpipe.envs.base import EnvStateError, Info, StepResult, check_seed

DEFAULT_INSTRUCTION = "Give your final answer as <answer>your answer</answer>."
"""Appended to each question: reasoning-gym's questions do not say how to answer."""

SYSTEM_PROMPT = "Solve the task. Think briefly, then give your final answer in the requested form."
"""The env's own system prompt (rollpipe's default is written for text games)."""


def _import_reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ImportError(
            "ReasoningGymEnv needs reasoning-gym: pip install 'rollpipe[reasoning-gym]'"
        ) from exc
    return reasoning_gym


def task_names() -> list[str]:
    """Every task reasoning-gym registers, sorted."""
    _import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


class ReasoningGymEnv:
    """One reasoning-gym task; each ``reset(seed)`` asks the item ``seed`` picks.

    ``task``: a name from :func:`task_names`. ``instruction``: appended to the question
    (``""``: none). ``answer_tag``: the tag ``extract_answer`` reads (``"answer"``).
    ``**task_config``: the task's config fields (its ``*Config`` dataclass, e.g.
    ``min_terms=2``), checked when the env is built. Config values must be hashable
    (numbers, strings, tuples): rollpipe keys its env pool on them.
    """

    system_prompt: str | None = SYSTEM_PROMPT

    def __init__(
        self,
        task: str,
        *,
        instruction: str = DEFAULT_INSTRUCTION,
        answer_tag: str = "answer",
        **task_config: Any,
    ) -> None:
        rg = _import_reasoning_gym()
        names = task_names()
        if task not in names:
            close = difflib.get_close_matches(str(task), names, n=5, cutoff=0.5)
            raise ValueError(
                f"ReasoningGymEnv: task={task!r} is not a reasoning-gym task; close names: "
                f"{close}; all {len(names)}: rollpipe.envs.adapters.reasoning_gym.task_names()"
            )
        if not isinstance(instruction, str) or not isinstance(answer_tag, str) or not answer_tag:
            raise ValueError(
                f"ReasoningGymEnv: instruction must be a str and answer_tag a non-empty str, "
                f"got instruction={instruction!r}, answer_tag={answer_tag!r}"
            )
        self.task, self.instruction, self.answer_tag = task, instruction, answer_tag
        self.task_config = dict(task_config)
        self._create = rg.create_dataset
        from reasoning_gym.utils import extract_answer

        self._extract = extract_answer
        try:  # one item now, so a bad key or value fails when the config is built
            self._dataset(0)
        except (TypeError, ValueError, AssertionError) as exc:
            raise ValueError(
                f"ReasoningGymEnv: task {task!r} rejects its config {self.task_config}: "
                f"{type(exc).__name__}: {exc}. Its fields are those of its config class "
                f"(reasoning_gym.factory.DATASETS[{task!r}][1])"
            ) from exc
        self._entry: dict[str, Any] | None = None
        self._scorer: Any = None

    def _dataset(self, seed: int) -> Any:
        return self._create(self.task, seed=seed, size=1, **self.task_config)

    def reset(self, seed: int) -> tuple[str, Info]:
        """Ask the question ``seed`` picks (the task's dataset seeded with it, item 0)."""
        dataset = self._dataset(check_seed(seed))
        self._entry, self._scorer = dataset[0], dataset.score_answer
        question = str(self._entry["question"])
        obs = f"{question}\n{self.instruction}" if self.instruction else question
        return obs, {"action_valid": True, "action": None, "success": False}

    def step(self, action_text: str) -> StepResult:
        """Score the answer in ``action_text`` with the task's ``score_answer``; ends the
        episode."""
        entry = self._entry
        if entry is None:
            raise EnvStateError(
                f"ReasoningGymEnv({self.task!r}).step() called before reset(seed), or after "
                "the episode ended (one answer per question); call reset(seed)"
            )
        self._entry = None
        answer = self._extract(action_text, tag_name=self.answer_tag)
        score = float(self._scorer(answer=answer, entry=entry))
        success = score >= 1.0
        info = {
            "action_valid": answer is not None,
            "action": answer,
            "answer": answer,
            "success": success,
            "format_penalty_applied": False,
            "metrics": {"score": score, "success": success},
            "metrics_agg_mode": {"score": "last", "success": "last"},
        }
        verdict = "Correct." if success else f"Scored {score:g}."
        return verdict, score, True, False, info

    def close(self) -> None:
        """Nothing to release."""
