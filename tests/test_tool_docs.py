"""docs/tools.md's first-run block runs as written: on the shipped lookup warm start the
lookup ToolEnv's calls are well formed and about 4 episodes in 10 are won (the page
quotes this machine's figures); docs/datasets.md's calculator rows on the calculator's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[1] / "docs" / "tools.md"


def block(name: str) -> str:
    match = re.search(rf"<!-- doctest: {name} -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert match, f"docs/tools.md lost its <!-- doctest: {name} --> block"
    return match.group(1)


def test_the_first_run_block_makes_real_calls_and_wins(capsys: Any) -> None:
    namespace: dict[str, Any] = {}
    exec(compile(block("tool-first-run"), "docs/tools.md", "exec"), namespace)
    metrics = namespace["batch"].meta_info["metrics"]
    assert metrics["tool/calls"] >= 0.2 * 256, metrics  # it calls in about 4 episodes of 10
    assert metrics["tool/malformed"] <= 0.05 * metrics["tool/calls"], metrics
    assert metrics["success_rate"] >= 0.2, metrics
    assert "tool/calls" in capsys.readouterr().out


def test_the_datasets_tool_rows_block_makes_real_calls_and_wins() -> None:
    """docs/datasets.md's rows answered with tools: each group is one row (its seed-free
    task), and the tools warm start calls the tool and wins some."""
    text = (DOC.parent / "datasets.md").read_text()
    match = re.search(r"<!-- doctest: tool-rows -->\n```python\n(.*?)```", text, re.S)
    assert match, "docs/datasets.md lost its <!-- doctest: tool-rows --> block"
    namespace: dict[str, Any] = {}
    exec(compile(match.group(1), "docs/datasets.md", "exec"), namespace)
    batch, rows = namespace["batch"], namespace["rows"]
    assert len(set(batch.non_tensor_batch["row_index"])) == 64
    metrics = batch.meta_info["metrics"]
    well_formed = metrics["tool/calls"] - metrics["tool/malformed"]
    assert well_formed >= 0.8 * 256 and metrics["success_rate"] > 0, metrics
    # a won episode answered its own row's question
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(namespace["path"])
    won = int(batch.batch["episode_scores"].argmax())
    row = rows[int(batch.non_tensor_batch["row_index"][won])]
    assert row["prompt"] in tokenizer.decode(batch.batch["input_ids"][won])
