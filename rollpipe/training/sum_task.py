"""The prompt-dataset (RLVR) learning task: single-digit sums, a fixed held-out split, and
a sloppy teacher whose transcripts are the pipeline's own ids.

The dataset is every ``"What is A + B?"`` for digits ``A, B`` (100 problems), each a row
``{"prompt": ..., "answer": A + B}`` for :class:`~rollpipe.envs.task.PromptTask` (env
``"task"``, scorer ``"exact"``, no system message). :data:`HELD_OUT` problems, drawn once
from a fixed seed, are never trained on: neither by the warm start nor by GRPO.

The teacher (:func:`sloppy_policy`) answers ``<answer>N</answer>``, right only 3 times in
10: the other 7 times it says ``A + B + 1``. A model imitating it
puts real probability on the right sum, but its most likely answer is one too many, so
greedy decoding is mostly wrong. The verifier's reward, not the imitation data, defines
correctness: that is what GRPO has to find. :func:`teacher_episodes` plays the teacher
through a real :class:`~rollpipe.pipeline.RolloutPipeline` on a
:class:`~rollpipe.engines.scripted.ScriptedEngine`, so the rows are exactly the ids the
pipeline sends a model.
"""

from __future__ import annotations

import random
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from rollpipe.engines.records import SamplingParams
from rollpipe.training.expert import RESPONSE, ExpertEpisode

__all__ = [
    "HELD_OUT",
    "SUM_ENV_CONFIG",
    "SUM_EPISODE",
    "TEACHER_OFFSETS",
    "held_out_rows",
    "sloppy_policy",
    "sum_row",
    "teacher_episodes",
    "train_rows",
]

SPLIT_SEED = 35
"""The seed the held-out problems are drawn from (fixed: the split never changes)."""
HELD_OUT_COUNT = 25
HELD_OUT: frozenset[tuple[int, int]] = frozenset(
    random.Random(SPLIT_SEED).sample([(a, b) for a in range(10) for b in range(10)], HELD_OUT_COUNT)
)
"""The ``(A, B)`` problems only evaluation sees (a quarter of the 100)."""

SUM_ENV_CONFIG: dict[str, Any] = {"score": "exact", "system_prompt": None}
"""PromptTask's options: exact match on ``<answer>`` / ``\\boxed``, no system message."""
SUM_EPISODE: dict[str, Any] = {"max_turns": 1, "max_tokens": 8}
"""One answer of up to 8 tokens (``<answer>17</answer>`` and the end of turn is 7)."""

TEACHER_OFFSETS = (0, 1, 1, 1, 0, 1, 1, 0, 1, 1)
"""The teacher's error on its k-th answer to a problem (``k % 10``): right 3 times in 10,
one too many the other 7."""

_QUESTION = re.compile(r"What is (\d+) \+ (\d+)\?")
_EOT = "<|im_end|>"


def sum_row(a: int, b: int) -> dict[str, Any]:
    """The dataset row of ``a + b``."""
    return {"prompt": f"What is {a} + {b}?", "answer": a + b}


def train_rows() -> list[dict[str, Any]]:
    """The 75 training problems, in order (``a``, then ``b``)."""
    return [sum_row(a, b) for a in range(10) for b in range(10) if (a, b) not in HELD_OUT]


def held_out_rows() -> list[dict[str, Any]]:
    """The 25 held-out problems, in order: never trained on."""
    return [sum_row(a, b) for a in range(10) for b in range(10) if (a, b) in HELD_OUT]


def sloppy_policy(tokenizer: Any) -> Callable[[Sequence[int], SamplingParams], list[int]]:
    """The sloppy teacher as a ``ScriptedEngine`` policy: its k-th answer to a problem is
    ``A + B + TEACHER_OFFSETS[k % 10]``, then the end-of-turn token.
    The answers to a problem form the same multiset whatever order requests come in."""
    seen: Counter[tuple[int, int]] = Counter()
    lock = threading.Lock()

    def policy(prompt: Sequence[int], params: SamplingParams) -> list[int]:
        found = _QUESTION.findall(tokenizer.decode(list(prompt), skip_special_tokens=False))
        if not found:
            raise ValueError("sloppy_policy: no 'What is A + B?' question in the prompt")
        a, b = int(found[-1][0]), int(found[-1][1])
        with lock:
            k = seen[a, b]
            seen[a, b] += 1
        total = a + b + TEACHER_OFFSETS[k % len(TEACHER_OFFSETS)]
        text = f"<answer>{total}</answer>{_EOT}"
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return policy


def _episode(ids: np.ndarray, response: np.ndarray, score: float) -> ExpertEpisode:
    """A pipeline row as an :class:`ExpertEpisode`: every response token is a target."""
    targets = np.full(len(ids), -1, dtype=np.int64)
    kinds = np.zeros(len(ids), dtype=np.int8)
    taught = np.nonzero(response[1:])[0]  # logits at p predict the token at p + 1
    targets[taught] = ids[taught + 1]
    kinds[taught] = RESPONSE
    start, end = int(taught[0]) + 1, int(taught[-1]) + 2
    return ExpertEpisode(
        env="task",
        seed=0,
        ids=ids,
        targets=targets,
        kinds=kinds,
        actions=(),
        responses=((start, end),),
        turns=1,
        success=score > 0,
    )


def teacher_episodes(tokenizer: Any, repeats: int, seed: int) -> Iterator[ExpertEpisode]:
    """The teacher's answers to every training problem, ``repeats`` times each, played
    through a RolloutPipeline (PromptTask on :func:`train_rows`) on a ScriptedEngine;
    sorted by their ids, so the list is the same however the requests interleaved."""
    from rollpipe.engines.scripted import ScriptedEngine
    from rollpipe.nodes.episode_source import EnvChoice
    from rollpipe.pipeline import PipelineConfig, RolloutPipeline

    rows = train_rows()
    config = PipelineConfig(
        envs=EnvChoice("task", SUM_ENV_CONFIG),
        dataset={"rows": rows, "shuffle": True, "epochs": repeats},
        group_size=1,
        batch_size=len(rows),
        seed=seed,
        concurrency=256,
        max_turns=SUM_EPISODE["max_turns"],
        sampling={"max_tokens": SUM_EPISODE["max_tokens"]},
    )
    episodes = []
    with (
        ScriptedEngine(sloppy_policy(tokenizer)) as engine,
        RolloutPipeline(config, engine, tokenizer) as pipe,
    ):
        while (batch := pipe.get_batch()) is not None:
            td = batch.batch
            assert td is not None
            for i in range(len(batch)):
                keep = td["attention_mask"][i].bool()
                ids = td["input_ids"][i][keep].numpy().astype(np.int64)
                response = td["response_mask"][i][keep].numpy().astype(bool)
                episodes.append(_episode(ids, response, float(td["episode_scores"][i])))
    episodes.sort(key=lambda e: e.ids.tobytes())
    yield from episodes
