"""The lookup task as an ``openai``-client agent: the agent kind ``rollpipe train`` trains.

:func:`lookup_agent` is plain ``openai`` code: it sends the question with the ``lookup``
tool's schema, runs the calls the model makes against the episode's drawers itself, and
scores the answer. It sends what :class:`~rollpipe.envs.lookup.LookupEnv` shows the model
(the same system prompt, question and schema), so the tools warm start, trained on
LookupEnv's episodes, plays it as well; a test checks the rendered ids are the same.
``rollpipe train --env lookup-agent`` trains it through the front door
(``lookup_agent_env``, the :class:`~rollpipe.frontdoor.AgentEnv` the task names).
"""

from __future__ import annotations

import json
import re
from typing import Any

from rollpipe.envs.lookup import lookup_task
from rollpipe.frontdoor import AgentEnv, AgentResult

__all__ = ["SYSTEM_PROMPT", "TOOLS", "lookup_agent", "lookup_agent_env"]

SYSTEM_PROMPT = (
    "You are an assistant with tools. Call a tool when it helps, then give the final "
    "answer in plain text."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Open a drawer and read the digit inside.",
            "parameters": {
                "type": "object",
                "properties": {
                    "drawer": {"type": "integer", "description": "the drawer's number, 1 to 9"}
                },
                "required": ["drawer"],
            },
            "return": {"type": "string"},
        },
    }
]
_NUMBER = re.compile(r"\d+")


async def lookup_agent(client: Any, task: Any) -> AgentResult:
    """Answer ``task`` (``(question, (drawer, digits))``, from ``lookup_task(seed)``)
    with ``client`` (an ``openai.AsyncOpenAI``); reward 1.0 when the answer's last
    number is the digit in the drawer asked about."""
    question, (drawer, digits) = task
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": question},
    ]
    for _ in range(2):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            numbers = _NUMBER.findall(message.content or "")
            won = bool(numbers) and int(numbers[-1]) == digits[drawer - 1]
            return AgentResult(float(won), success=won)
        for call in message.tool_calls:
            try:  # the model's JSON: check it before use
                opened = json.loads(call.function.arguments)["drawer"]
                result = str(digits[opened - 1]) if opened in range(1, 10) else "no such drawer"
            except Exception as exc:
                result = f"error: {exc!r}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return AgentResult(0.0)


def lookup_agent_env() -> AgentEnv:
    """:func:`lookup_agent` on the lookup task's seeds, as an episode kind."""
    return AgentEnv(lookup_agent, task=lookup_task)
