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
        "part 1 is a NoneType, not a DataProto: None",
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
    "index None": (lambda: make()[None], IndexError, r"cannot index rows with None \(NoneType\)"),
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


# name -> the value the message must quote (issue 22: every error names the field and
# the value); the field is in CASES' pattern
VALUES: dict[str, str] = {
    "chunk 0": "got 0",
    "chunk float": "got 2.0",
    "concat conflicting meta": "part 0 has 1.0 but part 1 has 2.0",
    "concat dtype": "torch.float32 in part 1 but (4, 3) torch.int64 in part 0",
    "concat missing key": "has batch keys ['ids'] but part 0 has ['ids', 'score']",
    "concat width": "is (4, 5) torch.int64 in part 1 but (4, 3)",
    "concat(None)": "got None (NoneType)",
    "concat([])": "got an empty list",
    "concat([dp, None])": "NoneType, not a DataProto: None",
    "concat(dp)": "got DataProto(len=4",
    "from_dict int key": "got 1 (int)",
    "from_dict meta list": "got [1] (list)",
    "from_dict ragged": "'b' has 3 rows but 'a' has 2",
    "from_dict tensors list": "got [1, 2] (list)",
    "from_single_dict None": "got None (NoneType)",
    "group_by int": "got 3 (int)",
    "index 2-D": "got shape (1, 2): [[0, 1]]",
    "index None": "with None (NoneType)",
    "index floats": "got [0.5] (dtype float64)",
    "index mask length": "bool mask has 1 entries but the DataProto has 4 rows",
    "index out of range": "row index 9",
    "init batch dict": "got dict {'a': tensor([0., 0.])}",
    "init columns list": "got [1, 2] (list)",
    "init meta str": "got 'x' (str)",
    "iter_minibatches 0": "got 0",
    "pop int": "got 3 (int)",
    "rename int": "got 3 (int)",
    "reorder None": "with None (NoneType)",
    "reorder not permutation": "4 indices with 3 distinct ([0, 0, 1, 2])",
    "repeat None": "got None",
    "sample_level_repeat None": "got None",
    "save int path": "got 3 (int)",
    "select int": "got 3 (int)",
    "select unknown": "'x' not found",
    "setitem int key": "got 3 (int)",
    "setitem scalar": "got 3 (int)",
    "setitem short": "'z' has 1 rows but the DataProto has 4",
    "slice float bound": "got 0.5",
    "slice str bound": "got '2'",
    "split str": "got '2'",
    "to bad device": "'nodevice' is not a device",
    "union None": "got None (NoneType)",
    "union rows": "this DataProto has 4 rows, the other 2",
    "unknown column": "no column 'nope'",
    "update None": "got None (NoneType)",
    "update int": "got 3 (int)",
}


def test_every_case_says_which_value() -> None:
    assert set(VALUES) == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_misuse_names_the_value(name: str) -> None:
    call, kind, _ = CASES[name]
    with pytest.raises(kind) as info:
        call()
    message = info.value.args[0] if isinstance(info.value, KeyError) else str(info.value)
    assert VALUES[name] in message


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda: make().slice(0, 4, 0), "slice step must not be 0, got slice(0, 4, 0)"),
        (lambda: make().group_by([]), "group_by needs at least one key, got []"),
        (lambda: make().rename(["ids"], ["a", "b"]), "old_keys ['ids'] but 2 new_keys ['a', 'b']"),
        (lambda: DataProto.from_dict(tensors={"a": torch.tensor(1.0)}), "is 0-d (tensor(1.))"),
        (
            lambda: make().reorder(np.array([[0, 1, 2, 3]])),
            "row indices must be 1-D, got shape (1, 4): [[0, 1, 2, 3]]",
        ),
    ],
)
def test_more_misuse_names_field_and_value(call: Callable[[], Any], says: str) -> None:
    with pytest.raises(IndexError if "indices" in says else ValueError) as info:
        call()
    assert says in str(info.value)


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
