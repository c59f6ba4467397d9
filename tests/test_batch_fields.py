"""docs/dataproto.md's "Every field" table against real pipeline batches (real vLLM engine:
FrozenLake trajectory and step rows, a prompt dataset, an ``openai``-client agent with
tools): the table lists exactly each batch's keys, in the right part, with the right
dtype and rank; ``show_row`` marks exactly the tokens where ``response_mask`` is 1."""

from __future__ import annotations

import itertools
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from tool_support import add, tools_model_path

from rollpipe.agent.episode import EpisodeSettings
from rollpipe.agent.tools import tool_set
from rollpipe.data.proto import DataProto
from rollpipe.data.readable import show_row
from rollpipe.envs import register
from rollpipe.frontdoor import AgentEnv
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

DOC = Path(__file__).parents[1] / "docs" / "dataproto.md"
TOOLS = [dict(s) for s in tool_set([add]).schemas]
SMALL = {"group_size": 2, "batch_size": 2, "num_groups": 1, "max_length": 512, "seed": 2}


def table() -> list[dict[str, str]]:
    """The rows of the fields table: field, part, dtype, shape, when, meaning."""
    text = DOC.read_text()
    match = re.search(r"<!-- fields-table -->\n(.*?)<!-- /fields-table -->", text, re.S)
    assert match, "docs/dataproto.md lost its <!-- fields-table --> block"
    lines = [ln for ln in match.group(1).splitlines() if ln.startswith("| `")]
    names = ("field", "part", "dtype", "shape", "when", "meaning")
    rows = [
        dict(zip(names, (c.strip() for c in ln.strip("|").split("|")), strict=True)) for ln in lines
    ]
    for row in rows:
        row["field"] = row["field"].strip("`")
    return rows


async def agent(client: openai.AsyncOpenAI, task: str) -> float:
    """Works with a tool, then answers without tools (the usual agent)."""
    messages: list[Any] = [{"role": "user", "content": task}]
    reply = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    messages.append(reply.choices[0].message)
    for c in reply.choices[0].message.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": c.id, "name": "add", "content": "5"})
    messages.append({"role": "user", "content": "So?"})
    answer = await client.chat.completions.create(model="m", messages=messages)
    return float(len(answer.choices[0].message.content or "") % 2)


register("fields-agent", lambda: AgentEnv(agent, task=lambda s: f"{s % 9} + 5?"), overwrite=True)


def batch_of(engine: Any, path: Any, data: Any = None, **config: Any) -> DataProto:
    with RolloutPipeline(PipelineConfig(**(SMALL | config)), engine, path) as pipe:
        batch = pipe.get_batch(data)
    assert batch is not None
    return batch


@pytest.fixture(scope="module")
def batches(vllm_engine: Any, tools_vllm_engine: Any, tiny_model_path: Path) -> Iterator[Any]:
    """(batch, the table's "When" values that hold for it, tokenizer path) per kind."""
    lake = {"envs": "frozenlake", "max_turns": 2, "sampling": {"max_tokens": 8}}
    step = {"level": "step", "history_window": 2}
    rows = [{"prompt": f"{i} + 1?", "answer": str(i + 1)} for i in range(4)]
    task = {"envs": "task", "dataset": {"rows": rows}, "sampling": {"max_tokens": 8}}
    episode = EpisodeSettings(tool_parser="hermes", max_length=1024, sampling={"max_tokens": 12})
    step_info = DataProto(meta_info={"global_step": 7})
    yield {
        "trajectory": (
            batch_of(vllm_engine, tiny_model_path, step_info, **lake),
            {"always", "get_batch(data)"},
            tiny_model_path,
        ),
        "step": (
            batch_of(vllm_engine, tiny_model_path, **lake, **step),
            {"always", "step rows"},
            tiny_model_path,
        ),
        "dataset": (
            batch_of(vllm_engine, tiny_model_path, **task),
            {"always", "dataset"},
            tiny_model_path,
        ),
        "agent": (
            batch_of(tools_vllm_engine, tools_model_path(), envs="fields-agent", episode=episode),
            {"always"},
            tools_model_path(),
        ),
    }


KINDS = ["trajectory", "step", "dataset", "agent"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_table_lists_exactly_the_batch_keys(batches: Any, kind: str) -> None:
    batch, when, _ = batches[kind]
    listed = [row for row in table() if row["when"] in when]
    by_part = {
        part: sorted(r["field"] for r in listed if r["part"] == part)
        for part in ("batch", "non_tensor_batch", "meta_info")
    }
    assert by_part["batch"] == sorted(batch.batch.keys())
    assert by_part["non_tensor_batch"] == sorted(batch.non_tensor_batch)
    assert by_part["meta_info"] == sorted(batch.meta_info)


@pytest.mark.parametrize("kind", KINDS)
def test_the_table_gives_each_field_its_dtype(batches: Any, kind: str) -> None:
    batch, when, _ = batches[kind]
    for row in (r for r in table() if r["when"] in when):
        key, part, dtype = row["field"], row["part"], row["dtype"]
        if part == "batch":
            value = batch.batch[key]
            assert str(value.dtype) == f"torch.{dtype}", key
            assert value.dim() == row["shape"].count(",") + 1, key
        elif part == "non_tensor_batch":
            column = batch.non_tensor_batch[key]
            assert column.dtype == object and column.ndim == 1, key
            kinds = dtype.removeprefix("object:").replace(" ", "").split(",")
            assert {type(v).__name__ for v in column} <= set(kinds), (key, kinds)
        else:
            assert type(batch.meta_info[key]).__name__ == dtype, key
    assert batch.meta_info.get("global_step") in (None, 7)


def test_every_table_row_is_in_some_batch(batches: Any) -> None:
    """No row documents a field no batch has (the forced-call mask: a field like any)."""
    seen = {k for b, _, _ in batches.values() for k in [*b.keys(), *b.meta_info]}
    assert {r["field"] for r in table()} == seen


@pytest.mark.parametrize("kind", ["agent", "trajectory"])
def test_show_row_marks_exactly_the_generated_tokens(batches: Any, kind: str) -> None:
    from transformers import AutoTokenizer

    batch, _, path = batches[kind]
    tok = AutoTokenizer.from_pretrained(str(path))
    open_mark, close_mark = "\x00GEN<", ">GEN\x00"
    for i in range(len(batch)):
        real = batch.batch["attention_mask"][i].bool()
        ids = batch.batch["input_ids"][i][real].tolist()
        generated = batch.batch["response_mask"][i][real].tolist()
        runs = [
            (flag, [t for t, _ in run])
            for flag, run in itertools.groupby(zip(ids, generated, strict=True), lambda p: p[1])
        ]
        expected = "".join(
            f"{open_mark}{tok.decode(r)}{close_mark}" if flag else tok.decode(r) for flag, r in runs
        )
        shown = show_row(batch, i, tok, open_mark, close_mark)
        header, _, body = shown.partition("\n")
        assert body == expected
        assert body.count(open_mark) == sum(flag for flag, _ in runs) >= 1
        assert header.startswith(f"row {i}: ") and batch.non_tensor_batch["traj_uid"][i] in header
    with pytest.raises(IndexError, match=f"row {len(batch)} is out of range"):
        show_row(batch, len(batch), tok)


def test_a_key_asked_of_the_wrong_part_says_where_it_is(batches: Any) -> None:
    batch = batches["dataset"][0]
    with pytest.raises(
        KeyError, match=r"'row_index' is in batch\.non_tensor_batch .*not batch\.batch"
    ):
        batch.select(batch_keys=["row_index"])
    with pytest.raises(
        KeyError, match=r"'input_ids' is in batch\.batch .*not batch\.non_tensor_batch"
    ):
        batch.non_tensor_batch["input_ids"]
    with pytest.raises(KeyError, match=r"'metrics' is in batch\.meta_info .*not a column"):
        batch["metrics"]
    with pytest.warns(DeprecationWarning, match="'end_reason' is now named 'end_reasons'"):
        old = batch.non_tensor_batch.get("end_reason")
    assert old is batch.non_tensor_batch["end_reasons"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        index = list(batch["row_index"])
    assert len(set(index)) == 1 and index[0] in range(4)  # one group: one dataset row
