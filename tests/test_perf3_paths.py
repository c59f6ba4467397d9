"""The per-turn shortcuts of issue 28's last round give what the general paths give: the
usual step return accepted as it is, an env method's kind looked up once, the episode's
routing session entered once, cached version spans, shared continuation pieces."""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.conversation import generate_turn, stopping_at_end_of_turn
from rollpipe.agent.env_caller import Clock
from rollpipe.agent.env_returns import EnvReturnError, check_step
from rollpipe.agent.episode import EpisodeSettings, run_episode
from rollpipe.agent.records import EpisodeSpec, Group, Trajectory, Turn
from rollpipe.engines import SamplingParams, ScriptedEngine
from rollpipe.engines.routing import Route, current_route


class _Info(dict):  # type: ignore[type-arg]
    """A dict that is not exactly a dict: check_step takes its general path for it."""


class _Env:
    pass


_VALUES = (
    st.floats(allow_nan=True, allow_infinity=True)
    | st.integers(-(2**70), 2**70)
    | st.booleans()
    | st.text(max_size=3)
    | st.none()
    | st.just(3.5e38)
    | st.just(-3.5e38)
)


@settings(max_examples=300, deadline=None)
@given(
    observation=st.text(max_size=5) | st.integers() | st.none(),
    reward=_VALUES,
    terminated=st.booleans() | st.integers(-1, 2) | st.none(),
    truncated=st.booleans() | st.integers(-1, 2) | st.none(),
    info=st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
def test_check_step_fast_path_is_the_general_check(
    observation: Any, reward: Any, terminated: Any, truncated: Any, info: dict[str, Any]
) -> None:
    def checked(info: Any) -> Any:
        try:
            return check_step(_Env(), (observation, reward, terminated, truncated, info))
        except EnvReturnError as exc:
            return ("error", str(exc).replace("_Info", "dict"))

    fast, general = checked(info), checked(_Info(info))
    assert fast == general
    if fast[0] != "error":
        assert [type(v) for v in fast[1:4]] == [float, bool, bool]
        assert type(general[1]) is float and math.isfinite(fast[1])


class _Steps:
    """An env whose step becomes a coroutine function after the first turn."""

    blocking = False

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        return "start", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.step = self._async_step  # type: ignore[method-assign]
        return "sync", 1.0, False, False, {}

    async def _async_step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return "async", 2.0, False, False, {}


def _answer(prompt: Any, params: SamplingParams) -> list[int]:
    return [5, 6]


def _run(engine: ScriptedEngine, env: Any, tokenizer: Any, turns: int) -> Trajectory:
    spec = EpisodeSpec(group_id=0, episode_id=7, seed=1, env_name="x")
    settings = EpisodeSettings(sampling={"max_tokens": 4}, max_turns=turns, max_length=4096)
    coro = run_episode(spec, env, engine, ChatFormat(tokenizer), settings)
    return engine.runtime.submit(coro).result(60)  # type: ignore[no-any-return]


def test_an_env_method_replaced_mid_episode_is_called_as_what_it_is_now(tokenizer) -> None:
    with ScriptedEngine(_answer) as engine:
        t = _run(engine, _Steps(), tokenizer, 3)
    assert [u.reward for u in t.turns] == [1.0, 2.0, 2.0]  # the coroutine was awaited
    assert t.end_reason == "max_turns"


def test_every_request_of_an_episode_is_made_in_its_session(tokenizer) -> None:
    seen: list[Route | None] = []

    def policy(prompt: Any, params: SamplingParams) -> list[int]:
        seen.append(current_route())
        return [5, 6]

    class Chat(_Steps):
        def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
            return "again", 0.0, False, False, {}

    with ScriptedEngine(policy) as engine:
        _run(engine, Chat(), tokenizer, 4)
        assert len(seen) == 4 and seen[0] is not None and seen[0].key == 7
        assert all(s is seen[0] for s in seen)  # one session, entered once
        assert engine.runtime.submit(_no_session()).result(30) is None  # and left after

        # a caller outside any session (the front door): generate_turn enters it itself
        session = Route("door")
        params = SamplingParams(max_tokens=2)
        one = generate_turn(engine, [1, 2], params, None, 0, Clock(), session)
        gen = engine.runtime.submit(one).result(30)
        assert gen.token_ids == (5, 6) and seen[-1] is session


async def _no_session() -> Route | None:
    return current_route()


def _turn(versions: tuple[int, ...]) -> Turn:
    n = len(versions)
    return Turn(
        prompt_ids=[1],
        response_ids=[2] * n,
        logprobs=[0.0] * n,
        versions=versions,
        reward=0.0,
        finish_reason="stop",
        action_valid=None,
        action_text="",
        observation="",
    )


def _trajectory(turns: list[tuple[int, ...]], episode: int = 0) -> Trajectory:
    spec = EpisodeSpec(group_id=0, episode_id=episode, seed=0, env_name="x")
    return Trajectory(
        spec=spec,
        env_id=0,
        turns=[_turn(v) for v in turns],
        score=0.0,
        success=False,
        end_reason="max_turns",
    )


_VERSIONS = st.lists(st.lists(st.integers(0, 9), max_size=4).map(tuple), max_size=4)


@given(members=st.lists(_VERSIONS, min_size=1, max_size=3))
def test_version_spans_are_the_min_and_max_of_every_token(members) -> None:
    trajectories = [_trajectory(turns, i) for i, turns in enumerate(members)]
    for t, turns in zip(trajectories, members, strict=True):
        flat = [v for versions in turns for v in versions]
        fresh = _trajectory(turns, t.episode_id)
        assert t == fresh and hash(t) == hash(fresh)  # equal before any span is read
        assert t.min_version == (min(flat) if flat else -1)
        assert t.max_version == (max(flat) if flat else -1)
        assert t == fresh and hash(t) == hash(fresh)  # and after (the cache takes no part)
        moved = attrs.evolve(t, turns=[_turn((42,))])
        assert (moved.min_version, moved.max_version) == (42, 42)  # not the cached span
    every = [v for turns in members for versions in turns for v in versions]
    group = Group(0, tuple(trajectories))
    assert group.min_version == (min(every) if every else -1)


@pytest.mark.parametrize("ends_with_eot", [True, False])
def test_turns_that_repeat_an_observation_share_its_cached_pieces(
    tokenizer, ends_with_eot: bool
) -> None:
    chat = ChatFormat(tokenizer)
    eot = [chat.eot_id] if ends_with_eot else []

    def policy(prompt: Any, params: SamplingParams) -> list[int]:
        return [*tokenizer.encode("go"), *eot]

    class Same(_Steps):
        def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
            return "the same observation", 0.0, False, False, {}

    with ScriptedEngine(policy) as engine:
        t = _run(engine, Same(), tokenizer, 4)
    later = [u.prompt_ids for u in t.turns[2:]]
    assert all(ids is t.turns[1].prompt_ids for ids in later)  # one tuple, not one each
    expected = chat.continuation("the same observation", t.turns[0].response_ids)
    assert all(list(u.prompt_ids) == expected for u in t.turns[1:])
    for u in t.turns:  # the packed ids the rows read are the turn's own ids
        assert u.token_array.tolist() == [*u.prompt_ids, *u.response_ids]


@given(
    prompt=st.lists(st.integers(0, 2**40), max_size=20),
    response=st.lists(st.integers(0, 2**40), max_size=10),
    given_as=st.sampled_from(["none", "read-only", "writable", "int32", "wrong length"]),
)
def test_a_turn_packs_its_ids_whatever_prompt_array_it_gets(prompt, response, given_as) -> None:
    packed = np.array(prompt, dtype=np.int64)
    if given_as == "read-only":
        packed.flags.writeable = False
    elif given_as == "int32":
        packed = (packed % 2**31).astype(np.int32)
    elif given_as == "wrong length":
        packed = np.append(packed, 1)
    n = len(response)
    fields = {
        "prompt_ids": prompt,
        "response_ids": response,
        "logprobs": [0.5] * n,
        "versions": [1] * n,
        "reward": 0.0,
        "finish_reason": "stop",
        "action_valid": None,
        "action_text": "",
        "observation": "",
    }
    turn = Turn(**fields, prompt_array=None if given_as == "none" else packed)
    assert turn == Turn(**fields)
    assert turn.prompt_array.dtype == np.int64 and turn.prompt_array.tolist() == prompt
    assert turn.token_array.tolist() == prompt + response and turn.token_array.dtype == np.int64
    arrays = (turn.prompt_array, turn.response_array, turn.logprob_array, turn.token_array)
    assert not any(a.flags.writeable for a in arrays)
    assert (turn.prompt_array is packed) == (given_as == "read-only")  # shared, never copied
    if given_as == "writable" and prompt:
        packed[0] += 1  # the caller's array changes; the turn's ids do not
        assert turn.prompt_array.tolist() == prompt


@given(
    stops=st.lists(st.integers(0, 9), max_size=3),
    eot=st.none() | st.integers(0, 9),
    ignore_eos=st.booleans(),
)
def test_an_episodes_sampling_is_made_once_and_is_what_replace_gives(
    stops, eot, ignore_eos
) -> None:
    base = SamplingParams(max_tokens=5, stop_token_ids=stops, ignore_eos=ignore_eos)
    expected = list(stops) if eot is None or eot in stops or ignore_eos else [*stops, eot]
    first = stopping_at_end_of_turn(base, eot)
    assert first == base.replace(stop_token_ids=expected)
    assert stopping_at_end_of_turn(base, eot) is first  # cached for the run
    twin = SamplingParams(max_tokens=5, stop_token_ids=stops, ignore_eos=ignore_eos)
    assert stopping_at_end_of_turn(twin, eot) == first  # another settings object: its own entry
    other = 10 if eot is None else None
    assert stopping_at_end_of_turn(base, other) == base.replace(
        stop_token_ids=list(stops) if other is None or ignore_eos else [*stops, 10]
    )


@attrs.define  # eq without hash: an unhashable callable
class _UnhashableStep:
    reward: float

    def __call__(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return "x", self.reward, False, False, {}


def test_an_env_method_that_cannot_be_hashed_is_called(tokenizer) -> None:
    env = _Steps()
    env.step = _UnhashableStep(3.0)  # type: ignore[method-assign]
    with ScriptedEngine(_answer) as engine:
        t = _run(engine, env, tokenizer, 2)
    assert [u.reward for u in t.turns] == [3.0, 3.0] and t.end_reason == "max_turns"
