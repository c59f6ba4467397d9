"""verifiers' own chat program (its ``null`` harness) run with this Python, not ``uv``.

verifiers 0.4 runs a harness as a PEP 723 script that ``uv`` installs into a fresh
environment: that needs the network. The chat program imports only ``openai``, ``mcp``,
``httpx``, ``tenacity`` and ``certifi``, which the ``verifiers`` extra installs here, so
:class:`LocalChatHarness` keeps verifiers' program, its arguments and its interception
server unchanged and only starts the script with ``sys.executable``.

verifiers loads a harness by a module name that exports it in ``__all__``; dotted names
outside ``verifiers.v1.harnesses`` do not resolve there, so this module is also registered
as the top-level module :data:`HARNESS_ID`.
"""

from __future__ import annotations

import sys
from typing import Any

from verifiers.v1.harnesses.null import NullHarness
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

__all__ = ["LocalChatHarness"]

HARNESS_ID = "rollpipe_verifiers_chat"
"""The harness id verifiers loads this module by (``AgentConfig(harness={"id": ...})``)."""


class LocalChatHarness(NullHarness):
    """verifiers' ``null`` chat loop (tools over MCP, multi-turn resume), started with
    ``sys.executable`` in the run's own runtime."""

    async def setup(self, runtime: Any) -> None:
        return None  # nothing to install: the program's imports are installed here

    async def launch(self, ctx: Any, trace: Any, runtime: Any, *args: Any, **kwargs: Any) -> Any:
        path = f".vf-chat-{trace.id}.py"
        await runtime.write(path, CHAT_PROGRAM_SOURCE.encode())

        async def prepare(script: Any, env: Any = None, *, activate: bool = True) -> list[str]:
            return [sys.executable, path]

        runtime.prepare_uv_script = prepare  # this run's runtime only (a fresh box a run)
        return await super().launch(ctx, trace, runtime, *args, **kwargs)


sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])
