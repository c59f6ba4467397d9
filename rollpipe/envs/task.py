"""PromptTask: a prompt dataset's row as an episode (RLVR): prompt from the row, reward from
a scoring function, single-turn or a few attempts with feedback.

One line of config turns a dataset into episodes::

    PipelineConfig(envs=[{"name": "task", "config": {"score": "math_verify"}}],
                   dataset={"rows": "gsm8k_train.jsonl"})

A row is a dict (``prompt_key`` gives the prompt, ``answer_key`` the reference) or a plain
string (the prompt; a scorer that needs a reference then gets None). ``score`` is a name in
``SCORERS`` or an import path ``"package.module:function"`` to a ``(response, row) -> float``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from rollpipe._utils.checks import check_int
from rollpipe._utils.import_path import NotAnImportPath, import_object

__all__ = ["DEFAULT_TASK_PROMPT", "SCORERS", "PromptTask", "extract_answer"]

DEFAULT_TASK_PROMPT = (
    "Solve the problem. Reason briefly, then give the final answer as \\boxed{answer}."
)
"""PromptTask's system prompt (the pipeline's default is written for text games)."""

Scorer = Callable[[str, Any], float]

_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(response: str) -> str | None:
    """The response's final answer: the last ``\\boxed{...}``, else the last
    ``<answer>...</answer>``, else None (no answer given in a form the scorers read)."""
    for pattern in (_BOXED, _ANSWER_TAG):
        found = pattern.findall(response)
        if found:
            return str(found[-1]).strip()
    return None


def _normalized(text: str) -> str:
    return " ".join(text.replace(",", "").split()).rstrip(".").lower()


def exact_match(response: str, reference: Any) -> float:
    """1.0 when the extracted answer equals the reference (case, spaces, commas and a final
    period ignored), else 0.0."""
    answer = extract_answer(response)
    if answer is None or reference is None:
        return 0.0
    return float(_normalized(answer) == _normalized(str(reference)))


def math_verify_score(response: str, reference: Any) -> float:
    """1.0 when ``math-verify`` finds the response's answer equal to the reference (the
    ``math`` extra installs it)."""
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise ImportError(
            "score='math_verify' needs the math-verify package: pip install 'rollpipe[math]'"
        ) from exc
    if reference is None:
        return 0.0
    gold = parse(f"${reference}$" if "$" not in str(reference) else str(reference))
    answer = parse(response)
    return float(bool(gold) and bool(answer) and verify(gold, answer))


SCORERS: dict[str, Scorer] = {"exact": exact_match, "math_verify": math_verify_score}
"""Scorers by name: each takes the response and the row's reference answer."""


def _scorer(score: str | Scorer) -> tuple[Scorer, bool]:
    """The scoring function and whether it takes the whole row (an imported one does)."""
    if callable(score):
        return score, True
    if score in SCORERS:
        return SCORERS[score], False
    hint = f"give one of {sorted(SCORERS)} or an import path 'package.module:function'"
    try:
        fn = import_object(score)
    except NotAnImportPath:
        raise ValueError(f"PromptTask.score: unknown scorer {score!r}; {hint}") from None
    except Exception as exc:
        raise ValueError(
            f"PromptTask.score: cannot import {score!r} ({type(exc).__name__}: {exc}); {hint}"
        ) from exc
    if not callable(fn):
        raise ValueError(f"PromptTask.score: {score!r} is not callable; {hint}")
    return fn, True


class PromptTask:
    """One row, one prompt; ``attempts`` tries, each scored (see the module doc).

    ``template`` formats the prompt from the row's fields (``"{question}"``); without it
    the prompt is ``row[prompt_key]``. A response scoring at least ``success_at`` ends
    the episode with success; otherwise, while attempts remain, the env answers with
    ``feedback``. The reward of a step is its score. ``info["action_valid"]`` says
    whether an answer could be read from the response (for the built-in scorers).
    ``system_prompt`` replaces the pipeline's (written for games) in this env's episodes;
    None sends no system message.

    Examples:
        >>> task = PromptTask(template="What is {a} + {b}?", attempts=2)
        >>> task.reset(seed=0, row={"a": 2, "b": 3, "answer": "5"})[0]
        'What is 2 + 3?'
        >>> task.step("<answer>6</answer>")  # wrong: feedback, one attempt left
        ('That is not correct. Try again.', 0.0, False, False,
         {'action_valid': True, 'success': False, 'metrics': {'score': 0.0}})
        >>> task.step("<answer>5</answer>")[1:3]  # reward, terminated
        (1.0, True)
    """

    def __init__(
        self,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        score: str | Scorer = "exact",
        attempts: int = 1,
        template: str | None = None,
        feedback: str = "That is not correct. Try again.",
        success_at: float = 1.0,
        system_prompt: str | None = DEFAULT_TASK_PROMPT,
    ) -> None:
        check_int("PromptTask.attempts", attempts, 1, 64)
        self.system_prompt = system_prompt
        self.prompt_key, self.answer_key = prompt_key, answer_key
        self.score, self._takes_row = _scorer(score)
        self.attempts = attempts
        self.template = template
        self.feedback = feedback
        self.success_at = success_at
        self._row: Any = None
        self._left = 0

    def _field(self, key: str, required: bool) -> Any:
        row = self._row
        if not isinstance(row, Mapping):
            return row if key == self.prompt_key else None
        if key not in row and required:
            raise KeyError(
                f"PromptTask: the row has no {key!r} field (its fields: {sorted(row)}); set "
                f"PromptTask(prompt_key=...) or template='...{{field}}...'"
            )
        return row.get(key)

    def reset(self, seed: int, row: Any = None) -> tuple[str, dict[str, Any]]:
        if row is None:
            raise ValueError(
                "PromptTask needs a dataset row: set the source's dataset "
                "(PipelineConfig(dataset=...)), whose rows reach reset(seed, row=...)"
            )
        self._row, self._left = row, self.attempts
        if self.template is not None:
            fields = dict(row) if isinstance(row, Mapping) else {self.prompt_key: row}
            prompt = self.template.format(**fields)
        else:
            prompt = str(self._field(self.prompt_key, required=True))
        return prompt, {"action_valid": None, "success": False}

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._left <= 0:
            raise RuntimeError("PromptTask.step() after the episode ended; call reset()")
        self._left -= 1
        if self._takes_row:
            reward = float(self.score(action_text, self._row))
            valid = None
        else:
            reward = float(self.score(action_text, self._field(self.answer_key, required=False)))
            valid = extract_answer(action_text) is not None
        success = reward >= self.success_at
        done = success or self._left == 0
        info = {"action_valid": valid, "success": success, "metrics": {"score": reward}}
        return ("" if done else self.feedback), reward, done, False, info

    def close(self) -> None:
        self._row = None
