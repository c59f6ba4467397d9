"""Env step metrics: ``info["metrics"]`` per step, aggregated into one dict per trajectory.

The convention is ROLL's: a step's ``info`` may hold ``"metrics"`` (name -> number) and
``"metrics_agg_mode"`` (name -> one of ``AGG_MODES``). A trajectory's value of a metric
is its steps' values aggregated by that mode, ``"mean"`` when none is named (ROLL's
``aggregate_metrics``). Batch metrics then average it over the trajectories of each env
tag, as ``env/{tag}/{name}``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

AGG_MODES: tuple[str, ...] = ("mean", "sum", "min", "max", "first", "last")


def _number(name: str, value: Any) -> float:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise ValueError(
            f"info['metrics'][{name!r}] must be a number (bool, int or float), got "
            f"{type(value).__name__} {value!r}"
        )
    return float(value)


def step_metrics(info: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """``(metrics, agg_modes)`` of one step's ``info``, checked; both empty when absent.

    Raises ``ValueError`` naming the key when ``metrics`` is not a dict of numbers or a
    mode is not one of ``AGG_MODES``.
    """
    raw = info.get("metrics")
    modes = info.get("metrics_agg_mode")
    if raw is None and modes is None:  # most steps: nothing to check
        return {}, {}
    if raw is None:
        raw = {}
    if modes is None:
        modes = {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"info['metrics'] must be a dict of numbers, got {type(raw).__name__}")
    if not isinstance(modes, Mapping):
        raise ValueError(
            f"info['metrics_agg_mode'] must be a dict of names to {AGG_MODES}, got "
            f"{type(modes).__name__}"
        )
    metrics = {str(k): _number(str(k), v) for k, v in raw.items()}
    for k, mode in modes.items():
        if mode not in AGG_MODES:
            raise ValueError(
                f"info['metrics_agg_mode'][{k!r}] is {mode!r}; use one of {list(AGG_MODES)}"
            )
    return metrics, {str(k): str(v) for k, v in modes.items()}


def aggregate_metrics(
    steps: Sequence[Mapping[str, float]], modes: Mapping[str, str] | None = None
) -> dict[str, float]:
    """Each name's values over the steps that reported it, reduced by its mode (mean)."""
    values: dict[str, list[float]] = {}
    for step in steps:
        for name, value in step.items():
            values.setdefault(name, []).append(float(value))
    modes = modes or {}
    out: dict[str, float] = {}
    for name, vs in values.items():
        mode = modes.get(name, "mean")
        if mode == "sum":
            out[name] = float(sum(vs))
        elif mode == "min":
            out[name] = min(vs)
        elif mode == "max":
            out[name] = max(vs)
        elif mode == "first":
            out[name] = vs[0]
        elif mode == "last":
            out[name] = vs[-1]
        else:
            out[name] = sum(vs) / len(vs)
    return out
