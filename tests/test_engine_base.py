"""The protocol records: SamplingParams / Generation validation, weight normalisation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rollpipe.engines import Engine, EngineClosedError, EngineError, HFEngine, VLLMEngine
from rollpipe.engines.base import Generation, SamplingParams, check_prompt, named_tensors


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
    assert check_prompt(torch.tensor([1, 2]), 10) == [1, 2]
    with pytest.raises(ValueError, match="empty"):
        check_prompt([], 10)
    with pytest.raises(ValueError, match="vocabulary"):
        check_prompt([1, 10], 10)


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
        ):
            assert hasattr(cls, name), (cls, name)
    assert Engine is not None
