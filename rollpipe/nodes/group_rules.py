"""Group rules: the predicates ``keep_group`` / ``drop_group`` take, by name, callable
or import path, resolved and checked once (``resolve_group_rule``, ``check_group_rule``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from rollpipe._utils.import_path import NotAnImportPath, import_object
from rollpipe.agent.records import Group

GroupRule = Callable[[Group], bool]
"""A predicate on a complete group; ``keep_group`` keeps it on True, ``drop_group`` drops it."""


def scores_differ(group: Group, eps: float = 1e-6) -> bool:
    """True when the group's episode scores differ (std above ``eps``): GRPO has a signal."""
    scores = np.array([t.score for t in group.trajectories], dtype=np.float64)
    return bool(scores.std() > eps)


def zero_variance(group: Group, eps: float = 1e-6) -> bool:
    """True when every episode score is the same: GRPO's advantage is 0, nothing to learn."""
    return not scores_differ(group, eps)


def is_stale(group: Group, current_version: int, max_staleness: int) -> bool:
    """The staleness rule, applied by GroupAssembler and again by Batch: the group's oldest
    token is more than ``max_staleness`` versions behind ``current_version`` (a group that
    generated nothing is never stale)."""
    oldest = group.min_version
    return oldest >= 0 and current_version - oldest > max_staleness


KEEP_RULES: dict[str, GroupRule] = {"scores_differ": scores_differ}
"""Names ``keep_group`` accepts (True keeps)."""
DROP_RULES: dict[str, GroupRule] = {"zero_variance": zero_variance}
"""Names ``drop_group`` accepts (True drops, ROLL's ``GroupFilter.filter`` polarity)."""

_RULES = {
    "keep_group": (KEEP_RULES, DROP_RULES, "drop_group"),
    "drop_group": (DROP_RULES, KEEP_RULES, "keep_group"),
}


def _import_rule(path: str, field: str, names: dict[str, GroupRule]) -> Any:
    hint = (
        f"give a registered name ({sorted(names)}), a callable Group -> bool, or an import "
        "path 'package.module:function'"
    )
    try:
        return import_object(path, dotted=True)
    except NotAnImportPath:
        raise ValueError(f"{field}: unknown name {path!r}; {hint}") from None
    except Exception as exc:  # not found, or the module failed to import
        raise ValueError(
            f"{field}: cannot import {path!r} ({type(exc).__name__}: {exc}); {hint}"
        ) from exc


def resolve_group_rule(value: str | GroupRule | None, field: str) -> GroupRule | None:
    """``value`` (None, a callable, a registered name or an import path) as a callable.

    ``field`` is ``"keep_group"`` or ``"drop_group"``, optionally prefixed by its owner
    (``"PipelineConfig.drop_group"``); it picks the registered names and names the field
    in errors.
    """
    polarity = field.rpartition(".")[2]
    if polarity not in _RULES:
        raise ValueError(f"field must end in 'keep_group' or 'drop_group', got {field!r}")
    names, other_names, other = _RULES[polarity]
    if value is None:
        return None
    where = repr(value) if isinstance(value, str) else getattr(value, "__qualname__", repr(value))
    if isinstance(value, str):
        if value in names:
            return names[value]
        if value in other_names:
            raise ValueError(
                f"{field}={value!r}: {value!r} is a {other} rule (True means "
                f"{other.partition('_')[0]}); write {other}={value!r}, or use one of "
                f"{sorted(names)} here"
            )
        value = _import_rule(value, field, names)
    if inspect.isclass(value):
        raise ValueError(
            f"{field}: {where} is a class; give a function Group -> bool (a ROLL GroupFilter "
            "class does not fit: wrap its filter() in a function)"
        )
    if not callable(value):
        raise ValueError(f"{field}: {where} is not callable; give a function Group -> bool")
    try:
        inspect.signature(value).bind(None)
    except TypeError:
        raise ValueError(
            f"{field}: {where} must take one argument, the Group, and return a bool"
        ) from None
    except ValueError:  # no signature to check (some builtins)
        pass
    return value


def check_group_rule(inst: object, attribute: Any, value: object) -> None:
    """attrs validator for config fields named ``keep_group`` / ``drop_group``."""
    resolve_group_rule(value, f"{type(inst).__name__}.{attribute.name}")  # type: ignore[arg-type]
