"""What an engine may do beyond plain sampling: ``top_logprobs``, ``structured_outputs``
and ``on_tokens`` (ids as they are produced), on the real vLLM and
transformers engines; an engine that cannot do one says so, naming the field."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollpipe.engines.records import EngineError, Generation, SamplingParams
from rollpipe.engines.scripted import ScriptedEngine

PROMPT = [5, 17, 9, 33, 2]
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


def streamed(engine: Any, params: SamplingParams) -> tuple[Generation, list[list[int]]]:
    pieces: list[list[int]] = []

    async def ask() -> Generation:
        return await engine.generate(PROMPT, params, on_tokens=pieces.append)  # type: ignore[no-any-return]

    return asyncio.run(ask()), pieces


@pytest.mark.parametrize("kind", ["vllm_engine", "hf_engine"])
def test_greedy_top_logprobs_start_with_the_sampled_token(
    kind: str, request: pytest.FixtureRequest
) -> None:
    engine = request.getfixturevalue(kind)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, top_logprobs=5)
    (gen,) = engine.generate_batch([PROMPT], params)
    assert len(gen.top_logprobs) == len(gen.token_ids) == 8
    for token, logprob, top in zip(gen.token_ids, gen.logprobs, gen.top_logprobs, strict=True):
        values = [lp for _, lp in top]
        assert len(top) == 5 and values == sorted(values, reverse=True)
        assert len({t for t, _ in top}) == 5
        assert top[0][0] == token and top[0][1] == pytest.approx(logprob, abs=1e-4)  # greedy


def test_vllm_structured_outputs_give_json_matching_the_schema(
    vllm_engine: Any, tokenizer: Any
) -> None:
    shaped = {"json": SCHEMA}
    params = [SamplingParams(max_tokens=120, structured_outputs=shaped, seed=s) for s in range(4)]
    for p in params:
        (gen,) = vllm_engine.generate_batch([PROMPT], p)
        if gen.finish_reason == "stop":  # a sampled value may run past max_tokens
            value = json.loads(tokenizer.decode(list(gen.token_ids), skip_special_tokens=True))
            assert set(value) == {"a", "b"} and all(isinstance(v, int) for v in value.values())


def test_vllm_hands_ids_to_on_tokens_step_by_step(vllm_engine: Any) -> None:
    gen, pieces = streamed(vllm_engine, SamplingParams(max_tokens=20, ignore_eos=True, seed=3))
    assert [t for p in pieces for t in p] == list(gen.token_ids) and len(pieces) > 1


@pytest.mark.parametrize("kind", ["hf_engine", "scripted"])
def test_an_engine_that_answers_at_once_calls_on_tokens_once(
    kind: str, request: pytest.FixtureRequest
) -> None:
    if kind == "scripted":
        engine = ScriptedEngine(lambda prompt, params: [1, 2, 3])
    else:
        engine = request.getfixturevalue(kind)
    try:
        gen, pieces = streamed(engine, SamplingParams(max_tokens=6, ignore_eos=True, seed=1))
    finally:
        if kind == "scripted":
            engine.close()
    assert pieces == [list(gen.token_ids)] and not engine.supports("on_tokens")


@pytest.mark.parametrize(
    ("kind", "field", "params"),
    [
        ("hf_engine", "structured_outputs", SamplingParams(structured_outputs={"json": SCHEMA})),
        ("scripted", "structured_outputs", SamplingParams(structured_outputs={"regex": "a+"})),
        ("scripted", "top_logprobs", SamplingParams(top_logprobs=2)),
    ],
)
def test_an_engine_that_cannot_says_so_naming_the_field(
    kind: str, field: str, params: SamplingParams, request: pytest.FixtureRequest
) -> None:
    if kind == "scripted":
        engine = ScriptedEngine(lambda prompt, params: [1])
    else:
        engine = request.getfixturevalue(kind)
    try:
        assert not engine.supports(field)
        with pytest.raises(EngineError, match=f"SamplingParams.{field}=.*does not support"):
            engine.generate_batch([PROMPT], params)
    finally:
        if kind == "scripted":
            engine.close()


@given(st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=4))
def test_structured_outputs_are_kept_as_their_json_text(schema: dict[str, Any]) -> None:
    params = SamplingParams(structured_outputs={"json": schema})
    assert json.loads(params.structured_outputs or "") == {"json": schema}
    text = json.dumps({"json": schema}, sort_keys=True)
    assert params == SamplingParams(structured_outputs=text)
    assert hash(params) == hash(SamplingParams(structured_outputs={"json": schema}))


@pytest.mark.parametrize(
    ("kw", "shown"),
    [
        ({"structured_outputs": "[1, 2]"}, "'[1, 2]'"),
        ({"structured_outputs": "{nope"}, "{nope"),
        ({"structured_outputs": 7}, "7"),
        ({"structured_outputs": {}}, "'{}'"),
        ({"structured_outputs": {"schema": {}}}, "schema"),
        ({"top_logprobs": 21}, "21"),
        ({"top_logprobs": -1}, "-1"),
        ({"top_logprobs": True}, "True"),
    ],
)
def test_bad_values_fail_naming_the_field(kw: dict[str, Any], shown: str) -> None:
    (field,) = kw
    with pytest.raises(ValueError, match=f"SamplingParams.{field}") as caught:
        SamplingParams(**kw)
    assert shown in str(caught.value)


@given(st.lists(st.integers(0, 5), max_size=4), st.sampled_from(["stop", "length", "abort"]))
def test_joined_generations_keep_every_token_in_order(sizes: list[int], reason: str) -> None:
    parts = [
        Generation(range(n), [-0.5] * n, "abort", [i] * n, top_logprobs=[((0, -0.1),)] * n)
        for i, n in enumerate(sizes)
    ]
    joined = Generation.joined(parts, reason)
    assert joined.token_ids == tuple(t for n in sizes for t in range(n))
    assert joined.versions == tuple(i for i, n in enumerate(sizes) for _ in range(n))
    assert len(joined.logprobs) == len(joined.top_logprobs) == sum(sizes)
    assert joined.finish_reason == reason


def test_top_logprobs_of_the_wrong_length_are_refused() -> None:
    with pytest.raises(ValueError, match=r"Generation\.top_logprobs must be empty or have one"):
        Generation([1, 2], [0.0, 0.0], "stop", [0, 0], top_logprobs=[((1, 0.0),)])
