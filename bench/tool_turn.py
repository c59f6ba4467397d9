"""Benchmark: rollpipe's CPU per tool turn against a text turn (issues 24, 38).

The method is ``turn_cost.py``'s: a ``ScriptedEngine`` answers every request at once
with a fixed response, so all the CPU spent is rollpipe's; figures are process CPU time
(``time.process_time``) over one ``get_batch`` of ``EPISODES`` episodes, divided by the
turns taken. Both arms use the tiny tools model's tokenizer and template, episodes never
end before ``T`` turns, and each turn sends about the same tokens:

* **tool turn** (``EchoTools``, a ``ToolEnv`` with one ``echo`` tool, declared
  ``blocking = False``: it runs inline): the response is a hermes call
  (``<tool_call>{"name": "echo", ...}</tool_call>``), read by vLLM's ``hermes`` parser
  (``tool_parser="hermes"``), checked against the tool's schema, run, and answered with a
  ``tool`` message the dialog renders by a template diff;
* **text turn** (``EchoText``, a plain text env): the same response text, decoded and
  answered inline with the same words as a user turn.

The episodes of a run repeat one another (one task, one response), as a group's often
do: the text arm's continuation comes from its per-observation cache, the tool arm's
render diff, encoding and parse from the dialog's repeats (``rollpipe.agent.repeats``).
The **fresh** arms (``EchoToolsFresh``, ``EchoTextFresh``) answer every turn of every
episode with a result (an observation) of its own, so neither is ever cached: each
turn renders and tokenizes.

Figures (the two arms of a pair run one after the other, alternating, each repeat):
``tool_turn_cpu_us_{T}turns`` and ``text_turn_cpu_us_{T}turns`` (µs per turn at ``T`` =
8, 32 and 128 turns), ``tool_over_text_{T}turns`` (the median of the per-repeat ratios,
7 repeats unless given: issue 38's target is ≤ 2), ``tool_turn_overhead_us_{T}turns``
(their difference),
``tool_turn_cpu_128_over_32`` (issue 28's target ≤ 1.2: a cost that does not grow with
the history); ``{tool,text}_turn_fresh_cpu_us_32turns`` and ``tool_over_text_fresh_32turns``
for the fresh arms.

The run holds torch to one intra-op thread (restored after), as ``turn_cost.py`` does:
the figures are what one core does (collation's tensor fills otherwise spin OpenMP
threads on a busy machine). Each run starts after a ``gc.collect()``: a full collection
(0.2-0.4 s in this process) triggered by earlier runs' garbage otherwise lands in
whichever run crosses the threshold. The tool env's task declares ``blocking = False``,
as the text env does, so both reset inline (``ToolEnv.blocking``).

Figures (2026-12-02 06:20 UTC, quick, ``--repeats 5``, two runs on the shared 2-core
machine at load 1.0): tool ÷ text 1.64 / 1.42 at 8 turns, 1.74 / 1.65 at 32, 2.15 / 2.02
at 128 (118 / 55 and 136 / 83 µs a turn), fresh 1.33 / 1.24 (292 / 231, 371 / 267): a new
turn renders once (it rendered three times at 02:50: fresh 2.07, 128 turns 2.03); before
the issue-38 cuts (``8482300``) 2.8-3.9 and fresh 2.9-3.3 (docs/performance.md). A
response parsed once whatever its turn and the window found once a turn (12:00 UTC, old
and new trees alternated, 11 pairs each, 128 turns): tool ÷ text min over min 2.07 / 2.18
before, 1.99 / 1.96 after (tool 87-90 µs → 79-83, text 40-42). An async step started at
once and the plain messages and metrics checked on short paths (2026-12-05 12:45 UTC,
``--repeats 7``, two runs, load 0.6-1.0): 1.51 / 1.43 at 8 turns, 1.88 / 1.71 at 32,
1.79 / 1.74 at 128 (93 / 50 and 90 / 51 µs), fresh 1.55 / 1.48 (docs/performance.md).
"""

from __future__ import annotations

import gc
import itertools
import json
import time
from typing import Any

from bench.common import BenchContext, Figures, median, one_torch_thread, rounded
from rollpipe.engines.records import SamplingParams
from rollpipe.engines.scripted import ScriptedEngine
from rollpipe.envs.tool_env import ToolEnv
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

EPISODES = 16
WORDS = "the quick brown fox jumps over the lazy dog"
ARGUMENTS = json.dumps({"text": WORDS})
CALL = f'<tool_call>\n{{"name": "echo", "arguments": {ARGUMENTS}}}\n</tool_call>'


def echo(text: str) -> str:
    """Repeat the text.

    Args:
        text: what to repeat
    """
    return text


echo.blocking = False  # type: ignore[attr-defined]  # microseconds, pure: runs inline


def echo_task(seed: int) -> tuple[str, str]:
    """The task: echo the words with the tool."""
    return f"Echo '{WORDS}' with the tool.", WORDS


echo_task.blocking = False  # type: ignore[attr-defined]  # as EchoText: reset runs inline


def EchoTools() -> ToolEnv:
    """A tool env that never ends by itself: every turn is one ``echo`` call."""
    return ToolEnv(
        echo_task,
        [echo],
        lambda answer, truth: 0.0,
        max_tool_turns=10**6,
    )


_FRESH = itertools.count()


def echo_fresh(text: str) -> str:
    """Repeat the text, with a number no other call gets.

    Args:
        text: what to repeat
    """
    return f"{text} {next(_FRESH)}"


echo_fresh.__name__ = "echo"  # the call the scripted response makes
echo_fresh.blocking = False  # type: ignore[attr-defined]


def EchoToolsFresh() -> ToolEnv:
    """``EchoTools`` whose every result is new: nothing a turn renders was seen before."""
    return ToolEnv(
        echo_task,
        [echo_fresh],
        lambda answer, truth: 0.0,
        max_tool_turns=10**6,
    )


class EchoText:
    """A text env that never ends: every action is answered with the echoed words."""

    blocking = False  # microseconds per call: runs inline

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        return f"Echo '{WORDS}' with the tool.", {}

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return f"[tool echo] {WORDS}", 0.0, False, False, {"action_valid": True}

    def close(self) -> None:
        return None


class EchoTextFresh(EchoText):
    """``EchoText`` whose every observation is new (never cached)."""

    blocking = False

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return f"[tool echo] {WORDS} {next(_FRESH)}", 0.0, False, False, {"action_valid": True}


def _one_run(tokenizer: Any, tools: bool, turns: int, fresh: bool = False) -> float:
    """CPU µs per turn of one batch of :data:`EPISODES` episodes of ``turns`` turns."""
    response = tokenizer(CALL + "<|im_end|>", add_special_tokens=False)["input_ids"]
    env = ("EchoTools" if tools else "EchoText") + ("Fresh" if fresh else "")
    config = PipelineConfig(
        envs=f"bench.tool_turn:{env}",
        group_size=1,
        num_groups=EPISODES,
        batch_size=EPISODES,
        concurrency=EPISODES,
        max_turns=turns,
        max_length=2**16,
        tool_parser="hermes" if tools else None,
        sampling=SamplingParams(max_tokens=len(response)),
    )
    gc.collect()  # the garbage of earlier runs is not this run's to collect
    with (
        ScriptedEngine(lambda prompt, params: response) as engine,
        RolloutPipeline(config, engine, tokenizer) as pipe,
    ):
        cpu = time.process_time()
        batch = pipe.get_batch()
        cpu = time.process_time() - cpu
    assert batch is not None and len(batch) == EPISODES
    taken = int(batch.batch["response_mask"].sum()) // len(response)
    if taken != EPISODES * turns:
        raise RuntimeError(f"tool_turn: {taken} turns taken, expected {EPISODES * turns}")
    return 1e6 * cpu / taken


def run(ctx: BenchContext) -> Figures:
    with one_torch_thread():
        return _run(ctx)


def _pair(tokenizer: Any, turns: int, repeats: int, fresh: bool) -> tuple[float, float, float]:
    """(tool µs, text µs, median of the per-repeat tool ÷ text ratios): the two arms run
    one after the other in each repeat, so a ratio compares runs seconds apart."""
    tool, text = [], []
    for _ in range(repeats):
        tool.append(_one_run(tokenizer, True, turns, fresh))
        text.append(_one_run(tokenizer, False, turns, fresh))
    return median(tool), median(text), median([a / b for a, b in zip(tool, text, strict=True)])


def _run(ctx: BenchContext) -> Figures:
    from transformers import AutoTokenizer

    from rollpipe.training.tiny_model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path(tools=True))
    repeats = ctx.repeats_for(7)  # the issue-38 ratio is near its target: its pairs vary most
    _one_run(tokenizer, True, 8), _one_run(tokenizer, False, 8)  # warm: imports, parsers
    out: Figures = {}
    for turns in ctx.size(smoke=(8,), quick=(8, 32, 128), full=(8, 32, 128)):
        tool, text, ratio = _pair(tokenizer, turns, repeats, fresh=False)
        out[f"tool_turn_cpu_us_{turns}turns"] = rounded(tool, 1)
        out[f"text_turn_cpu_us_{turns}turns"] = rounded(text, 1)
        out[f"tool_over_text_{turns}turns"] = rounded(ratio, 2)
        out[f"tool_turn_overhead_us_{turns}turns"] = rounded(tool - text, 1)
        ctx.log(f"  {turns} turns: tool {tool:.0f} µs/turn, text {text:.0f}, ratio {ratio:.2f}")
    fresh_turns = 8 if ctx.smoke else 32
    tool, text, ratio = _pair(tokenizer, fresh_turns, repeats, fresh=True)
    out[f"tool_turn_fresh_cpu_us_{fresh_turns}turns"] = rounded(tool, 1)
    out[f"text_turn_fresh_cpu_us_{fresh_turns}turns"] = rounded(text, 1)
    out[f"tool_over_text_fresh_{fresh_turns}turns"] = rounded(ratio, 2)
    ctx.log(
        f"  fresh, {fresh_turns} turns: tool {tool:.0f} µs/turn, text {text:.0f}, ratio {ratio:.2f}"
    )
    if "tool_turn_cpu_us_128turns" in out:
        ratio = float(out["tool_turn_cpu_us_128turns"]) / float(out["tool_turn_cpu_us_32turns"])
        out["tool_turn_cpu_128_over_32"] = rounded(ratio, 2)
    return out
