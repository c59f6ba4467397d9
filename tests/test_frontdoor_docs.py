"""docs/agents.md's code runs as written: the "bring your own agent" example (under 30
lines) makes a batch through the pipeline, and the front door alone collects a session
from an agent process of its own."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[1] / "docs" / "agents.md"


def block(name: str) -> str:
    match = re.search(rf"<!-- doctest: {name} -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert match, f"docs/agents.md lost its <!-- doctest: {name} --> block"
    return match.group(1)


def test_the_agent_example_is_under_30_lines_and_makes_a_batch() -> None:
    code = block("agent-example")
    lines = [line for line in code.splitlines() if line.strip() and not line.startswith("#")]
    assert len(lines) < 30, f"{len(lines)} lines of code"
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/agents.md", "exec"), namespace)
    batch = namespace["batch"]
    assert len(batch) == 8 and len(set(batch.non_tensor_batch["uid"])) == 2
    assert set(batch.non_tensor_batch["end_reasons"]) <= {"terminated", "error"}
    assert "terminated" in set(batch.non_tensor_batch["end_reasons"])


AGENT = """
import os, openai
client = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], max_retries=0)
hi = [{"role": "user", "content": "What is 2 + 3?"}]
client.chat.completions.create(model="any", messages=hi, max_tokens=8)
"""
RUN_AGENT = (
    "    import os, subprocess, sys\n"
    "    env = {**os.environ, 'OPENAI_BASE_URL': door.url, 'OPENAI_API_KEY': session.key}\n"
    "    subprocess.run([sys.executable, '-c', AGENT], env=env, check=True, timeout=120)\n"
)


def test_the_door_alone_collects_an_agent_process() -> None:
    code = block("door-alone")
    placeholder = "    ...  # run the agent; wait until it is done\n"
    assert placeholder in code
    namespace: dict[str, Any] = {"AGENT": AGENT}
    exec(compile(code.replace(placeholder, RUN_AGENT), "docs/agents.md", "exec"), namespace)
    trajectory = namespace["trajectory"]
    assert len(trajectory.turns) == 1 and trajectory.score == 1.0 and trajectory.error is None
    assert 0 < len(trajectory.turns[0].response_ids) <= 8
