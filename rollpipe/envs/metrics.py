"""ROLL's env step metrics: moved to :mod:`rollpipe.agent.env_contract` (the env contract
lives where the episode reads it); importable here as before."""

from __future__ import annotations

from rollpipe.agent.env_contract import AGG_MODES, aggregate_metrics, step_metrics

__all__ = ["AGG_MODES", "aggregate_metrics", "step_metrics"]
