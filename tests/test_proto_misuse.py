"""DataProto misuse, table-driven: every case raises ValueError / KeyError / IndexError
whose message names the argument or key and says what to pass — never a bare TypeError,
AttributeError or pickle error from deep inside."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rollpipe.data.proto import DataProto


def make(n: int = 4, **meta: Any) -> DataProto:
    return DataProto.from_dict(
        tensors={"ids": torch.arange(n * 3).reshape(n, 3), "score": torch.linspace(0, 1, n)},
        non_tensors={"uid": [f"u{i}" for i in range(n)]},
        meta_info=meta or {"t": 1.0},
    )


def floats() -> DataProto:
    return DataProto.from_dict(
        tensors={"ids": torch.zeros(4, 3), "score": torch.zeros(4)},
        non_tensors={"uid": list("abcd")},
    )


# name -> (call, exception type, message pattern)
CASES: dict[str, tuple[Callable[[], Any], type[Exception], str]] = {
    "concat(None)": (lambda: DataProto.concat(None), ValueError, "concat needs a list"),  # type: ignore[arg-type]
    "concat(dp)": (lambda: DataProto.concat(make()), ValueError, r"concat\(\[a, b\]\)"),  # type: ignore[arg-type]
    "concat([])": (lambda: DataProto.concat([]), ValueError, "at least one DataProto"),
    "concat([dp, None])": (
        lambda: DataProto.concat([make(), None]),  # type: ignore[list-item]
        ValueError,
        "part 1 is a NoneType",
    ),
    "concat missing key": (
        lambda: DataProto.concat([make(), make().select(batch_keys=["ids"])]),
        ValueError,
        r"missing \['score'\].*select the common keys",
    ),
    "concat dtype": (lambda: DataProto.concat([make(), floats()]), ValueError, "key 'ids'"),
    "concat width": (
        lambda: DataProto.concat([make(), make().update({"ids": torch.zeros(4, 5).long()})]),
        ValueError,
        r"'ids' is \(4, 5\)",
    ),
    "concat conflicting meta": (
        lambda: DataProto.concat([make(t=1.0), make(t=2.0)]),
        ValueError,
        "meta_info key 't' conflicts",
    ),
    "index out of range": (lambda: make()[9], IndexError, "row index 9 is out of range"),
    "index None": (lambda: make()[None], IndexError, "cannot index rows with NoneType"),
    "index floats": (lambda: make()[[0.5]], IndexError, "integers or bools"),
    "index 2-D": (lambda: make()[np.array([[0, 1]])], IndexError, "must be 1-D"),
    "index mask length": (lambda: make()[np.array([True])], IndexError, "bool mask has 1"),
    "slice float bound": (lambda: make()[0.5:2], IndexError, "slice start must be an int"),
    "slice str bound": (lambda: make().slice(0, "2"), IndexError, "slice end must be an int"),  # type: ignore[arg-type]
    "unknown column": (lambda: make()["nope"], KeyError, "no column 'nope'"),
    "reorder not permutation": (lambda: make().reorder([0, 0, 1, 2]), ValueError, "permutation"),
    "reorder None": (lambda: make().reorder(None), IndexError, "NoneType"),
    "chunk 0": (lambda: make().chunk(0), ValueError, "chunks must be an int >= 1"),
    "chunk float": (lambda: make().chunk(2.0), ValueError, "chunks must be an int >= 1"),  # type: ignore[arg-type]
    "split str": (lambda: make().split("2"), ValueError, "split_size must be an int"),  # type: ignore[arg-type]
    "repeat None": (lambda: make().repeat(None), ValueError, "repeat_times must be an int"),  # type: ignore[arg-type]
    "sample_level_repeat None": (
        lambda: make().sample_level_repeat(None),  # type: ignore[arg-type]
        ValueError,
        "one int count per row",
    ),
    "select int": (lambda: make().select(batch_keys=3), ValueError, "batch_keys must be a str"),  # type: ignore[arg-type]
    "select unknown": (lambda: make().select(batch_keys=["x"]), KeyError, "batch key 'x'"),
    "pop int": (lambda: make().pop(meta_info_keys=3), ValueError, "meta_info_keys must be"),  # type: ignore[arg-type]
    "rename int": (lambda: make().rename(3, "x"), ValueError, "old_keys must be a str"),  # type: ignore[arg-type]
    "group_by int": (lambda: make().group_by(3), ValueError, "group_by keys must be a str"),  # type: ignore[arg-type]
    "union None": (lambda: make().union(None), ValueError, "union needs a DataProto"),  # type: ignore[arg-type]
    "union rows": (lambda: make().union(make(2)), ValueError, "equal row counts"),
    "update None": (lambda: make().update(None), ValueError, "update: the argument must be"),  # type: ignore[arg-type]
    "update int": (lambda: make().update(3), ValueError, "update: the argument must be"),  # type: ignore[arg-type]
    "setitem int key": (
        lambda: make().__setitem__(3, torch.zeros(4)),
        ValueError,
        "names must be str",
    ),  # type: ignore[index]
    "setitem scalar": (lambda: make().__setitem__("z", 3), ValueError, "column 'z' must be"),
    "setitem short": (lambda: make().__setitem__("z", [1]), ValueError, "column 'z' has 1 rows"),
    "from_dict tensors list": (
        lambda: DataProto.from_dict(tensors=[1, 2]),  # type: ignore[arg-type]
        ValueError,
        "tensors must be a dict",
    ),
    "from_dict meta list": (
        lambda: DataProto.from_dict(tensors={"a": torch.zeros(2)}, meta_info=[1]),  # type: ignore[arg-type]
        ValueError,
        "meta_info must be a dict",
    ),
    "from_dict int key": (
        lambda: DataProto.from_dict(tensors={1: torch.zeros(2)}),  # type: ignore[dict-item]
        ValueError,
        "names must be str, got 1",
    ),
    "from_dict ragged": (
        lambda: DataProto.from_dict(tensors={"a": torch.zeros(2), "b": torch.zeros(3)}),
        ValueError,
        "column 'b' has 3 rows but 'a' has 2",
    ),
    "from_single_dict None": (
        lambda: DataProto.from_single_dict(None),  # type: ignore[arg-type]
        ValueError,
        "from_single_dict: data must be a dict",
    ),
    "init meta str": (lambda: DataProto(meta_info="x"), ValueError, "meta_info must be a dict"),  # type: ignore[arg-type]
    "init columns list": (
        lambda: DataProto(non_tensor_batch=[1, 2]),  # type: ignore[arg-type]
        ValueError,
        "non_tensor_batch must be a dict",
    ),
    "init batch dict": (
        lambda: DataProto({"a": torch.zeros(2)}),  # type: ignore[arg-type]
        ValueError,
        "batch must be a tensordict",
    ),
    "to bad device": (lambda: make().to("nodevice"), ValueError, "'nodevice' is not a device"),
    "iter_minibatches 0": (
        lambda: list(make().iter_minibatches(0)),
        ValueError,
        "batch_size must be an int >= 1",
    ),
    "save int path": (lambda: make().save(3), ValueError, "path must be a str"),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_misuse_raises_a_clear_error(name: str) -> None:
    call, kind, pattern = CASES[name]
    with pytest.raises(kind, match=pattern):
        call()


@pytest.mark.parametrize(
    ("damage", "size"),
    [("truncated", None), ("garbage", 70), ("empty", 0), ("one byte", 1)],
)
def test_a_damaged_file_names_the_file_and_the_fix(
    tmp_path: Path, damage: str, size: int | None
) -> None:
    good = tmp_path / "batch.pt"
    make().save(good)
    raw = good.read_bytes()
    data = {
        "truncated": raw[: len(raw) // 2],
        "garbage": b"garbage" * 10,
        "empty": b"",
        "one byte": raw[:1],
    }[damage]
    bad = tmp_path / "bad.pt"
    bad.write_bytes(data)
    with pytest.raises(ValueError, match="not a readable DataProto file") as info:
        DataProto.load(bad)
    message = str(info.value)
    assert str(bad) in message
    assert f"({len(data)} bytes)" in message and "save it again" in message
    assert DataProto.load(good).equals(make())  # the good file still loads


def test_saving_into_a_missing_folder_says_so(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="create its folder first"):
        make().save(tmp_path / "no" / "such" / "x.pt")
