"""The protocol records and inputs, and BaseEngine driving a backend (a fake one, no model)."""

from __future__ import annotations

import asyncio
import math
import threading

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rollpipe.engines import (
    BaseEngine,
    CheckedIds,
    Engine,
    EngineClosedError,
    EngineError,
    EngineLink,
    Generation,
    HFEngine,
    PauseMode,
    SamplingParams,
    VLLMEngine,
    check_prompt,
    named_tensors,
)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("stop_token_ids", (1, -2)),
        ("seed", -1),
        ("seed", 1.0),
        ("logprobs", 1),
        ("ignore_eos", "yes"),
    ],
)
def test_invalid_sampling_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=field):
        SamplingParams().replace(**{field: value})


@given(
    max_tokens=st.integers(1, 4096),
    temperature=st.floats(0, 100),
    top_p=st.floats(0, 1, exclude_min=True),
    top_k=st.integers(0, 1000),
    stop=st.lists(st.integers(0, 10_000), max_size=4),
    seed=st.none() | st.integers(0, 2**31),
)
def test_valid_sampling_params_round_trip(
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    stop: list[int],
    seed: int | None,
) -> None:
    p = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop_token_ids=stop,
        seed=seed,
    )
    assert p.stop_token_ids == tuple(stop)
    assert p.greedy == (temperature == 0)
    assert p.replace(max_tokens=1).max_tokens == 1 and p.replace() == p
    assert hash(p) == hash(p.replace())


def test_generation_checks_lengths_and_reason() -> None:
    g = Generation([1, 2], [-0.5, -1.0], "stop", [0, 1])
    assert g.token_ids == (1, 2) and g.versions == (0, 1) and g.num_tokens == 2
    assert Generation([1], [], "length", [3]).logprobs == ()
    with pytest.raises(ValueError, match="versions"):
        Generation([1, 2], [], "stop", [0])
    with pytest.raises(ValueError, match="logprobs"):
        Generation([1, 2], [-1.0], "stop", [0, 0])
    with pytest.raises(ValueError, match="finish_reason"):
        Generation([1], [], "eos", [0])


def test_named_tensors_accepts_dict_pairs_and_modules() -> None:
    lin = torch.nn.Linear(2, 3)
    from_module = named_tensors(lin)
    assert [n for n, _ in from_module] == ["weight", "bias"]
    assert named_tensors(dict(from_module))[0][0] == "weight"
    assert named_tensors(iter(from_module))[1][1].shape == (3,)
    with pytest.raises(ValueError, match="no weights"):
        named_tensors({})
    with pytest.raises(TypeError, match="must be \\(str, Tensor\\)"):
        named_tensors([("w", 3)])  # type: ignore[list-item]


def test_check_prompt() -> None:
    for ids in ([1, 2], (1, 2), torch.tensor([1, 2]), np.array([1, 2], dtype=np.int32)):
        out = check_prompt(ids, 10)
        assert out == [1, 2] and type(out) is list and all(type(t) is int for t in out)
    assert check_prompt([5, 10**6]) == [5, 10**6]  # no vocabulary: only >= 0 is checked
    with pytest.raises(ValueError, match="empty"):
        check_prompt([], 10)
    with pytest.raises(ValueError, match=r"vocabulary \[0, 10\): \[10, -1\]"):
        check_prompt([1, 10, -1], 10)
    for bad in ([1.5, 2], ["a"], [[1, 2]], [[1], [2, 3]], torch.ones(2)):
        with pytest.raises(ValueError, match="prompt_ids must be a 1-D sequence of ints"):
            check_prompt(bad, 10)  # type: ignore[arg-type]


@given(
    parts=st.lists(st.lists(st.integers(0, 40), max_size=6), max_size=6),
    vocab=st.integers(1, 45),
    in_place=st.booleans(),
    trusted=st.booleans(),
)
def test_checked_ids_are_checked_by_their_bounds(parts, vocab, in_place, trusted) -> None:
    """A prompt grown from checked parts passes check_prompt exactly when the same ids as
    a plain list do, without a copy; only the appended part is ever converted."""
    ids = CheckedIds()
    for part in parts:
        if in_place:
            ids.extend_checked(part, trusted=trusted)
        else:
            ids = ids.extended(part, trusted=trusted)
    flat = [i for part in parts for i in part]
    assert list(ids) == flat
    try:
        expected: list[int] | str = check_prompt(flat, vocab)
    except ValueError as e:
        expected = str(e)
    try:
        got = check_prompt(ids, vocab)
        assert got is ids
    except ValueError as e:
        got = str(e)  # type: ignore[assignment]
    assert got == expected


def test_checked_ids_refuse_bad_parts() -> None:
    ids = CheckedIds([1, 2])
    for bad in ([-1], [1.5], ["a"], [[1]]):
        with pytest.raises(ValueError, match="prompt_ids"):
            ids.extended(bad)  # type: ignore[arg-type]
    assert ids.extended(torch.tensor([7]), trusted=True) == [1, 2, 7]  # not a list: checked
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ids.extended([3, -1], trusted=True)  # a trusted part's bounds are still read
    assert ids == [1, 2] and (ids.low, ids.high) == (1, 2)


def test_engines_satisfy_the_protocol() -> None:
    assert issubclass(EngineClosedError, EngineError)
    for cls in (VLLMEngine, HFEngine):
        for name in (
            "generate",
            "generate_batch",
            "pause",
            "resume",
            "update_weights",
            "close",
            "__enter__",
            "__exit__",
            "version",
            "is_paused",
            "interruptions",
        ):
            assert hasattr(cls, name), (cls, name)
    assert Engine is not None


class _FakeBackend:
    """A backend that records how its engine drives it (no model)."""

    vocab_size = 100

    def __init__(self, link: EngineLink) -> None:
        self.link = link
        self.calls: list[tuple[str, object]] = []
        self.stuck = asyncio.Event()  # generate([99]) waits here until shutdown
        self.entered_stuck = threading.Event()  # generate([99]) has begun waiting
        self.released = False

    @classmethod
    async def start(cls, link: EngineLink) -> _FakeBackend:
        return cls(link)

    async def generate(self, prompt: list[int], params: SamplingParams) -> Generation:
        if prompt == [98]:
            error = RuntimeError("the model fell over")
            self.link.on_death(error)
            raise EngineError(f"step failed: {error!r}")
        if prompt == [99]:
            self.entered_stuck.set()
            await self.stuck.wait()
        version = self.link.version()
        return Generation(prompt, [], "length", [version] * len(prompt))

    async def pause(self, mode: PauseMode) -> None:
        self.calls.append(("pause", self.link.pause_mode()))

    async def resume(self) -> None:
        self.calls.append(("resume", self.link.pause_mode()))

    async def load_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        self.calls.append(("load", (self.link.version(), version)))

    async def shutdown(self, error: BaseException) -> None:
        self.calls.append(("shutdown", type(error).__name__))

    def release(self) -> None:
        self.released = True


class _FakeEngine(BaseEngine):
    _backend: _FakeBackend

    def __init__(self) -> None:
        super().__init__(name="fake-engine")
        self._attach(_FakeBackend.start, "nothing")


def test_base_engine_owns_version_pause_and_death() -> None:
    """The engine owns the state; the backend reads it through its link only."""
    engine = _FakeEngine()
    backend = engine._backend
    assert isinstance(engine, Engine) and engine.version == 0 and not engine.is_paused
    assert engine.tokens_generated == 0
    assert engine.generate_batch([np.array([3, 4])], SamplingParams())[0].token_ids == (3, 4)
    assert engine.tokens_generated == 2  # a backend that does not report: counted on return
    engine.pause("abort")
    assert engine.is_paused and engine.pause_mode == "abort"
    engine.resume()
    assert not engine.is_paused
    assert engine.update_weights({"w": torch.zeros(1)}) == 1 == engine.version
    assert engine.update_weights({"w": torch.zeros(1)}, version=7) == 7
    with pytest.raises(ValueError, match="update_weights: version must be an int >= 0"):
        engine.update_weights({"w": torch.zeros(1)}, version=-1)
    assert backend.calls == [
        ("pause", "abort"),  # the mode is set before the backend acts on it...
        ("resume", None),  # ...and cleared before it resumes
        ("load", (0, 1)),  # the version changes once the load is done
        ("load", (1, 7)),
    ]
    assert asyncio.run(engine.generate([5], SamplingParams())).versions == (7,)
    assert engine.tokens_generated == 3
    with pytest.raises(EngineError, match="step failed"):
        engine.generate_batch([[98]], SamplingParams())
    with pytest.raises(EngineError, match="died"):  # later calls fail fast
        engine.generate_batch([[5]], SamplingParams())
    engine.close()
    assert backend.released and backend.calls[-1] == ("shutdown", "EngineClosedError")


def test_base_engine_close_fails_waiting_requests_at_once() -> None:
    engine = _FakeEngine()

    async def main() -> BaseException | Generation:
        stuck = asyncio.ensure_future(engine.generate([99], SamplingParams()))
        assert await asyncio.to_thread(engine._backend.entered_stuck.wait, 30)
        await asyncio.to_thread(engine.close)
        return (await asyncio.gather(stuck, return_exceptions=True))[0]

    assert isinstance(asyncio.run(main()), EngineClosedError)
    assert not engine.runtime.thread.is_alive()
    with pytest.raises(EngineClosedError):
        engine.pause()
