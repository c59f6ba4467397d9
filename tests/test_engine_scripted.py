"""ScriptedEngine: a policy function behind the real engine machinery (versions, pauses,
stop tokens, close)."""

from __future__ import annotations

import pytest
import torch

from rollpipe.engines import EngineClosedError, SamplingParams, ScriptedEngine
from tests.waiting import holds_for, wait_until


def echo_last(prompt: list[int], params: SamplingParams) -> list[int]:
    return [prompt[-1], 7, 8, 9]


def test_answers_with_the_policy_cut_at_stop_tokens_and_max_tokens() -> None:
    with ScriptedEngine(echo_last) as engine:
        [gen] = engine.generate_batch([[3, 4]], SamplingParams(max_tokens=8))
        assert (gen.token_ids, gen.finish_reason) == ((4, 7, 8, 9), "length")
        [gen] = engine.generate_batch([[3]], SamplingParams(max_tokens=8, stop_token_ids=[8]))
        assert (gen.token_ids, gen.finish_reason) == ((3, 7, 8), "stop")
        [gen] = engine.generate_batch([[3]], SamplingParams(max_tokens=2))
        assert gen.token_ids == (3, 7) and gen.logprobs == (0.0, 0.0)
        assert engine.tokens_generated == 4 + 3 + 2


def test_paused_requests_wait_and_tokens_carry_the_new_version() -> None:
    with ScriptedEngine(echo_last) as engine:
        engine.pause("keep")
        waiting = engine.runtime.submit(engine.generate([1], SamplingParams(max_tokens=2)))
        holds_for(lambda: not waiting.done(), 0.2, "a paused engine answers nothing")
        assert engine.update_weights({"w": torch.zeros(1)}) == 1
        engine.resume()
        gen = waiting.result(30)
        assert gen.versions == (1, 1)
    with pytest.raises(EngineClosedError):
        engine.generate_batch([[1]], SamplingParams(max_tokens=1))


def test_close_fails_a_waiting_request() -> None:
    engine = ScriptedEngine(echo_last)
    engine.pause("abort")
    waiting = engine.runtime.submit(engine.generate([1], SamplingParams(max_tokens=2)))
    wait_until(lambda: engine.is_paused, 30, "paused")
    engine.close()
    with pytest.raises(EngineClosedError):
        waiting.result(30)
