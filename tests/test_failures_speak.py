"""Failures speak at once (issue 34), on the real pipeline, vLLM engine and front door.

A user's env whose every episode raised made ``get_batch`` drop and replace groups with
no output for 400 s (``max_drops_in_a_row`` was the only limit: 1000 groups), and the
only lines printed were aiohttp tracebacks from the front door when a streaming client
went away. Now the first error of each env tag and exception type is a WARNING when it
happens, a tag that gives only errors ends the stream after ``max_errors_in_a_row``
errors of one kind (or ``max_error_seconds``), a client that leaves is one DEBUG line,
and an error re-raised under ``raise_env_errors=True`` says where in its own text.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import threading
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torchdata.nodes import Loader

from rollpipe.agent.env_errors import EnvFailed
from rollpipe.agent.episode import EpisodeSettings
from rollpipe.agent.records import EpisodeSpec, Trajectory
from rollpipe.envs import FrozenLake, register
from rollpipe.frontdoor import FrontDoor
from rollpipe.nodes.episode_source import EnvChoice, EpisodeSource
from rollpipe.nodes.error_runs import TIMED_MIN_ERRORS, ErrorRuns
from rollpipe.nodes.groups import GroupAssembler, GroupSettings
from rollpipe.nodes.rollout import EpisodeRunner, RunnerSettings
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

from records import make_trajectory

ENV_LOG = "rollpipe.agent.env_errors"
SAMPLING = {"max_tokens": 8}


class BrokenLake(FrozenLake):
    """FrozenLake whose ``step`` raises ``error`` (the user's case: a reward function the
    harness could not await raised a TypeError in every episode)."""

    blocking = False
    steps = itertools.count()  # every step taken, by any instance

    def __init__(self, error: str = "TypeError", **kw: Any) -> None:
        super().__init__(**kw)
        self.error = error

    def step(self, action_text: str) -> Any:
        next(BrokenLake.steps)
        kind = {"TypeError": TypeError, "ValueError": ValueError}[self.error]
        raise kind("object bool can't be used in 'await' expression")


register("broken_lake", BrokenLake, overwrite=True)


def config(**changes: Any) -> PipelineConfig:
    base: dict[str, Any] = dict(
        envs="broken_lake",
        group_size=2,
        batch_size=4,
        max_turns=2,
        max_length=512,
        concurrency=4,
        seed=3,
        sampling=SAMPLING,
    )
    return PipelineConfig(**(base | changes))


def env_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == ENV_LOG]


def test_the_first_error_of_each_tag_and_type_is_a_warning_when_it_happens(
    vllm_engine: Any, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """One episode at a time: the WARNING is there as the first errored trajectory comes
    out, naming its env, call, seed, episode, type and text; later errors of the same tag
    and type add none, another type or tag adds one, the working env none."""
    caplog.set_level(logging.WARNING, logger=ENV_LOG)
    envs = [
        EnvChoice("broken_lake", tag="typed"),
        EnvChoice("broken_lake", {"error": "ValueError"}, tag="valued"),
        EnvChoice("frozenlake"),
    ]
    episode = EpisodeSettings(max_turns=1, sampling=SAMPLING)
    source = EpisodeSource(12, 2, seed=5, envs=envs)
    rollout = EpisodeRunner(source, vllm_engine, tokenizer, RunnerSettings(concurrency=1), episode)
    seen: list[Trajectory] = []
    try:
        for traj in Loader(rollout):
            seen.append(traj)
            errors = [t for t in seen if t.end_reason == "error"]
            if len(errors) == 1 and traj is errors[0]:  # the first error, just out
                (warning,) = env_warnings(caplog)
                assert warning.startswith(f"first {traj.error_type} from env tag '{traj.tag}': ")
                assert f"(in BrokenLake.step: env 'broken_lake', seed {traj.spec.seed}, " in warning
                assert f"episode {traj.episode_id}, turn 0" in warning
                assert "object bool can't be used in 'await' expression" in warning
    finally:
        rollout.close()
    pairs = {(t.tag, t.error_type) for t in seen if t.end_reason == "error"}
    assert pairs == {("typed", "TypeError"), ("valued", "ValueError")}
    assert sum(t.end_reason == "error" for t in seen) > len(pairs)  # repeats were not logged
    heads = sorted(
        re.findall(r"^first (\w+) from env tag '(\w+)'", "\n".join(env_warnings(caplog)), re.M)
    )
    assert heads == [("TypeError", "typed"), ("ValueError", "valued")]
    assert any(t.tag == "frozenlake" and t.end_reason != "error" for t in seen)


def test_an_env_that_always_errors_stops_after_max_errors_in_a_row(
    vllm_engine: Any, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """By count (no time limit here, so the machine's speed cannot matter): the stream
    ends at the 6th error, with the cause, not after max_drops_in_a_row=1000 groups."""
    caplog.set_level(logging.WARNING, logger=ENV_LOG)
    cfg = config(max_errors_in_a_row=6, max_error_seconds=None)
    assert cfg.groups.max_drops_in_a_row == 1000  # not what stops it
    with RolloutPipeline(cfg, vllm_engine, tokenizer) as pipe, pytest.raises(RuntimeError) as info:
        pipe.get_batch()
    message = str(info.value)
    assert message.startswith(
        "GroupAssembler: env tag 'broken_lake' gave only errors, no usable trajectory, for "
    )
    assert "(6 TypeError in BrokenLake.step)" in message
    assert "max_errors_in_a_row=6 stopped the stream early" in message
    quoted = re.findall(r"^  \* (.*)$", message, flags=re.M)
    assert len(quoted) == 3
    for line in quoted:
        assert line.startswith("TypeError(\"object bool can't be used in 'await' expression\")")
        assert re.search(r"\(in BrokenLake\.step: env 'broken_lake', seed \d+, episode \d+", line)
    (warning,) = env_warnings(caplog)  # one WARNING, however many episodes errored
    assert warning.startswith("first TypeError from env tag 'broken_lake': TypeError(")


def test_a_tag_that_only_errors_stops_a_mix_whose_other_env_works(
    vllm_engine: Any, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The working env's groups keep batches coming, so max_drops_in_a_row never counts;
    the broken tag's own run of errors still ends the stream, and says which tag."""
    caplog.set_level(logging.WARNING, logger=ENV_LOG)
    envs = [{"name": "frozenlake"}, {"name": "broken_lake", "tag": "broken"}]
    cfg = config(envs=envs, num_groups=None, max_errors_in_a_row=5, max_error_seconds=None)
    batches = 0
    with RolloutPipeline(cfg, vllm_engine, tokenizer) as pipe, pytest.raises(RuntimeError) as info:
        for _ in range(200):  # far more than 5 broken episodes
            pipe.get_batch()
            batches += 1
    message = str(info.value)
    assert message.startswith("GroupAssembler: env tag 'broken' gave only errors")
    assert "(5 TypeError in BrokenLake.step)" in message
    assert "max_errors_in_a_row=5 stopped the stream early" in message
    (warning,) = env_warnings(caplog)
    assert warning.startswith("first TypeError from env tag 'broken': ")
    assert batches < 200


class StepClock:
    """A clock the test controls: each reading is ``step`` seconds after the last."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_max_error_seconds_stops_a_run_that_lasted_that_long(
    vllm_engine: Any, tokenizer: Any
) -> None:
    """With a clock that moves 10 s per reading, the run is past 30 s long before it has
    TIMED_MIN_ERRORS errors: the time rule ends it at exactly that many."""
    episode = EpisodeSettings(max_turns=1, sampling=SAMPLING)
    source = EpisodeSource(None, 2, seed=7, envs="broken_lake")
    rollout = EpisodeRunner(source, vllm_engine, tokenizer, RunnerSettings(concurrency=4), episode)
    groups = GroupAssembler(
        rollout, 2, max_errors_in_a_row=1000, max_error_seconds=30.0, clock=StepClock(10.0)
    )
    try:
        with pytest.raises(RuntimeError) as info:
            list(Loader(groups))
    finally:
        rollout.close()
    message = str(info.value)
    assert f"({TIMED_MIN_ERRORS} TypeError in BrokenLake.step)" in message
    # reset read the clock (the run's start), then each error once: the 16th 160 s later
    assert f"for {TIMED_MIN_ERRORS * 10.0:.1f} s" in message
    assert "max_error_seconds=30 stopped the stream early" in message


def test_group_settings_check_the_new_limits() -> None:
    with pytest.raises(ValueError, match=r"GroupSettings\.max_errors_in_a_row must be an int"):
        GroupSettings(max_errors_in_a_row=0)
    with pytest.raises(ValueError, match=r"GroupSettings\.max_error_seconds must be a number"):
        GroupSettings(max_error_seconds=-1.0)
    assert GroupSettings(max_error_seconds=None).max_error_seconds is None
    flat = PipelineConfig(max_errors_in_a_row=3, max_error_seconds=5.0)
    assert (flat.groups.max_errors_in_a_row, flat.groups.max_error_seconds) == (3, 5.0)


# -- the rule, over any sequence of outcomes -------------------------------------------
TAGS = ("a", "b")
KINDS = ("TypeError", "KeyError")
EVENT = st.tuples(st.sampled_from(TAGS), st.sampled_from((None, *KINDS)))  # None: usable


def _traj(n: int, tag: str, kind: str | None) -> Trajectory:
    base = make_trajectory(n, n, end_reason="terminated" if kind is None else "error")
    spec = EpisodeSpec(n, n, n, "lake", tag=tag)
    return Trajectory(
        spec=spec,
        env_id=0,
        turns=base.turns,
        score=0.0,
        success=False,
        end_reason=base.end_reason,
        error=base.error,
        error_type=kind,
        error_call=None if kind is None else "Lake.step",
    )


@settings(max_examples=200, deadline=None)
@given(events=st.lists(EVENT, max_size=60), limit=st.integers(1, 6))
def test_a_run_ends_the_stream_exactly_when_one_tag_gives_limit_errors_of_a_kind(
    events: list[tuple[str, str | None]], limit: int
) -> None:
    """Reference model: per tag, errors of each kind since that tag's last usable
    trajectory; the stream ends at the first event that brings one to ``limit``. Usable
    trajectories of another tag do not end a tag's run."""
    runs = ErrorRuns(limit, None)
    counts: dict[str, dict[str, int]] = {}
    for n, (tag, kind) in enumerate(events):
        traj = _traj(n, tag, kind)
        if kind is None:
            runs.usable(tag)
            counts.pop(tag, None)
            continue
        run = runs.errored(traj)
        tag_counts = counts.setdefault(tag, {})
        tag_counts[kind] = tag_counts.get(kind, 0) + 1
        if tag_counts[kind] >= limit:
            assert run is not None and run.tag == tag
            assert run.kinds[f"{kind} in Lake.step"] == limit
            assert run.rule == f"max_errors_in_a_row={limit}"
            return
        assert run is None


def test_no_time_limit_without_enough_errors_and_none_with_a_usable_one() -> None:
    """A slow env that errors now and then never trips the time rule: fewer than
    TIMED_MIN_ERRORS errors in a row, or a usable trajectory between them."""
    clock = StepClock(1000.0)  # every reading is far past the limit
    runs = ErrorRuns(1000, 1.0, clock)
    for n in range(10 * TIMED_MIN_ERRORS):
        if n % TIMED_MIN_ERRORS == TIMED_MIN_ERRORS - 1:
            runs.usable("a")
        else:
            assert runs.errored(_traj(n, "a", "TypeError")) is None
    run = None
    for n in range(TIMED_MIN_ERRORS):
        run = runs.errored(_traj(n, "a", "TypeError"))
    assert run is not None and run.rule == "max_error_seconds=1"


# -- raise_env_errors ----------------------------------------------------------------
def test_an_error_re_raised_names_env_call_seed_and_episode_in_its_text(
    vllm_engine: Any, tokenizer: Any
) -> None:
    cfg = config(raise_env_errors=True)
    with RolloutPipeline(cfg, vllm_engine, tokenizer) as pipe, pytest.raises(TypeError) as info:
        pipe.get_batch()
    error = info.value
    assert type(error) is TypeError  # the env's own type
    text = str(error)
    located = re.fullmatch(
        r"object bool can't be used in 'await' expression \(in BrokenLake\.step: env "
        r"'broken_lake', seed (\d+), episode (\d+), turn 0, env_timeout_s=60\.0\)",
        text,
    )
    assert located is not None, text
    assert not getattr(error, "__notes__", None)  # said once, in the text


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=40))
def test_reraise_appends_where_to_any_text_or_adds_a_note(text: str) -> None:
    where = "Lake.step: env 'lake', seed 5, episode 3, turn 0"
    located, note = f"(in {where})", f"rollpipe: raised in {where}"
    for error in (ValueError(text), RuntimeError(), KeyError(text), OSError(2, text)):
        said = bool(error.args) and bool(text)  # before: reraise changes the args
        with pytest.raises(type(error)) as info:
            EnvFailed(error, where).reraise()
        shown, notes = str(info.value), getattr(info.value, "__notes__", [])
        if isinstance(error, OSError):  # its text comes from errno and strerror: a note
            assert (shown, notes) == (f"[Errno 2] {text}", [note])
        elif isinstance(error, KeyError):  # its text is the repr of its argument
            assert (located in shown and not notes) or notes == [note]
        else:
            assert shown == (f"{text} {located}" if said else located)
            assert notes == []


# -- the front door: a client that goes away -------------------------------------------
class HeldAdmission:
    """A session's admission that holds the engine request until ``release()``."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.reached = threading.Event()
        self._open: asyncio.Event | None = None

    async def __call__(self) -> None:
        if self._open is not None:  # held once: later requests go on
            return
        self._open = asyncio.Event()
        self.reached.set()
        await self._open.wait()

    def release(self) -> None:
        assert self._open is not None
        self.runtime.call_soon(self._open.set)


class DebugSeen(logging.Handler):
    """Sets ``seen`` when the front door logs its DEBUG line about a client leaving."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "rollpipe.frontdoor.streaming" and "went away" in record.getMessage():
            self.seen.set()


@pytest.fixture
def debug_seen() -> Iterator[DebugSeen]:
    handler = DebugSeen()
    logger = logging.getLogger("rollpipe.frontdoor.streaming")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


DOOR = EpisodeSettings(max_length=2048, sampling={"max_tokens": 1500, "ignore_eos": True})
MESSAGES = [{"role": "user", "content": "Say something long."}]


def loud(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_streaming_client_that_leaves_is_one_debug_line_not_a_traceback(
    vllm_engine: Any, tokenizer: Any, caplog: pytest.LogCaptureFixture, debug_seen: DebugSeen
) -> None:
    """The real ``openai`` client reads the first chunk and closes while the engine
    request is held; released, the answer's next write finds the client gone."""
    caplog.set_level(logging.DEBUG)
    with FrontDoor(vllm_engine, tokenizer, DOOR) as door:
        held = HeldAdmission(vllm_engine.runtime)
        session = door.open_session(admit=held)

        async def leave_mid_stream() -> None:
            client = openai.AsyncOpenAI(base_url=door.url, api_key=session.key, max_retries=0)
            stream = await client.chat.completions.create(
                model="rollpipe",
                messages=MESSAGES,
                stream=True,  # type: ignore[arg-type]
            )
            first = await anext(aiter(stream))
            assert first.choices[0].delta.role == "assistant"
            assert await asyncio.to_thread(held.reached.wait, 60)
            await stream.close()
            await client.close()

        asyncio.run(leave_mid_stream())
        held.release()
        assert debug_seen.seen.wait(60), "the door never noticed the client left"
        traj = door.finish(session.key)
    assert loud(caplog) == []
    debug = [r for r in caplog.records if r.name == "rollpipe.frontdoor.streaming"]
    assert len(debug) == 1 and debug[0].levelno == logging.DEBUG
    assert "the client went away" in debug[0].getMessage()
    assert traj.end_reason != "error" and not traj.turns  # the call was never answered


def test_a_client_that_leaves_a_whole_answer_logs_nothing_loud(
    vllm_engine: Any, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Not streamed: the client is cancelled while its request is held; the door answers
    into a closed connection and says nothing at WARNING or above."""
    caplog.set_level(logging.DEBUG)
    settings_ = EpisodeSettings(max_length=2048, sampling={"max_tokens": 16})
    with FrontDoor(vllm_engine, tokenizer, settings_) as door:
        held = HeldAdmission(vllm_engine.runtime)
        session = door.open_session(admit=held)

        async def leave() -> None:
            client = openai.AsyncOpenAI(base_url=door.url, api_key=session.key, max_retries=0)
            call = asyncio.ensure_future(
                client.chat.completions.create(model="rollpipe", messages=MESSAGES)  # type: ignore[arg-type]
            )
            assert await asyncio.to_thread(held.reached.wait, 60)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await client.close()

        asyncio.run(leave())
        held.release()
        # the session's calls take turns: this one starts once the first was answered
        # (into the closed connection); the door's close then waits for its handler
        again = openai.OpenAI(base_url=door.url, api_key=session.key, max_retries=0)
        answer = again.chat.completions.create(model="rollpipe", messages=MESSAGES)  # type: ignore[arg-type]
        again.close()
        traj = door.finish(session.key)
    assert answer.choices[0].message.role == "assistant"
    assert len(traj.turns) == 2  # the abandoned call was answered and recorded too
    assert loud(caplog) == []
