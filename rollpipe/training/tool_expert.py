"""The tool experts: scripted policies that call the tool and answer (the lookup and
calculator tasks), and their transcripts as supervised episodes in the pipeline's own ids.

:func:`expert_policy` reads the conversation so far (the prompt ids, decoded) and writes
what a good tool user writes: at the first turn one call (``lookup`` with the drawer
asked about, ``calculate`` with the task's expression), exactly as the tiny tools
template renders a call; after a tool response, the answer. :func:`guess_texts` is the
other behaviour the lookup warm start imitates: an answer at once, without the call (a
digit from the question's hash: right one time in ten). Both are policy functions for
:class:`~rollpipe.engines.scripted.ScriptedEngine`, so :func:`expert_episodes` plays it
through a real :class:`~rollpipe.pipeline.RolloutPipeline` (the calculator
``ToolEnv``, the ``hermes`` parser, the token-exact dialog): the rows are exactly the
ids the pipeline sends a model, and every response token is a supervised target.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from rollpipe.engines.records import SamplingParams
from rollpipe.envs.tool_env import DEFAULT_TOOL_PROMPT
from rollpipe.training.expert import RESPONSE, ExpertEpisode

__all__ = [
    "LOOKUP_ANSWER",
    "TOOL_EPISODE",
    "expert_episodes",
    "expert_policy",
    "expert_texts",
    "guess_texts",
]

TOOL_EPISODE: dict[str, Any] = {"max_turns": 4, "max_tokens": 48, "tool_parser": "hermes"}
"""Episode settings of the tool tasks (training, evaluation and the warm start)."""
LOOKUP_ANSWER = "The digit is {}."
"""How the lookup expert answers (after the call, or guessing without it)."""

_CALCULATION = re.compile(r"What is (\d+ [*+] \d+)\?")
_DRAWER = re.compile(r"Which digit is in drawer (\d+)\?")
_RESULT = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)
_EOT = "<|im_end|>"
_UNKNOWN = (
    "expert_policy: no 'What is A op B?' or 'Which digit is in drawer N?' question in the "
    "prompt; the expert plays only the calculator and lookup envs (rollpipe.envs)"
)


def _call(name: str, arguments: dict[str, Any]) -> str:
    """A call as the tiny tools template renders one."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def expert_texts(conversation: str) -> str:
    """The expert's next response (without end of turn) to ``conversation`` (the
    decoded prompt): the answer after a tool response, else a call for the question."""
    drawers = _DRAWER.findall(conversation)
    results = _RESULT.findall(conversation)
    if results:
        result = results[-1].strip()
        return LOOKUP_ANSWER.format(result) if drawers else result
    if drawers:
        return _call("lookup", {"drawer": int(drawers[-1])})
    calculations = _CALCULATION.findall(conversation)
    if not calculations:
        raise ValueError(_UNKNOWN)
    return _call("calculate", {"expression": calculations[-1]})


def guess_texts(conversation: str) -> str:
    """An answer to the lookup question without looking: a digit from the question's
    hash (the drawers' digits are random, so it is right one time in ten)."""
    drawers = _DRAWER.findall(conversation)
    if not drawers:
        raise ValueError(_UNKNOWN)
    return LOOKUP_ANSWER.format(zlib.crc32(conversation.encode()) % 10)


def expert_policy(
    tokenizer: Any, texts: Callable[[str], str] = expert_texts
) -> Callable[[Sequence[int], SamplingParams], list[int]]:
    """``texts`` (the expert by default) as a ``ScriptedEngine`` policy:
    ``policy(prompt_ids, params) -> ids`` (the response and the end-of-turn token)."""

    def policy(prompt: Sequence[int], params: SamplingParams) -> list[int]:
        text = tokenizer.decode(prompt, skip_special_tokens=False)
        ids = tokenizer(texts(text) + _EOT, add_special_tokens=False)["input_ids"]
        return list(ids)

    return policy


def _episode(
    env: str, ids: np.ndarray, response: np.ndarray, seed: int, score: float
) -> ExpertEpisode:
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
        env=env,
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
    env: str = "calculator",
    env_config: dict[str, Any] | None = None,
    texts: Callable[[str], str] = expert_texts,
    chunk: int = 1024,
) -> Iterator[ExpertEpisode]:
    """``episodes`` episodes of ``texts`` (the expert by default) on the tool env ``env``
    (``"calculator"`` or ``"lookup"``, built with ``env_config``), on seeds derived from
    ``seed``, played through a RolloutPipeline on a ScriptedEngine (module doc)."""
    from rollpipe.engines.scripted import ScriptedEngine
    from rollpipe.nodes.episode_source import EnvChoice
    from rollpipe.pipeline import PipelineConfig, RolloutPipeline

    config = PipelineConfig(
        envs=EnvChoice(env, {"system_prompt": DEFAULT_TOOL_PROMPT, **(env_config or {})}),
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
        ScriptedEngine(expert_policy(tokenizer, texts)) as engine,
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
                yield _episode(env, ids, response, int(seeds[i]), score)
