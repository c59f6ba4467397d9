"""A malformed env return or a bad reward fails only its episode, naming the env.

Before, a non-string observation, ``info=None``, a 4-tuple or ``reward=None`` ended the
whole stream with a bare TypeError, and NaN / inf / ``"1.5"`` rewards went silently
into ``scores``. Now each fails its episode like an env that raises: the group is
dropped and replaced (``dropped/errored``), and the stream goes on.
"""

from __future__ import annotations

import asyncio
import math
import reprlib
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.env_errors import MAX_ERROR_CHARS, EnvFailed
from rollpipe.agent.env_returns import EnvReturnError, check_reset, check_step, clip_reward
from rollpipe.agent.env_threads import EnvTimeoutError
from rollpipe.agent.episode import EpisodeSettings, run_episode
from rollpipe.agent.records import EpisodeSpec
from rollpipe.engines.records import SamplingParams
from rollpipe.envs import FrozenLake, register
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

SAMPLING = SamplingParams(max_tokens=12, temperature=1.0)

# mode -> (which call, how the return is corrupted, what the error says: field and value)
MODES: dict[str, tuple[str, Any, str]] = {
    "observation_not_str": ("step", lambda r: (7, *r[1:]), "observation must be a str, got int 7"),
    "info_none": ("step", lambda r: (*r[:4], None), "info must be a dict, got NoneType None"),
    "four_tuple": ("step", lambda r: r[:4], "the return must be a 5-tuple, got tuple of 4 ("),
    "reward_none": (
        "step",
        lambda r: (r[0], None, *r[2:]),
        "reward must be a real number, got NoneType None",
    ),
    "reward_str": (
        "step",
        lambda r: (r[0], "1.5", *r[2:]),
        "reward must be a real number, got str '1.5'",
    ),
    "reward_nan": ("step", lambda r: (r[0], math.nan, *r[2:]), "reward is nan;"),
    "reward_inf": ("step", lambda r: (r[0], -math.inf, *r[2:]), "reward is -inf;"),
    "reward_1e308": ("step", lambda r: (r[0], 1e308, *r[2:]), "reward is 1e+308, beyond float32"),
    "terminated_str": (
        "step",
        lambda r: (*r[:2], "yes", *r[3:]),
        "terminated must be a bool, got str 'yes'",
    ),
    "reset_info_list": ("reset", lambda r: (r[0], []), "info must be a dict, got list []"),
    "reset_one_value": ("reset", lambda r: r[0], "the return must be a 2-tuple, got str '"),
}


class CorruptLake(FrozenLake):
    """FrozenLake whose ``reset`` or ``step`` return is corrupted in one way, for the
    groups whose seed is even (odd ones play normally)."""

    def __init__(self, mode: str = "info_none", **kw: Any) -> None:
        super().__init__(**kw)
        self.call, self.corrupt, _ = MODES[mode]
        self.bad = False

    def reset(self, seed: int) -> Any:
        self.bad = seed % 2 == 0
        result = super().reset(seed)
        return self.corrupt(result) if self.bad and self.call == "reset" else result

    def step(self, action_text: str) -> Any:
        result = super().step(action_text)
        return self.corrupt(result) if self.bad and self.call == "step" else result


register("corrupt_lake", CorruptLake, overwrite=True)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_malformed_return_fails_the_episode_naming_env_and_field(
    mode: str, vllm_engine: Any, tokenizer: Any
) -> None:
    env = CorruptLake(mode)
    spec = EpisodeSpec(group_id=0, episode_id=0, seed=2, env_name="corrupt_lake")
    chat = ChatFormat(tokenizer)
    t = asyncio.run(
        run_episode(
            spec,
            env,
            vllm_engine,
            chat,
            EpisodeSettings(sampling=SAMPLING, max_turns=3, max_length=512),
        )
    )
    call, _, says = MODES[mode]
    assert t.end_reason == "error"
    assert t.error_type == "EnvReturnError" and t.error_call == f"CorruptLake.{call}"
    # what: the class, the call, the field and the value; where: env name, call and seed
    assert t.error.startswith("EnvReturnError(") and f"CorruptLake.{call}: {says}" in t.error
    assert f"(in CorruptLake.{call}: env 'corrupt_lake', seed 2, episode 0, turn " in t.error
    assert all(math.isfinite(u.reward) for u in t.turns)
    with pytest.raises(EnvReturnError) as raised:
        asyncio.run(
            run_episode(
                spec,
                env,
                vllm_engine,
                chat,
                EpisodeSettings(
                    sampling=SAMPLING, max_turns=3, max_length=512, raise_env_errors=True
                ),
            )
        )
    # re-raised as itself (the type a user catches), its text saying where (issue 34)
    text = str(raised.value)
    assert text.startswith(f"CorruptLake.{call}: {says}")
    assert f" (in CorruptLake.{call}: env 'corrupt_lake', seed 2, episode 0, turn " in text
    assert not getattr(raised.value, "__notes__", None)


@pytest.mark.parametrize("mode", ["four_tuple", "reward_nan", "reset_one_value"])
def test_the_stream_goes_on_with_whole_batches(mode: str, vllm_engine: Any, tokenizer: Any) -> None:
    config = PipelineConfig(
        envs=[{"name": "corrupt_lake", "config": {"mode": mode}}],
        group_size=2,
        batch_size=4,
        max_turns=2,
        concurrency=8,
        seed=3,
        sampling={"max_tokens": 12},
    )
    with RolloutPipeline(config, vllm_engine, tokenizer) as pipe:
        batches = [pipe.get_batch() for _ in range(2)]
    errored = sum(b.meta_info["metrics"]["dropped/errored"] for b in batches)
    assert errored >= 1  # half the seeds are corrupted: some group was dropped
    for batch in batches:
        assert len(batch) == 4
        assert torch.isfinite(batch.batch["scores"]).all()
        assert torch.isfinite(batch.batch["episode_scores"]).all()


@settings(max_examples=300, deadline=None)
@given(
    reward=st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(),
        st.none(),
        st.text(max_size=4),
        st.booleans(),
    ),
)
def test_check_step_accepts_exactly_finite_float32_numbers(reward: Any) -> None:
    result = ("obs", reward, False, False, {})
    ok = (
        isinstance(reward, (int, float))
        and not isinstance(reward, bool)
        and math.isfinite(float(reward))
        and abs(float(reward)) <= 3.4028234663852886e38
    )
    if ok:
        assert check_step(object(), result)[1] == float(reward)
    else:
        with pytest.raises(EnvReturnError) as raised:
            check_step(object(), result)
        # the field and the value, as the env returned it
        number = isinstance(reward, (int, float)) and not isinstance(reward, bool)
        says = "is" if number else f"must be a real number, got {type(reward).__name__}"
        assert f"object.step: reward {says} {reprlib.repr(reward)}" in str(raised.value)


@settings(max_examples=100, deadline=None)
@given(
    call=st.sampled_from(["reset", "step"]),
    observation=st.one_of(
        st.integers(), st.floats(allow_nan=False), st.none(), st.binary(max_size=4)
    ),
)
def test_a_non_str_observation_is_named_with_its_type_and_value(
    call: str, observation: Any
) -> None:
    check = check_reset if call == "reset" else check_step
    result = (observation, {}) if call == "reset" else (observation, 0.0, False, False, {})
    with pytest.raises(EnvReturnError) as raised:
        check(FrozenLake(), result)
    expected = f"observation must be a str, got {type(observation).__name__} "
    assert str(raised.value) == f"FrozenLake.{call}: {expected}{reprlib.repr(observation)}"


def test_check_reset_passes_good_returns_through() -> None:
    assert check_reset(object(), ("obs", {"a": 1})) == ("obs", {"a": 1})
    assert check_step(object(), ("o", 1, 0, 1, {})) == ("o", 1.0, False, True, {})


@settings(max_examples=80, deadline=None)
@given(
    st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(10**400), 10**400),
    st.floats(min_value=1e-3, max_value=1e3),
)
def test_clip_reward_bounds_every_number_but_nan(reward: Any, limit: float) -> None:
    result, clipped = clip_reward(("o", reward, False, False, {}), limit)
    value = float(reward) if not isinstance(reward, int) or abs(reward) < 10**300 else None
    if value is not None and math.isnan(value):
        assert not clipped and result[1] is reward  # NaN is left for check_step to reject
        return
    assert abs(result[1]) <= limit
    assert clipped == (value is None or abs(value) > limit)
    assert check_step(object(), result)[1] == result[1] or not clipped


@pytest.mark.parametrize("mode", ["reward_inf", "reward_1e308", "reward_nan"])
def test_reward_clip_clips_and_counts_but_nan_still_fails(
    mode: str, vllm_engine: Any, tokenizer: Any
) -> None:
    config = PipelineConfig(
        envs=[{"name": "corrupt_lake", "config": {"mode": mode}}],
        group_size=2,
        batch_size=4,
        max_turns=2,
        concurrency=8,
        seed=3,
        sampling={"max_tokens": 12},
        reward_clip=2.0,
    )
    with RolloutPipeline(config, vllm_engine, tokenizer) as pipe:
        batches = [pipe.get_batch() for _ in range(2)]
    clipped = sum(b.meta_info["metrics"]["rewards_clipped"] for b in batches)
    errored = sum(b.meta_info["metrics"]["dropped/errored"] for b in batches)
    scores = torch.cat([b.batch["episode_scores"] for b in batches])
    # at most two turns, each reward within ±2 (a corrupted one is clipped to it)
    assert torch.isfinite(scores).all() and (scores.abs() <= 4.0).all()
    if mode == "reward_nan":  # no side to clip to: still an error
        assert clipped == 0 and errored >= 1
    else:
        assert clipped >= 1 and errored == 0
        assert (scores.abs() >= 1.5).any()  # a clipped reward of ±2 is in some score


WHERE = "FrozenLake.step: env 'frozenlake', seed 5, episode 3, turn 1, env_timeout_s=60.0"


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=2000), kind=st.sampled_from([RuntimeError, ValueError, OSError]))
def test_an_errors_text_is_bounded_and_where_is_kept_whole(text: str, kind: type) -> None:
    """The record keeps the exception's type and text, cut to ``MAX_ERROR_CHARS``, and
    where it happened, always whole: a huge message cannot push the env or seed out."""
    failed = EnvFailed(kind(text), WHERE)
    message = str(failed)
    what = repr(kind(text))
    assert message.endswith(f" (in {WHERE})") and failed.call == "FrozenLake.step"
    head = message[: -len(f" (in {WHERE})")]
    assert len(head) <= MAX_ERROR_CHARS
    if len(what) <= MAX_ERROR_CHARS:
        assert head == what
    else:
        assert head.startswith(what[:100]) and head.endswith(f"... ({len(what)} chars)")


def test_a_re_raised_error_keeps_its_type_and_says_where_once() -> None:
    error = EnvTimeoutError("no return within 0.5 s")
    for _ in range(2):  # the same exception object failing two episodes: said once
        with pytest.raises(EnvTimeoutError) as raised:
            EnvFailed(error, WHERE).reraise()
    where = f"(in {WHERE}; raise env_timeout_s or fix the env)"
    assert raised.value is error and str(error) == f"no return within 0.5 s {where}"
    assert not getattr(error, "__notes__", None)
