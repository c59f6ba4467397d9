"""Tool episodes with scripted model text on the tiny tools model's real tokenizer and
template, real vLLM parsers, the real ToolEnv and run_episode; then the same flow on the
real vLLM engine."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_support import RELEASE, ScriptedEngine, add, call, divide, hang, tools_model_path

from rollpipe.agent.chat import DEFAULT_SYSTEM_PROMPT
from rollpipe.agent.episode import EpisodeSettings, run_episode
from rollpipe.agent.records import EpisodeSpec, Trajectory
from rollpipe.data.rows import step_rows, trajectory_rows
from rollpipe.envs.calculator import calculator_env, last_number_matches
from rollpipe.envs.tool_env import DEFAULT_TOOL_PROMPT, ToolEnv

EOT = "<|im_end|>"
SETTINGS = EpisodeSettings(
    max_turns=4, tool_parser="hermes", max_length=4096, sampling={"max_tokens": 200}
)


@pytest.fixture(scope="module")
def tool_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tools_model_path()))


def env(**kw: Any) -> ToolEnv:
    return ToolEnv(
        lambda seed: ("What is 2 + 3?", 5), [add, divide, hang], last_number_matches, **kw
    )


def run(
    tokenizer: Any, texts: list[str], settings: EpisodeSettings = SETTINGS, **kw: Any
) -> tuple[Trajectory, ScriptedEngine]:
    engine = ScriptedEngine(tokenizer, texts)
    tool_env = env(**kw)
    try:
        traj = asyncio.run(
            run_episode(
                EpisodeSpec(0, 0, 0, "tools"),
                tool_env,
                engine,
                settings.chat_format(tokenizer),
                settings,
            )
        )
    finally:
        tool_env.close()
    assert traj.error is None, traj.error
    return traj, engine


def tool_results(traj: Trajectory) -> list[str]:
    return [t.observation for t in traj.turns[1:]]


def assert_exact(traj: Trajectory, engine: ScriptedEngine) -> None:
    """Each prompt the engine got is every earlier turn's ids plus this turn's."""
    context: list[int] = []
    for turn, prompt, response in zip(traj.turns, engine.prompts, engine.responses, strict=False):
        context = [*context, *turn.prompt_ids]
        assert context == prompt
        assert list(turn.response_ids) == response
        context = [*context, *turn.response_ids]


def test_one_call_then_an_answer(tool_tokenizer: Any) -> None:
    traj, engine = run(tool_tokenizer, [call("add", a=2, b=3) + EOT, "It is 5." + EOT])
    assert tool_results(traj) == ["[tool add] 5"]
    assert traj.score == 1.0 and traj.success and traj.end_reason == "terminated"
    assert traj.env_metrics["tool/calls"] == 1 and traj.env_metrics["tool/calls/add"] == 1
    assert traj.env_metrics["tool/malformed"] == 0
    assert_exact(traj, engine)
    rows = trajectory_rows([traj], pad_token_id=0)
    mask = rows.batch["response_mask"][0]
    ids = rows.batch["input_ids"][0]
    # the tool result's tokens are prompt tokens (0 in response_mask), the calls are 1
    result_ids = traj.turns[1].prompt_ids
    start = len(traj.turns[0].prompt_ids) + len(traj.turns[0].response_ids)
    assert ids[start : start + len(result_ids)].tolist() == list(result_ids)
    assert not mask[start : start + len(result_ids)].any()
    assert mask.sum() == sum(len(t.response_ids) for t in traj.turns)
    assert step_rows([traj], pad_token_id=0).batch["input_ids"].shape[0] == 2


def test_several_calls_in_one_turn(tool_tokenizer: Any) -> None:
    two = call("add", a=2, b=3) + "\n" + call("divide", a=1, b=4)
    traj, engine = run(tool_tokenizer, [two + EOT, "5" + EOT])
    assert tool_results(traj) == ["[tool add] 5\n[tool divide] 0.25"]
    assert traj.env_metrics["tool/calls"] == 2
    assert traj.env_metrics["tool/calls/divide"] == 1
    assert "<tool_response>\n5\n</tool_response>\n<tool_response>\n0.25" in tool_tokenizer.decode(
        traj.turns[1].prompt_ids
    )
    assert_exact(traj, engine)


@pytest.mark.parametrize(
    ("text", "kind", "says"),
    [
        (
            '<tool_call>\n{"name": "add", "arguments": {"a": 2,\n</tool_call>',
            "malformed",
            "could not be read: JSONDecodeError",
        ),
        (
            call("pow", a=2, b=3),
            "malformed",
            "unknown tool 'pow'; the tools are: add, divide, hang",
        ),
        (call("add", a=2), "malformed", "missing required argument(s) ['b']"),
        (
            call("add", a="2", b=3),
            "malformed",
            "argument 'a' must be of JSON type integer, got str '2'",
        ),
        (call("add", a=2, b=3, c=4), "malformed", "unknown argument(s) ['c']"),
        (call("divide", a=1, b=0), "errors", "divide raised ZeroDivisionError: division by zero"),
    ],
    ids=["bad-json", "unknown-tool", "missing-arg", "wrong-type", "extra-arg", "raises"],
)
def test_a_bad_call_is_a_turn_with_a_tool_message(
    tool_tokenizer: Any, text: str, kind: str, says: str
) -> None:
    traj, engine = run(tool_tokenizer, [text + EOT, "5" + EOT])
    assert says in tool_results(traj)[0]
    assert traj.env_metrics[f"tool/{kind}"] == 1 and traj.env_metrics["tool/calls"] == 1
    assert traj.turns[0].action_valid is (kind != "malformed")
    assert traj.success  # the episode went on, and the answer after it counted
    assert_exact(traj, engine)


def test_a_tool_that_times_out_is_a_turn(tool_tokenizer: Any) -> None:
    try:
        traj, _ = run(
            tool_tokenizer, [call("hang", seconds=1) + EOT, "5" + EOT], tool_timeout_s=0.2
        )
    finally:
        RELEASE.set()  # the abandoned worker returns and ends
    assert "hang returned no result within 0.2 s" in tool_results(traj)[0]
    assert traj.env_metrics["tool/timeouts"] == 1 and traj.env_metrics["tool/timeouts/hang"] == 1
    assert traj.success


def test_markers_that_are_special_tokens_reach_the_parser(tool_tokenizer: Any) -> None:
    text = call("add", a=2, b=3) + EOT
    ids = tool_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tool_tokenizer.convert_tokens_to_ids("<tool_call>") in ids
    assert "<tool_call>" not in tool_tokenizer.decode(ids, skip_special_tokens=True)
    traj, _ = run(tool_tokenizer, [text, "5" + EOT])
    assert traj.turns[0].action_text == text[: -len(EOT)]  # kept, end of turn left out
    assert traj.env_metrics["tool/calls/add"] == 1


def test_a_reasoning_block_is_split_off(tool_tokenizer: Any) -> None:
    settings = attrs.evolve(SETTINGS, reasoning_parser="qwen3")
    seen: list[Any] = []

    class Recording(ToolEnv):
        async def step(self, action: Any) -> Any:
            seen.append(action)
            return await super().step(action)

    engine = ScriptedEngine(
        tool_tokenizer,
        ["<think>2+3, use add</think>" + call("add", a=2, b=3) + EOT, "<think>done</think>5" + EOT],
    )
    tool_env = Recording(lambda seed: ("What is 2 + 3?", 5), [add], last_number_matches)
    traj = asyncio.run(
        run_episode(
            EpisodeSpec(0, 0, 0), tool_env, engine, settings.chat_format(tool_tokenizer), settings
        )
    )
    tool_env.close()
    assert seen[0].reasoning == "2+3, use add" and seen[0].tool_calls[0].kwargs == {"a": 2, "b": 3}
    assert seen[1].reasoning == "done" and seen[1].content == "5"
    assert traj.success and not any(t.prefix_break for t in traj.turns)


def test_text_envs_ignore_the_parsers(tool_tokenizer: Any) -> None:
    """A plain text env with parsers set gets the text decoded as always."""
    from rollpipe.envs import FrozenLake

    engine = ScriptedEngine(tool_tokenizer, ["<answer>Right</answer>" + EOT] * 4)
    lake = FrozenLake(level="P__\n_H_\n__G")
    traj = asyncio.run(
        run_episode(
            EpisodeSpec(0, 0, 0), lake, engine, SETTINGS.chat_format(tool_tokenizer), SETTINGS
        )
    )
    assert traj.turns[0].action_text == "<answer>Right</answer>"
    assert not any(t.prefix_break for t in traj.turns)


def test_tool_episodes_on_the_real_vllm_engine() -> None:
    """The calculator env on vLLM with the tools template: the engine's ids are the rows."""
    from transformers import AutoTokenizer

    from rollpipe.engines.vllm import VLLMEngine

    path = tools_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    settings = EpisodeSettings(max_turns=3, tool_parser="hermes", sampling={"max_tokens": 24})
    chat = settings.chat_format(tokenizer)
    with VLLMEngine(path, kv_cache_space_gib=1, max_model_len=2048, seed=0) as engine:

        async def episodes() -> list[Trajectory]:
            envs = [calculator_env() for _ in range(4)]
            try:
                return await asyncio.gather(
                    *(
                        run_episode(EpisodeSpec(0, i, i, "calculator"), e, engine, chat, settings)
                        for i, e in enumerate(envs)
                    )
                )
            finally:
                for e in envs:
                    e.close()

        trajs = asyncio.run(episodes())
    for traj in trajs:
        assert traj.error is None and traj.turns
        first = traj.turns[0]
        assert (
            tokenizer.decode(first.prompt_ids).count('"name": "calculate"') == 1
        )  # tools rendered
        rows = trajectory_rows([traj], pad_token_id=0)
        n = sum(len(t.prompt_ids) + len(t.response_ids) for t in traj.turns)
        assert rows.batch["attention_mask"].sum() == n


def test_tool_episodes_in_roll_and_verl_layouts(tool_tokenizer: Any) -> None:
    """ROLL's and verl's layouts of a tool episode keep the tool result out of the
    response mask: only the model's tokens are 1, in both, for trajectory and step rows."""
    from rollpipe.data.roll_layout import to_roll
    from rollpipe.data.verl_layout import verl_parts

    traj, _ = run(tool_tokenizer, [call("add", a=2, b=3) + EOT, "It is 5." + EOT])
    generated = sum(len(t.response_ids) for t in traj.turns)
    native = trajectory_rows([traj], pad_token_id=0)
    roll = to_roll(native)
    assert int(roll.batch["response_mask"].sum()) == generated
    assert roll.batch["input_ids"][0][roll.batch["attention_mask"][0].bool()].tolist() == [
        i for t in traj.turns for i in (*t.prompt_ids, *t.response_ids)
    ]
    tensors, _, _ = verl_parts(native)
    assert int(tensors["response_mask"].sum()) == generated
    result = list(traj.turns[1].prompt_ids)  # the tool message: in responses, mask 0
    responses, mask = tensors["responses"][0].tolist(), tensors["response_mask"][0].tolist()
    start = next(k for k in range(len(responses)) if responses[k : k + len(result)] == result)
    assert not any(mask[start : start + len(result)])
    steps = step_rows([traj], pad_token_id=0)
    assert int(to_roll(steps).batch["response_mask"].sum()) == generated
    assert int(verl_parts(steps)[0]["response_mask"].sum()) == generated


@pytest.mark.parametrize(
    ("system_prompt", "expected"),
    [
        (DEFAULT_TOOL_PROMPT, DEFAULT_TOOL_PROMPT),
        ("Answer with the tools.", "Answer with the tools."),
        (None, None),
    ],
)
def test_tool_env_episodes_get_its_own_system_prompt(
    tool_tokenizer: Any, system_prompt: str | None, expected: str | None
) -> None:
    """Not the pipeline's text-game prompt: ToolEnv's (overridable; None: none), ahead of
    the template's tools block."""
    kw = {} if system_prompt == DEFAULT_TOOL_PROMPT else {"system_prompt": system_prompt}
    traj, engine = run(tool_tokenizer, ["5" + EOT], **kw)
    first = tool_tokenizer.decode(engine.prompts[0])
    assert DEFAULT_SYSTEM_PROMPT not in first
    assert first.startswith("<|im_start|>system\n")
    if expected is None:
        assert first.startswith("<|im_start|>system\n# Tools\n")
    else:
        assert first.startswith(f"<|im_start|>system\n{expected}\n\n# Tools\n")
    assert traj.score == 1.0


@pytest.mark.parametrize("bad", [3, ["a prompt"], b"bytes"])
def test_tool_env_rejects_a_system_prompt_that_is_not_text(bad: Any) -> None:
    with pytest.raises(
        ValueError, match=r"ToolEnv.system_prompt must be a str or None.*" + re.escape(repr(bad))
    ):
        env(system_prompt=bad)


def test_calculator_env_passes_its_system_prompt_on() -> None:
    default, custom = calculator_env(), calculator_env(system_prompt="Use calculate.")
    try:
        assert (default.system_prompt, custom.system_prompt) == (
            DEFAULT_TOOL_PROMPT,
            "Use calculate.",
        )
    finally:
        default.close()
        custom.close()


def test_a_dataset_row_is_the_task() -> None:
    """With a dataset the row replaces ``task(seed)`` (its prompt and answer fields, as
    PromptTask's); without one, ``task=None`` says what to set."""
    from rollpipe.envs.registry import takes_row

    tool_env = env()
    rows_only = ToolEnv(None, [add], last_number_matches, prompt_key="q", answer_key="a")
    try:
        assert takes_row(tool_env)
        assert tool_env.reset(0, row={"prompt": "What is 4 + 4?", "answer": 8})[0] == (
            "What is 4 + 4?"
        )
        assert tool_env._truth == 8
        assert tool_env.reset(0, row="Just a prompt")[0] == "Just a prompt"
        assert tool_env._truth is None
        assert rows_only.reset(1, row={"q": "What is 1 + 1?", "a": 2})[0] == "What is 1 + 1?"
        with pytest.raises(ValueError, match=r"needs a 'q' field \(this row: \['prompt'\]\)"):
            rows_only.reset(1, row={"prompt": "What is 1 + 1?"})
        with pytest.raises(ValueError, match=r"task=None\) takes its tasks from dataset rows"):
            rows_only.reset(1)
    finally:
        tool_env.close()
        rows_only.close()


def test_the_episode_runs_the_tools_and_the_env_gets_their_results(tool_tokenizer: Any) -> None:
    """Tool running is the episode's: the env's step gets the action with the results its
    ``tool_runner`` gave (it never runs a call itself), and answers with their messages."""
    seen: list[Any] = []

    class Recording(ToolEnv):
        async def step(self, action: Any) -> Any:
            seen.append(action)
            return await super().step(action)

    engine = ScriptedEngine(tool_tokenizer, [call("add", a=2, b=3) + EOT, "5" + EOT])
    tool_env = Recording(lambda seed: ("What is 2 + 3?", 5), [add], last_number_matches)
    try:
        traj = asyncio.run(
            run_episode(
                EpisodeSpec(0, 0, 0),
                tool_env,
                engine,
                SETTINGS.chat_format(tool_tokenizer),
                SETTINGS,
            )
        )
    finally:
        tool_env.close()
    results = seen[0].tool_results
    assert [m["content"] for m in results.messages] == ["5"] and results.counts["tool/calls"] == 1
    assert seen[1].tool_results is None  # an answer: nothing to run
    assert traj.turns[1].observation.endswith("5") and traj.success


def test_a_tool_env_stepped_with_calls_but_no_results_says_what_to_do() -> None:
    from rollpipe.agent.actions import AssistantAction, ToolCall
    from rollpipe.envs.base import EnvStateError

    tool_env = env()
    tool_env.reset(seed=0)
    action = AssistantAction("", "", [ToolCall.from_json("c0", "add", '{"a": 1, "b": 2}')])
    with pytest.raises(EnvStateError, match=r"ToolEnv.step got 1 tool call\(s\) without their"):
        asyncio.run(tool_env.step(action))
    tool_env.close()


def big(n: int) -> str:
    """Return n characters.

    Args:
        n: how many
    """
    return "x" * n


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 300), limit=st.one_of(st.none(), st.integers(1, 200)))
def test_a_tool_result_is_cut_to_its_limit_and_the_cut_counted(n: int, limit: int | None) -> None:
    from rollpipe.agent.actions import AssistantAction, ToolCall
    from rollpipe.agent.tool_runner import ToolRunner
    from rollpipe.agent.tools import ToolSet

    runner = ToolRunner(ToolSet([big]), max_result_chars=limit)
    action = AssistantAction("", "", [ToolCall.from_json("c0", "big", f'{{"n": {n}}}')])
    try:
        results = asyncio.run(runner.run(action))
    finally:
        runner.close()
    shown, cut = results.messages[0]["content"], limit is not None and n > limit
    assert shown == (
        "x" * n if not cut else f"{'x' * limit}\n[tool result cut to {limit} of {n} characters]"
    )
    assert results.counts["tool/cut"] == float(cut) == results.counts.get("tool/cut/big", 0.0)


def test_one_huge_tool_result_costs_its_episode_only_its_cut(tool_tokenizer: Any) -> None:
    engine = ScriptedEngine(tool_tokenizer, [call("big", n=1_000_000) + EOT, "done" + EOT])
    tool_env = ToolEnv(lambda seed: ("Go.", 0), [big], last_number_matches, max_result_chars=500)
    try:
        traj = asyncio.run(
            run_episode(
                EpisodeSpec(0, 0, 0),
                tool_env,
                engine,
                SETTINGS.chat_format(tool_tokenizer),
                SETTINGS,
            )
        )
    finally:
        tool_env.close()
    assert traj.env_metrics["tool/cut"] == 1 and traj.env_metrics["tool/cut/big"] == 1
    assert traj.num_turns == 2 and traj.end_reason == "terminated"
    assert 500 < len(traj.turns[1].observation) < 600  # the cut result, not a million characters
