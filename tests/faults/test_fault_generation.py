"""An engine request over ``generation_timeout_s``, on the real vLLM engine: its episode
fails with the reason and the request is aborted in the engine; time the engine spends
paused does not count against the limit."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from faulty import assert_back_to, threads_now
from waiting import wait_until

from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.episode import EpisodeSettings, run_episode
from rollpipe.agent.generation_timeout import GenerationTimeoutError, answer_within
from rollpipe.agent.records import EpisodeSpec
from rollpipe.engines.records import SamplingParams
from rollpipe.envs import FrozenLake
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

# Far longer than the limits below on any CPU: 1800 tokens one at a time.
ENDLESS = SamplingParams(max_tokens=1800, temperature=0.0, ignore_eos=True)


def _engine_idle(engine: Any, within_s: float = 10.0) -> bool:
    """Whether the engine runs no request within ``within_s`` (cancellation reaches its
    loop asynchronously)."""
    return wait_until(lambda: not engine._backend.active, within_s, "the engine to be idle")


def test_a_request_over_the_limit_fails_its_episode_and_is_aborted(
    vllm_engine: Any, tokenizer: Any
) -> None:
    spec = EpisodeSpec(group_id=3, episode_id=7, seed=5)
    before = vllm_engine.tokens_generated
    trajectory = asyncio.run(
        run_episode(
            spec,
            FrozenLake(),
            vllm_engine,
            ChatFormat(tokenizer),
            EpisodeSettings(
                sampling=ENDLESS, max_turns=2, max_length=2040, generation_timeout_s=0.3
            ),
        )
    )
    made = vllm_engine.tokens_generated - before  # of the one request, when the episode ended
    assert trajectory.end_reason == "error" and trajectory.turns == ()
    assert trajectory.error == (
        "GenerationTimeoutError(engine request: env 'frozenlake', seed 5, episode 7, turn 0, "
        "generation_timeout_s=0.3: no answer within 0.3 s; raise generation_timeout_s)"
    )
    assert made < ENDLESS.max_tokens, "the episode waited for its request to finish"
    assert _engine_idle(vllm_engine), "the timed-out request still runs in the engine"
    made = vllm_engine.tokens_generated - before
    assert made < ENDLESS.max_tokens, "the timed-out request ran to its end, not aborted"


def test_time_paused_does_not_count(vllm_engine: Any, tokenizer: Any) -> None:
    """Paused before the request is sent, for longer than the limit: the request waits
    and then completes, whole (the limit starts again after the resume)."""
    prompt = tokenizer("Turn 1: P_O_G")["input_ids"]
    # a few tokens: far inside the 2 s limit once resumed, on any CPU
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    before = vllm_engine.interruptions

    async def main() -> Any:
        await asyncio.to_thread(vllm_engine.pause, "keep")
        try:
            request = answer_within(vllm_engine, vllm_engine.generate(prompt, short), 2.0)
            task = asyncio.ensure_future(request)
            done, _ = await asyncio.wait({task}, timeout=3.0)
            assert not done, "the request answered or timed out while the engine was paused"
        finally:
            await asyncio.to_thread(vllm_engine.resume)
        return await asyncio.wait_for(task, 30)

    assert len(asyncio.run(main()).token_ids) == 8
    assert vllm_engine.interruptions == before + 2  # the pause and the resume


def test_the_pipeline_setting_reaches_every_request(vllm_engine: Any, tokenizer: Any) -> None:
    """``PipelineConfig.generation_timeout_s`` end to end: with ``raise_env_errors`` the
    timeout surfaces from ``get_batch``; closing leaves no request and no thread behind."""
    baseline = threads_now()
    config = PipelineConfig(
        batch_size=4,
        group_size=2,
        max_length=2040,
        sampling=ENDLESS,
        generation_timeout_s=0.3,
        raise_env_errors=True,
    )
    pipe = RolloutPipeline(config, vllm_engine, tokenizer)
    with pipe, pytest.raises(GenerationTimeoutError, match=r"no answer within 0\.3 s"):
        pipe.get_batch()  # without the limit a batch would come back
    assert _engine_idle(vllm_engine)
    assert_back_to(baseline)
