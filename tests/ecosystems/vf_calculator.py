"""The ``add`` tool server of ``vf_tools``: verifiers starts it as ``python -m
vf_calculator`` (an MCP server), so it lives in its own module with a main guard. Each
start appends a line to the file ``$VF_CALCULATOR_STARTS`` names, if set, so a test can
count how often the server was started."""

import os

import verifiers.v1 as vf

__all__ = ["Calculator"]


class Calculator(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


if __name__ == "__main__":
    if starts := os.environ.get("VF_CALCULATOR_STARTS"):
        with open(starts, "a") as log:
            log.write(f"{os.getpid()}\n")
    Calculator.run()
