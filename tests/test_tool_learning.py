"""Learning with tools: the calculator expert's transcripts are the pipeline's own rows,
and the tools warm start calls the tool and answers far better than its untrained
weights, greedy on held-out seeds through the real vLLM engine."""

from __future__ import annotations

from typing import Any

import pytest

from rollpipe.training.tool_expert import expert_episodes, expert_texts
from rollpipe.training.tool_warm_start import (
    TOOL_SHIPPED_DIR,
    initial_weights,
    tool_warm_start_model_path,
)
from rollpipe.training.train_tasks import train_task

EPISODES = 100  # held-out seeds in the comparison below


@pytest.fixture(scope="module")
def warm_start() -> Any:
    return tool_warm_start_model_path()


def test_the_tools_warm_start_ships(warm_start: Any) -> None:
    """The default recipe's weights ship in the package: nothing is built on first use."""
    assert warm_start == TOOL_SHIPPED_DIR
    assert (TOOL_SHIPPED_DIR / "model.safetensors").stat().st_size < 3 * 2**20


def test_expert_transcripts_call_the_tool_and_succeed(warm_start: Any) -> None:
    """Played through the pipeline (ToolEnv, hermes parser): two turns, a call then the
    answer, every episode a success; the loss is on the responses only."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(warm_start)
    episodes = list(expert_episodes(tokenizer, 8, seed=3, chunk=4))
    assert len(episodes) == 8
    for episode in episodes:
        assert episode.success and episode.turns == 2
        (call_start, call_end), (answer_start, answer_end) = episode.responses
        call = tokenizer.decode(episode.ids[call_start:call_end], skip_special_tokens=False)
        assert call.startswith('<tool_call>\n{"name": "calculate"') and call.endswith("<|im_end|>")
        taught = {int(p) + 1 for p in (episode.targets >= 0).nonzero()[0]}
        assert taught == {*range(call_start, call_end), *range(answer_start, answer_end)}


def test_the_expert_names_what_it_cannot_play() -> None:
    with pytest.raises(ValueError, match="plays only the calculator and lookup envs"):
        expert_texts("<|im_start|>user\nWalk to the goal.<|im_end|>")


def test_unknown_train_task_lists_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match=r"env='chess'.*\['calculator', 'frozenlake', 'lookup', 'lookup-agent'"
    ):
        train_task("chess")


def _play(engine: Any, tokenizer: Any) -> dict[str, float]:
    """Batch metrics of :data:`EPISODES` greedy held-out calculator episodes."""
    from rollpipe.pipeline import PipelineConfig, RolloutPipeline
    from rollpipe.training.evaluate import EVAL_SEED

    calculator = train_task("calculator")
    config = PipelineConfig(
        envs=calculator.env,
        group_size=1,
        batch_size=1,
        num_groups=EPISODES,
        seed=EVAL_SEED,
        max_turns=calculator.max_turns,
        tool_parser=calculator.tool_parser,
        sampling={"max_tokens": calculator.max_tokens, "temperature": 0.0},
    )
    with RolloutPipeline(config, engine, tokenizer) as pipe:
        batch = pipe.get_batch(-1)
    assert batch is not None and len(batch) == EPISODES
    return dict(batch.meta_info["metrics"])


def test_warm_start_beats_its_untrained_weights_on_held_out_seeds(warm_start: Any) -> None:
    """Greedy, the same held-out seeds, one vLLM engine: the warm start, then its
    untrained initial weights loaded into the same engine. The warm start makes one
    well-formed ``calculate`` call per episode and answers some right; the untrained
    weights never call the tool and never succeed."""
    from transformers import AutoTokenizer

    from rollpipe.engines.vllm import VLLMEngine

    tokenizer = AutoTokenizer.from_pretrained(warm_start)
    with VLLMEngine(warm_start, kv_cache_space_gib=0.5, max_model_len=1024, seed=0) as engine:
        trained = _play(engine, tokenizer)
        engine.update_weights(initial_weights(warm_start))
        untrained = _play(engine, tokenizer)
    well_formed = trained["tool/calls"] - trained["tool/malformed"]
    assert well_formed >= 0.95 * EPISODES, trained
    assert trained["tool/calls/calculate"] == trained["tool/calls"], trained
    assert untrained.get("tool/calls", 0) - untrained.get("tool/malformed", 0) == 0, untrained
    assert untrained["success_rate"] == 0.0, untrained
    # 0.095 on 200 held-out seeds for the shipped weights (docs/learning.md)
    assert trained["success_rate"] > untrained["success_rate"], (trained, untrained)
