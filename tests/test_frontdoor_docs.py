"""docs/agents.md's code runs as written: the "bring your own agent" example (under 30
lines) makes a batch through the pipeline, and the front door alone collects a session
from an agent process of its own."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[1] / "docs" / "agents.md"


def block(name: str) -> str:
    match = re.search(rf"<!-- doctest: {name} -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert match, f"docs/agents.md lost its <!-- doctest: {name} --> block"
    return match.group(1)


def test_the_agent_example_is_about_30_lines_and_its_calls_are_real() -> None:
    """On the shipped tools warm start the agent's calls are well formed and it wins
    some episodes on the first run (the figures docs/agents.md quotes)."""
    code = block("agent-example")
    lines = [line for line in code.splitlines() if line.strip() and not line.startswith("#")]
    assert len(lines) <= 34, f"{len(lines)} lines of code"
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/agents.md", "exec"), namespace)
    batch = namespace["batch"]
    assert len(batch) == 256 and len(set(batch.non_tensor_batch["uid"])) == 64
    assert set(batch.non_tensor_batch["end_reasons"]) == {"terminated"}
    metrics = batch.meta_info["metrics"]
    assert metrics["tool/calls"] >= 0.2 * len(batch), metrics  # about 4 episodes in 10 call
    assert metrics["tool/malformed"] <= 0.05 * metrics["tool/calls"], metrics
    assert metrics["success_rate"] >= 0.2, metrics


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


def test_the_agent_example_survives_any_arguments() -> None:
    """The example's agent checks a call's arguments before use, as OpenAI's contract
    asks (an auto call's arguments are whatever the model wrote: not JSON, not an object,
    not the tool's): for each kind of bad arguments the tool answers with the error, and
    the episode goes on to its reward."""
    from openai.types.chat import ChatCompletion

    code = block("agent-example").split("\nregister(")[0]  # the agent, not the pipeline
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/agents.md", "exec"), namespace)
    (tool,) = namespace["TOOLS"]
    name = tool["function"]["name"]
    arguments = ['{"drawer": 4}', "false", "120005860", "[1, 2]", "not json"]
    arguments += ['{"a": 1}', '{"drawer": 12}']
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": a}}
        for i, a in enumerate(arguments)
    ]
    replies = [{"role": "assistant", "content": "", "tool_calls": calls}]
    replies.append({"role": "assistant", "content": "It is 5."})
    sent: list[list[Any]] = []

    class Completions:
        async def create(self, **kw: Any) -> ChatCompletion:
            sent.append(list(kw["messages"]))
            message = replies[len(sent) - 1]
            choice = {"index": 0, "finish_reason": "stop", "message": message}
            body = {"id": "x", "created": 0, "model": "m", "object": "chat.completion"}
            return ChatCompletion.model_validate({**body, "choices": [choice]})

    client = type("Client", (), {"chat": type("Chat", (), {"completions": Completions()})})()
    task = ("Which digit is in drawer 4?", (4, [0, 1, 2, 5, 4, 3, 6, 7, 8]))
    result = asyncio.run(namespace["agent"](client, task))
    assert getattr(result, "reward", result) == 1.0 and len(sent) == 2
    results = [m["content"] for m in sent[1] if isinstance(m, dict) and m["role"] == "tool"]
    assert results[0] == "5" and len(results) == len(arguments)
    kinds = ["TypeError", "TypeError", "TypeError", "JSONDecodeError", "KeyError"]
    assert [r.split("(")[0] for r in results[1:-1]] == [f"error: {k}" for k in kinds]
    assert results[-1] == "no such drawer"
