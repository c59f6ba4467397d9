"""Batch metrics: what a trainer logs about the rollouts behind one batch.

Flat ``name -> float`` dicts, the shape ROLL and verl keep in ``meta_info["metrics"]``
(``DataProto.concat`` merges them into lists).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from rollpipe.agent.records import Trajectory

DROP_KINDS = (
    "filtered",
    "stale",
    "errored",
    "errored_trajectories",
    "empty",
    "empty_trajectories",
    "redundant",
    "incomplete",
)


def _stats(prefix: str, values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/min": 0.0, f"{prefix}/max": 0.0}
    return {
        f"{prefix}/mean": float(values.mean()),
        f"{prefix}/min": float(values.min()),
        f"{prefix}/max": float(values.max()),
    }


def batch_metrics(
    trajectories: Sequence[Trajectory],
    drops: Mapping[str, int] | None = None,
    wall_time_s: float = 0.0,
    stream_time_s: float = 0.0,
    stream_tokens: int = 0,
) -> dict[str, float]:
    """Score, success, turns, response lengths, throughput, time split and drop counts.

    Throughput is the stream's sustained rate (tokens generated for yielded trajectories
    since the stream started, over that time): a batch that was already complete when
    the previous one was taken would otherwise show an absurd per-batch rate.
    """
    drops = drops or {}
    scores = np.array([t.score for t in trajectories], dtype=np.float64)
    turns = np.array([len(t.turns) for t in trajectories], dtype=np.float64)
    response_lengths = np.array(
        [len(turn.response_ids) for t in trajectories for turn in t.turns], dtype=np.float64
    )
    generated = float(response_lengths.sum())
    env_time = float(sum(t.env_time_s for t in trajectories))
    engine_time = float(sum(t.engine_time_s for t in trajectories))
    metrics = {
        "trajectories": float(len(trajectories)),
        **_stats("episode_score", scores),
        "success_rate": float(np.mean([t.success for t in trajectories])) if trajectories else 0.0,
        **_stats("turns", turns),
        **_stats("response_length", response_lengths),
        "generated_tokens": generated,
        "time/wall_s": float(wall_time_s),
        "time/env_s": env_time,
        "time/engine_wait_s": engine_time,
        "time/stream_s": float(stream_time_s),
        "throughput/tokens_per_s": stream_tokens / stream_time_s if stream_time_s > 0 else 0.0,
    }
    for kind in DROP_KINDS:
        metrics[f"dropped/{kind}"] = float(drops.get(kind, 0))
    metrics["end_reason/error"] = float(sum(t.end_reason == "error" for t in trajectories))
    return metrics
