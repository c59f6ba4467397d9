"""The OpenAI-compatible front door: any ``openai``-client agent becomes exact rows.

:class:`FrontDoor` serves ``/v1/chat/completions`` on an engine and records each
session's calls token-exactly; :class:`AgentEnv` runs ``async def agent(client, task)``
as an episode of the pipeline. See docs/agents.md.
"""

from rollpipe.frontdoor.agent import AgentEnv, AgentResult, AgentTimeoutError
from rollpipe.frontdoor.server import FrontDoor, SessionTimeoutError
from rollpipe.frontdoor.session import AgentSession

__all__ = [
    "AgentEnv",
    "AgentResult",
    "AgentSession",
    "AgentTimeoutError",
    "FrontDoor",
    "SessionTimeoutError",
]
