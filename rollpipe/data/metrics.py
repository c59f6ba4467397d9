"""Batch metrics: what a trainer logs about the rollouts behind one batch.

Flat ``name -> float`` dicts, the shape ROLL and verl keep in ``meta_info["metrics"]``
(``DataProto.concat`` merges them into lists). Global keys first, then, per env tag,
``env/{tag}/...`` as ROLL names them: the env's own step metrics (``success``,
``action_is_valid``... averaged over the tag's trajectories) and rollpipe's
(``TAG_KEYS``, plus ``dropped/{kind}``), which win a name clash as ROLL's
``num_actions`` does.

``valid_action_rate`` (global and per tag) is the fraction of turns with a valid action
among the turns whose validity is known: turns whose env reported ``info["action_valid"]``,
and turns not stepped (a cut response under ``on_length="skip"`` / ``"end"``: invalid). A
turn whose env did not report it (``Turn.action_valid is None``, e.g. every gem env) is
left out, and with no known turn the rate is NaN (unknown, not 0.0). The key is always
present, so per-batch lists stay aligned across a ``DataProto.concat``.

Tool calls (``rollpipe.envs.tool_env``) are counted as batch totals, not means:
``tool/calls``, ``tool/malformed``, ``tool/errors``, ``tool/timeouts`` (always present, 0
without tools) and per tool name ``tool/{kind}/{name}`` (when a tool was called).
``prefix_breaks`` counts the turns at which a chat template re-rendered earlier history
(``rollpipe.agent.dialog``): rows there differ from a fresh render of the conversation.
"""

from __future__ import annotations

import math
from collections import defaultdict
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
    "wasted_tokens",  # generated tokens of the trajectories dropped above
)


TOOL_TOTALS = ("tool/calls", "tool/malformed", "tool/errors", "tool/timeouts")
"""Tool-call counts summed over a batch's trajectories (always reported)."""


def tool_totals(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """``tool/...`` counts summed over the trajectories (see the module doc)."""
    totals = dict.fromkeys(TOOL_TOTALS, 0.0)
    for t in trajectories:
        for name, value in t.env_metrics.items():
            if name.startswith("tool/"):
                totals[name] = totals.get(name, 0.0) + float(value)
    return totals


TAG_KEYS = (
    "trajectories",
    "success_rate",
    "score/mean",
    "score/min",
    "score/max",
    "turns/mean",
    "turns/min",
    "turns/max",
    "valid_action_rate",
    "num_actions",
)
"""rollpipe's per-tag keys, under ``env/{tag}/`` (besides ``dropped/{kind}``)."""


def _stats(prefix: str, values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/min": 0.0, f"{prefix}/max": 0.0}
    return {
        f"{prefix}/mean": float(values.mean()),
        f"{prefix}/min": float(values.min()),
        f"{prefix}/max": float(values.max()),
    }


def _valid_rate(trajectories: Sequence[Trajectory]) -> float:
    """Valid among the turns whose validity is known; NaN when none is (module doc)."""
    known = [u.action_valid for t in trajectories for u in t.turns if u.action_valid is not None]
    return float(np.mean(known)) if known else math.nan


def tag_metrics(
    tag: str, trajectories: Sequence[Trajectory], drops: Mapping[str, int] | None = None
) -> dict[str, float]:
    """``env/{tag}/...`` for the trajectories of one tag and the drops counted for it.

    Env metrics are averaged over the trajectories that report them (ROLL reduces its
    per-trajectory ``env/{tag}/*`` lists by mean); ``valid_action_rate`` is per turn, over
    the turns whose validity is known (NaN if none is: see the module doc),
    ``num_actions`` the mean count of env steps per trajectory (ROLL's name).
    """
    prefix = f"env/{tag}/"
    reported: defaultdict[str, list[float]] = defaultdict(list)
    for t in trajectories:
        for name, value in t.env_metrics.items():
            reported[name].append(value)
    out = {prefix + name: float(np.mean(values)) for name, values in reported.items()}
    scores = np.array([t.score for t in trajectories], dtype=np.float64)
    turns = np.array([len(t.turns) for t in trajectories], dtype=np.float64)
    steps = [sum(u.stepped for u in t.turns) for t in trajectories]
    out.update(
        {
            f"{prefix}trajectories": float(len(trajectories)),
            f"{prefix}success_rate": (
                float(np.mean([t.success for t in trajectories])) if trajectories else 0.0
            ),
            **_stats(f"{prefix}score", scores),
            **_stats(f"{prefix}turns", turns),
            f"{prefix}valid_action_rate": _valid_rate(trajectories),
            f"{prefix}num_actions": float(np.mean(steps)) if steps else 0.0,
        }
    )
    for kind in DROP_KINDS:
        out[f"{prefix}dropped/{kind}"] = float((drops or {}).get(kind, 0))
    return out


def batch_metrics(
    trajectories: Sequence[Trajectory],
    drops: Mapping[str, int] | None = None,
    wall_time_s: float = 0.0,
    stream_time_s: float = 0.0,
    stream_tokens: int = 0,
    *,
    tag_drops: Mapping[str, Mapping[str, int]] | None = None,
) -> dict[str, float]:
    """Score, success, turns, response lengths, throughput, time split and drop counts,
    globally and per env tag (``tag_metrics``; ``tag_drops`` is ``{tag: {kind: n}}``).

    Throughput is the stream's sustained rate (tokens generated for yielded trajectories
    since the stream started, over that time): a batch that was already complete when
    the previous one was taken would otherwise show an absurd per-batch rate.
    """
    drops = drops or {}
    tag_drops = tag_drops or {}
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
        "aborted_tokens": float(sum(t.aborted_tokens for t in trajectories)),
        "rewards_clipped": float(sum(t.clipped_rewards for t in trajectories)),
        "time/wall_s": float(wall_time_s),
        "time/env_s": env_time,
        "time/engine_wait_s": engine_time,
        "time/stream_s": float(stream_time_s),
        "throughput/tokens_per_s": stream_tokens / stream_time_s if stream_time_s > 0 else 0.0,
    }
    for kind in DROP_KINDS:
        metrics[f"dropped/{kind}"] = float(drops.get(kind, 0))
    metrics["end_reason/error"] = float(sum(t.end_reason == "error" for t in trajectories))
    metrics["valid_action_rate"] = _valid_rate(trajectories)
    metrics["prefix_breaks"] = float(sum(t.prefix_breaks for t in trajectories))
    metrics.update(tool_totals(trajectories))
    by_tag: defaultdict[str, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        by_tag[t.tag].append(t)
    for tag in sorted(by_tag.keys() | tag_drops.keys()):
        metrics.update(tag_metrics(tag, by_tag.get(tag, []), tag_drops.get(tag)))
    return metrics
