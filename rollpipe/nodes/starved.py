"""The error a ``GroupAssembler`` gives up with: ``max_drops_in_a_row`` groups dropped
and none kept, or an env tag that gave nothing but errors (``error_runs.py``:
``max_errors_in_a_row`` of one kind, or ``max_error_seconds``). It names each kind of
drop, the setting behind it and what to change, and quotes the last env errors
(exception, field and value, env class and call, env, seed), so the cause is in the
message, not only in a count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollpipe.nodes.error_runs import TIMED_MIN_ERRORS, ErrorRun

ERRORS_QUOTED = 3
"""Errors the message quotes (the most recent)."""


def describe_rule(rule: Any) -> str:
    """A keep/drop rule as the message names it: its function name, else its repr."""
    return repr(getattr(rule, "__name__", rule))


def starved_message(
    drops: Mapping[str, int],
    errors: Sequence[Mapping[str, Any]],
    *,
    redundancy: int,
    keep_group: Any,
    drop_group: Any,
    staleness: int | None,
    max_drops_in_a_row: int,
    run: ErrorRun | None = None,
) -> str:
    """The message for ``drops`` (groups dropped in a row, by reason); ``errors`` are the
    ``error_entry`` dicts logged meanwhile (the last ``ERRORS_QUOTED`` are quoted).
    ``run``: the run of errors that ended the stream early (its own errors are quoted)."""
    if run is None:
        lines = [
            f"GroupAssembler: {sum(drops.values())} groups in a row were dropped and none "
            f"kept ({dict(drops)}):"
        ]
    else:
        errors = run.errors
        kinds = ", ".join(f"{n} {kind}" for kind, n in run.kinds.items())
        lines = [
            f"GroupAssembler: env tag {run.tag!r} gave only errors, no usable trajectory, "
            f"for {run.seconds:.1f} s ({kinds}); groups dropped since one was kept: "
            f"{dict(drops)}:"
        ]
    if drops.get("errored") or run is not None:
        lines.append(
            f"- errored: more members of each group failed than redundancy={redundancy} "
            "covers; fix the env (raise_env_errors=True stops at the first error, with its "
            "traceback)"
        )
        quoted = list(errors)[-ERRORS_QUOTED:]
        if quoted:
            lines.append(f"  the last {len(quoted)} errors:")
            lines.extend(f"  * {e['message']}" for e in quoted)
    if drops.get("empty"):
        lines.append(
            "- empty: the first prompt left no room to generate within max_length; raise "
            "max_length or shorten the env's first observation"
        )
    if drops.get("filtered"):
        lines.append(
            f"- filtered: keep_group={describe_rule(keep_group)} / drop_group="
            f"{describe_rule(drop_group)} rejected every complete group; loosen them"
        )
    if drops.get("stale"):
        lines.append(
            f"- stale: each group's oldest token was more than {staleness} policy versions "
            "behind; raise the staleness bound (PipelineConfig.async_generation_ratio, or "
            "None for no bound)"
        )
    if run is None:
        lines.append(
            f"Nothing this policy and env produce is usable; max_drops_in_a_row="
            f"{max_drops_in_a_row} stopped the stream (raise it to wait longer)"
        )
    else:
        lines.append(
            f"{run.rule} stopped the stream early (PipelineConfig.groups: max_errors_in_a_row "
            f"errors of one kind in a row, or max_error_seconds with at least "
            f"{TIMED_MIN_ERRORS} errors; raise them, or max_error_seconds=None, to wait longer)"
        )
    return "\n".join(lines)
