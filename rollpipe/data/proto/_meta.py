"""``merge_meta_info``: the meta_info of concatenated DataProto parts, merged.

``metrics`` are collected into lists (one entry per part, or the part's own lists);
``env_errors`` lists (the pipeline's errored-trajectory records) are joined; any other
key must agree, so a concat never silently drops a setting.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollpipe.data.proto._equality import values_equal
from rollpipe.data.proto.columns import short_repr

__all__ = ["merge_meta_info"]


def merge_meta_info(metas: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Merge the meta_info of concatenated parts.

    ``metrics`` (a dict of values, or a list of such dicts, per part) becomes one dict of
    lists: list values are extended, scalars appended. Any other key must be equal in all
    parts that hold it.
    """
    merged: dict[str, Any] = {}
    first_part: dict[str, int] = {}
    metrics: dict[str, list[Any]] | None = None
    for i, meta in enumerate(metas):
        for key, value in meta.items():
            if key == "metrics":
                if value is None:
                    continue
                if metrics is None:
                    metrics = merged["metrics"] = {}
                for entry in value if isinstance(value, list) else [value]:
                    if not isinstance(entry, Mapping):
                        raise ValueError(
                            f"meta_info['metrics'] of part {i} must be a dict of metric values "
                            f"(or a list of dicts), got {short_repr(entry)}"
                        )
                    for name, v in entry.items():
                        bucket = metrics.setdefault(name, [])
                        bucket.extend(v) if isinstance(v, list) else bucket.append(v)
            elif key == "env_errors" and isinstance(value, list):
                if not isinstance(merged.setdefault(key, []), list):
                    raise ValueError(
                        f"meta_info['env_errors'] of part {first_part[key]} must be a list "
                        f"(as in part {i}), got {short_repr(merged[key])}"
                    )
                merged[key] = [*merged[key], *value]
            elif key not in merged:
                merged[key] = value
                first_part[key] = i
            elif not values_equal(merged[key], value):
                raise ValueError(
                    f"meta_info key {key!r} conflicts: part {first_part[key]} has "
                    f"{short_repr(merged[key])} but part {i} has {short_repr(value)}; make the "
                    "values equal or pop the key before concat"
                )
    return merged
