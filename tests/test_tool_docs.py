"""docs/tools.md's first-run block runs as written: on the shipped tools warm start the
calculator ToolEnv's calls are well formed and some episodes are won (the page quotes
this machine's figures: 64 calls, 2 malformed, 4 of 64 won)."""

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
    well_formed = metrics["tool/calls"] - metrics["tool/malformed"]
    assert well_formed >= 0.8 * 64 and metrics["success_rate"] > 0, metrics
    assert "tool/calls" in capsys.readouterr().out
