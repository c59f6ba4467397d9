"""Benchmark: rollpipe's CPU per tool turn against a text turn (issue 24).

The method is ``turn_cost.py``'s: a ``ScriptedEngine`` answers every request at once
with a fixed response, so all the CPU spent is rollpipe's; figures are process CPU time
(``time.process_time``) over one ``get_batch`` of ``EPISODES`` episodes, divided by the
turns taken. Both runs use the tiny tools model's tokenizer and template, episodes never
end before ``T`` turns, and each turn sends about the same tokens:

* **tool turn** (``EchoTools``, a ``ToolEnv`` with one ``echo`` tool): the response is a
  hermes call (``<tool_call>{"name": "echo", ...}</tool_call>``), read by vLLM's
  ``hermes`` parser (``tool_parser="hermes"``), checked against the tool's schema, run on
  the env's worker thread under its time limit, and answered with a ``tool`` message the
  dialog renders by a template diff;
* **text turn** (``EchoText``, a plain text env): the same response text, decoded and
  answered inline with the same words as a user turn.

Figures: ``tool_turn_cpu_us_{T}turns`` and ``text_turn_cpu_us_{T}turns`` (µs per turn at
``T`` = 8, 32 and 128 turns), ``tool_turn_overhead_us_{T}turns`` (their difference) and
``tool_turn_cpu_128_over_32`` (the tool turn's cost per turn at 128 turns ÷ at 32: issue
28's target is ≤ 1.2, a cost that does not grow with the history).

The run holds torch to one intra-op thread (restored after), as ``turn_cost.py`` does:
the figures are what one core does (collation's tensor fills otherwise spin OpenMP
threads on a busy machine).
"""

from __future__ import annotations

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


def EchoTools() -> ToolEnv:
    """A tool env that never ends by itself: every turn is one ``echo`` call."""
    return ToolEnv(
        lambda seed: (f"Echo '{WORDS}' with the tool.", WORDS),
        [echo],
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


def _one_run(tokenizer: Any, tools: bool, turns: int) -> float:
    """CPU µs per turn of one batch of :data:`EPISODES` episodes of ``turns`` turns."""
    response = tokenizer(CALL + "<|im_end|>", add_special_tokens=False)["input_ids"]
    config = PipelineConfig(
        envs="bench.tool_turn:EchoTools" if tools else "bench.tool_turn:EchoText",
        group_size=1,
        num_groups=EPISODES,
        batch_size=EPISODES,
        concurrency=EPISODES,
        max_turns=turns,
        max_length=2**16,
        tool_parser="hermes" if tools else None,
        sampling=SamplingParams(max_tokens=len(response)),
    )
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


def _run(ctx: BenchContext) -> Figures:
    from transformers import AutoTokenizer

    from rollpipe.training.tiny_model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path(tools=True))
    repeats = ctx.repeats_for(3)
    out: Figures = {}
    for turns in ctx.size(smoke=(8,), quick=(8, 32, 128), full=(8, 32, 128)):
        for kind, tools in (("tool", True), ("text", False)):
            runs = [_one_run(tokenizer, tools, turns) for _ in range(repeats)]
            out[f"{kind}_turn_cpu_us_{turns}turns"] = rounded(median(runs), 1)
        tool, text = out[f"tool_turn_cpu_us_{turns}turns"], out[f"text_turn_cpu_us_{turns}turns"]
        out[f"tool_turn_overhead_us_{turns}turns"] = rounded(float(tool) - float(text), 1)
        ctx.log(f"  {turns} turns: tool {tool} µs/turn, text {text} µs/turn")
    if "tool_turn_cpu_us_128turns" in out:
        ratio = float(out["tool_turn_cpu_us_128turns"]) / float(out["tool_turn_cpu_us_32turns"])
        out["tool_turn_cpu_128_over_32"] = rounded(ratio, 2)
    return out
