"""A forced tool call's arguments are a JSON object that matches the tool's ``parameters``
schema, as OpenAI's are, whether the tool says ``strict`` or not: for random object
schemas, on the real vLLM engine, through the front door and the real ``openai`` client,
with the hermes parser (vLLM's structural tag) and without one (vLLM's JSON schema). The
tokens sampled under that grammar are marked ``Turn.constrained``, and
``constrained_mask`` marks exactly them in the rows, the collated batch and its verl and
ROLL layouts. vLLM's logprobs for them are those of the grammar-masked, renormalised
distribution (measured here against the policy's own, from transformers)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import attrs
import jsonschema
import openai
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_support import recording
from torchdata.nodes import IterableWrapper

from rollpipe.agent.episode import EpisodeSettings
from rollpipe.agent.records import EpisodeSpec, Trajectory, Turn
from rollpipe.data.roll_layout import to_roll
from rollpipe.data.verl_layout import verl_parts
from rollpipe.frontdoor import AgentEnv
from rollpipe.nodes.collate import Collate

SETTINGS = EpisodeSettings(tool_parser="hermes", max_length=2048, sampling={"max_tokens": 64})
NAMES = st.sampled_from(["a", "b", "city", "n", "x_1", "deep"])
LEAVES = st.one_of(
    # a pattern bounds a string: xgrammar 0.2.8 lets raw control characters into strings
    # bounded by maxLength, which JSON parsers (vLLM's hermes parser) reject
    st.builds(lambda n: {"type": "string", "pattern": f"^[a-z ]{{0,{n}}}$"}, st.integers(0, 6)),
    st.just({"type": "integer"}),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.lists(
        st.text("pqr", min_size=1, max_size=3) | st.integers(-5, 5),
        min_size=1,
        max_size=3,
        unique=True,
    ).map(lambda values: {"enum": values}),
)


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": sorted(properties)}


VALUES = st.recursive(
    LEAVES,
    lambda inner: (
        st.dictionaries(NAMES, inner, min_size=1, max_size=2).map(_object)
        | st.builds(
            lambda items, n: {"type": "array", "items": items, "maxItems": n},
            inner,
            st.integers(0, 2),
        )
    ),
    max_leaves=4,
)
SCHEMAS = st.dictionaries(NAMES, VALUES, min_size=0, max_size=3).map(_object)
"""Object schemas of the subset xgrammar holds: every property required; strings,
integers, numbers, booleans, enums, nested objects and arrays (bounded, so that a
random model's answer ends within ``max_tokens``)."""


@pytest.fixture(scope="module")
def engine(tools_vllm_engine: Any) -> Iterator[Any]:
    """The shared tools-model engine, each request's params and answer recorded."""
    with recording(tools_vllm_engine, lambda ids, params, gen: (list(ids), params, gen)) as e:
        yield e


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from rollpipe.training.tiny_model import default_model_path

    return AutoTokenizer.from_pretrained(str(default_model_path(tools=True)))


def collate(trajectories: list[Trajectory], level: str = "trajectory") -> Any:
    """The trajectories through the Collate node, as the pipeline collates a group."""
    node = Collate(IterableWrapper([]), pad_token_id=0, level=level)  # type: ignore[arg-type]
    return node.collate(trajectories)


def run(engine: Any, tokenizer: Any, agent: Any, parser: str | None) -> Trajectory:
    settings = attrs.evolve(SETTINGS, tool_parser=parser)
    env = AgentEnv(agent, task=lambda seed: "Call the tool.")
    engine.seen.clear()
    try:
        spec = EpisodeSpec(0, 3, 5, "agent")
        coro = env.run_episode(spec, engine, settings.chat_format(tokenizer), settings)
        return engine.runtime.call(coro)  # type: ignore[no-any-return]
    finally:
        env.close()


def tool(name: str, schema: dict[str, Any], strict: bool | None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "description": "a tool", "parameters": schema}
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


@pytest.mark.parametrize("parser", ["hermes", None])
@settings(max_examples=12, deadline=None)  # each example generates on vLLM
@given(
    schemas=st.lists(SCHEMAS, min_size=1, max_size=2),
    strict=st.sampled_from([None, False]),  # never "strict": true, the door holds them anyway
    named=st.booleans(),
)
def test_forced_arguments_are_an_object_of_the_tools_schema(
    engine: Any,
    tokenizer: Any,
    parser: str | None,
    schemas: list[dict[str, Any]],
    strict: bool | None,
    named: bool,
) -> None:
    tools = [tool(f"tool{i}", s, strict) for i, s in enumerate(schemas)]
    choice: Any = {"type": "function", "function": {"name": "tool0"}} if named else "required"
    replies: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, task: str) -> float:
        reply = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": task}],
            tools=tools,  # type: ignore[arg-type]
            tool_choice=choice,
            parallel_tool_calls=False,  # a random model would call on until max_tokens
            max_tokens=700,
        )
        replies.append(reply)
        return 1.0

    traj = run(engine, tokenizer, agent, parser)
    ((_, params, gen),), (reply,) = engine.seen, replies
    assert traj.error is None and gen.finish_reason == "stop", (gen.finish_reason, schemas)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "tool0" if named else call.function.name in ("tool0", "tool1")
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments, dict)
    jsonschema.validate(arguments, schemas[int(call.function.name.removeprefix("tool"))])
    # the answer was sampled under the grammar: the turn says so, and so do its rows
    (turn,) = traj.turns
    assert params.structured_outputs is not None and turn.constrained and turn.action_valid
    rows = collate([traj])
    assert torch.equal(rows.batch["constrained_mask"], rows.batch["response_mask"])


def test_the_mask_marks_exactly_the_forced_turns_tokens(engine: Any, tokenizer: Any) -> None:
    """A forced call, its result, then a free answer: only the first answer's tokens are
    marked, in native rows (per trajectory and per step), verl's and ROLL's layouts."""
    tools = [tool("add", _object({"a": {"type": "integer"}, "b": {"type": "integer"}}), None)]

    async def agent(client: openai.AsyncOpenAI, task: str) -> float:
        messages: list[Any] = [{"role": "user", "content": task}]
        reply = await client.chat.completions.create(
            model="m", messages=messages, tools=tools, tool_choice="required", max_tokens=300
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for c in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": c.id, "content": "3"})
        await client.chat.completions.create(
            model="m", messages=messages, tools=tools, max_tokens=16
        )
        return 1.0

    traj = run(engine, tokenizer, agent, "hermes")
    assert traj.error is None and len(traj.turns) == 2 and traj.prefix_breaks == 0
    assert [t.constrained for t in traj.turns] == [True, False]
    assert [p.structured_outputs is not None for _, p, _ in engine.seen] == [True, False]
    first, second = traj.turns
    p0, r0, p1, r1 = (
        len(x)
        for x in (first.prompt_ids, first.response_ids, *(second.prompt_ids, second.response_ids))
    )
    # a second, shorter trajectory (one free turn) pads the first row's batch
    short = attrs.evolve(
        traj,
        turns=(attrs.evolve(second, new_row=True),),
        spec=attrs.evolve(traj.spec, episode_id=4),
    )
    rows = collate([traj, short])
    mask, response = rows.batch["constrained_mask"], rows.batch["response_mask"]
    assert mask.dtype == torch.bool and mask.shape == response.shape
    expected = torch.zeros_like(mask)
    expected[0, p0 : p0 + r0] = True
    assert torch.equal(mask, expected) and not (mask & ~response).any()
    assert rows.batch["input_ids"][0, p0 : p0 + r0].tolist() == list(first.response_ids)
    assert p0 + r0 + p1 + r1 == int(rows.batch["attention_mask"][0].sum())
    # per step: the first turn's row is marked on its response, the second's not at all
    steps = collate([traj], "step")
    assert steps.batch["constrained_mask"].sum(1).tolist() == [r0, 0]
    assert torch.equal(steps.batch["constrained_mask"][0], steps.batch["response_mask"][0])
    # verl: int64 like its response_mask, response-side, inside it
    tensors, _, _ = verl_parts(rows)
    verl_mask = tensors["constrained_mask"]
    assert verl_mask.dtype == torch.int64 and verl_mask.shape == tensors["response_mask"].shape
    assert int(verl_mask.sum()) == r0 and not (verl_mask & (1 - tensors["response_mask"])).any()
    assert tensors["responses"][0][verl_mask[0].bool()].tolist() == list(first.response_ids)
    # ROLL: kept with its extras, aligned as input_ids are
    roll = to_roll(rows, extras=True)
    assert torch.equal(roll.batch["constrained_mask"], mask)


def test_vllm_logprobs_under_a_grammar_are_the_masked_distributions(
    engine: Any, tokenizer: Any
) -> None:
    """Measured: under a forced call's grammar vLLM returns the logprob of the sampled
    token in the grammar-masked, renormalised distribution (raw logits, bitmask applied
    before its log-softmax), never below the policy's; free tokens get the policy's."""
    from transformers import AutoModelForCausalLM

    from rollpipe.training.tiny_model import default_model_path

    schema = _object({"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 4}})
    tools = [tool("f", schema, None)]

    async def agent(client: openai.AsyncOpenAI, task: str) -> float:
        messages: list[Any] = [{"role": "user", "content": task}]
        await client.chat.completions.create(
            model="m", messages=messages, tools=tools, tool_choice="required", max_tokens=300
        )
        await client.chat.completions.create(model="m", messages=messages, max_tokens=24)
        return 1.0

    run(engine, tokenizer, agent, "hermes")
    path = default_model_path(tools=True)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    gaps = []
    for prompt, _, gen in engine.seen:
        ids = torch.tensor([[*prompt, *gen.token_ids]])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1]
        policy = torch.log_softmax(logits.double(), -1)[
            torch.arange(len(gen.token_ids)), ids[0, len(prompt) :]
        ]
        gaps.append(torch.tensor(gen.logprobs, dtype=torch.float64) - policy)
    forced, free = gaps
    assert (forced > -1e-4).all() and forced.mean() > 0.1  # renormalised over fewer tokens
    assert (torch.tensor(engine.seen[0][2].logprobs) == 0.0).any()  # the only allowed token
    assert free.abs().max() < 1e-4


TURNS = st.lists(
    st.tuples(st.integers(1, 4), st.integers(0, 4), st.booleans()), min_size=1, max_size=4
)


def _trajectory(episode: int, turns: list[tuple[int, int, bool]]) -> Trajectory:
    """A trajectory of made-up ids: (prompt length, response length, constrained) a turn."""
    made = [
        Turn(
            prompt_ids=[7] * p,
            response_ids=[9] * r,
            logprobs=[-1.0] * r,
            versions=[0] * r,
            reward=0.0,
            finish_reason="stop",
            action_valid=None,
            action_text="",
            observation="o",
            constrained=c,
        )
        for p, r, c in turns
    ]
    return Trajectory(EpisodeSpec(0, episode, 0), 0, made, 0.0, False, "terminated")


@settings(max_examples=60, deadline=None)
@given(st.lists(TURNS, min_size=1, max_size=4), st.sampled_from(["trajectory", "step"]))
def test_the_mask_is_the_constrained_turns_responses_in_any_rows(
    episodes: list[list[tuple[int, int, bool]]], level: str
) -> None:
    """For any turns, ``constrained_mask`` is 1 exactly on the response tokens of the
    turns recorded ``constrained`` (trajectory or step rows), and a turn's flag survives
    its checkpoint state."""
    trajectories = [_trajectory(i, turns) for i, turns in enumerate(episodes)]
    rows = collate(trajectories, level)
    expected = []
    for turns in episodes:
        if level == "trajectory":
            expected.append([x for p, r, c in turns for x in [False] * p + [c] * r])
        else:
            context = 0
            for p, r, c in turns:
                expected.append([False] * (context + p) + [c] * r)
                context += p + r
    width = rows.batch["input_ids"].shape[1]
    padded = [e + [False] * (width - len(e)) for e in expected]
    assert rows.batch["constrained_mask"].tolist() == padded
    for t in trajectories:  # Turn equality compares constrained too
        assert Trajectory.from_state(t.to_state()) == t
