"""The ``add`` tool server of ``vf_tools``: verifiers starts it as ``python -m
vf_calculator`` (an MCP server), so it lives in its own module with a main guard."""

import verifiers.v1 as vf

__all__ = ["Calculator"]


class Calculator(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


if __name__ == "__main__":
    Calculator.run()
