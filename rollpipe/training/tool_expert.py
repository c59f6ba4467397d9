"""The calculator expert: a scripted policy that calls the tool and answers, and its
transcripts as supervised episodes in the pipeline's own ids.

:func:`expert_policy` reads the conversation so far (the prompt ids, decoded) and writes
what a good tool user writes: at the first turn one ``calculate`` call with the task's
expression, exactly as the tiny tools template renders a call; after a tool response,
the result as the answer. It is a policy function for
:class:`~rollpipe.engines.scripted.ScriptedEngine`, so :func:`expert_episodes` plays it
through a real :class:`~rollpipe.pipeline.RolloutPipeline` (the calculator
``ToolEnv``, the ``hermes`` parser, the token-exact dialog): the rows are exactly the
ids the pipeline sends a model, and every response token is a supervised target.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from rollpipe.engines.records import SamplingParams
from rollpipe.envs.tool_env import DEFAULT_TOOL_PROMPT
from rollpipe.training.expert import RESPONSE, ExpertEpisode

__all__ = ["TOOL_EPISODE", "expert_episodes", "expert_policy", "expert_texts"]

TOOL_EPISODE: dict[str, Any] = {"max_turns": 4, "max_tokens": 48, "tool_parser": "hermes"}
"""Episode settings of the calculator task (training, evaluation and the warm start)."""

_QUESTION = re.compile(r"What is (\d+ [*+] \d+)\?")
_RESULT = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)
_EOT = "<|im_end|>"


def expert_texts(conversation: str) -> str:
    """The expert's next response (without end of turn) to ``conversation`` (the
    decoded prompt): the answer after a tool response, else a call for the question."""
    results = _RESULT.findall(conversation)
    if results:
        return results[-1].strip()
    questions = _QUESTION.findall(conversation)
    if not questions:
        raise ValueError(
            "expert_policy: no 'What is A op B?' question in the prompt; the expert "
            "plays only the calculator env (rollpipe.envs.calculator)"
        )
    arguments = json.dumps({"expression": questions[-1]})
    return f'<tool_call>\n{{"name": "calculate", "arguments": {arguments}}}\n</tool_call>'


def expert_policy(tokenizer: Any) -> Callable[[Sequence[int], SamplingParams], list[int]]:
    """The expert as a ``ScriptedEngine`` policy: ``policy(prompt_ids, params) -> ids``
    (the response and the template's end-of-turn token)."""

    def policy(prompt: Sequence[int], params: SamplingParams) -> list[int]:
        text = tokenizer.decode(prompt, skip_special_tokens=False)
        ids = tokenizer(expert_texts(text) + _EOT, add_special_tokens=False)["input_ids"]
        return list(ids)

    return policy


def _episode(ids: np.ndarray, response: np.ndarray, seed: int, score: float) -> ExpertEpisode:
    """A pipeline row as an :class:`ExpertEpisode`: every response token is a target."""
    targets = np.full(len(ids), -1, dtype=np.int64)
    kinds = np.zeros(len(ids), dtype=np.int8)
    taught = np.nonzero(response[1:])[0]  # logits at p predict the token at p + 1
    targets[taught] = ids[taught + 1]
    kinds[taught] = RESPONSE
    edges = np.diff(np.concatenate([[0], response.astype(np.int8), [0]]))
    starts, ends = np.nonzero(edges == 1)[0].tolist(), np.nonzero(edges == -1)[0].tolist()
    spans = tuple(zip(starts, ends, strict=True))
    return ExpertEpisode(
        env="calculator",
        seed=seed,
        ids=ids,
        targets=targets,
        kinds=kinds,
        actions=(),
        responses=spans,
        turns=len(spans),
        success=score > 0,
    )


def expert_episodes(
    tokenizer: Any,
    episodes: int,
    seed: int,
    *,
    digits: int = 3,
    system_prompt: str | None = DEFAULT_TOOL_PROMPT,
    chunk: int = 1024,
) -> Iterator[ExpertEpisode]:
    """``episodes`` expert calculator episodes (``digits``-digit numbers, the env's
    ``system_prompt``) on seeds derived from ``seed``, played through a RolloutPipeline
    on a ScriptedEngine (module doc)."""
    from rollpipe.engines.scripted import ScriptedEngine
    from rollpipe.nodes.episode_source import EnvChoice
    from rollpipe.pipeline import PipelineConfig, RolloutPipeline

    env_config: dict[str, Any] = {"digits": digits, "system_prompt": system_prompt}
    config = PipelineConfig(
        envs=EnvChoice("calculator", env_config),
        group_size=1,
        batch_size=min(chunk, episodes),
        num_groups=episodes,
        seed=seed,
        concurrency=256,
        max_turns=TOOL_EPISODE["max_turns"],
        tool_parser=TOOL_EPISODE["tool_parser"],
        sampling={"max_tokens": TOOL_EPISODE["max_tokens"]},
    )
    with (
        ScriptedEngine(expert_policy(tokenizer)) as engine,
        RolloutPipeline(config, engine, tokenizer) as pipe,
    ):
        while (batch := pipe.get_batch()) is not None:
            td = batch.batch
            assert td is not None
            seeds = batch.non_tensor_batch.get("seed", np.zeros(len(batch), dtype=np.int64))
            for i in range(len(batch)):
                keep = td["attention_mask"][i].bool()
                ids = td["input_ids"][i][keep].numpy().astype(np.int64)
                response = td["response_mask"][i][keep].numpy().astype(bool)
                score = float(td["episode_scores"][i])
                yield _episode(ids, response, int(seeds[i]), score)
