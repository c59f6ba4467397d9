"""DataProto keys: a key asked of the wrong part says where it is, for any key name; the
renamed column ``end_reason`` reads ``end_reasons`` with a DeprecationWarning; and
``non_tensor_batch`` keeps doing both through every operation that makes a new batch."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rollpipe.data.proto import DataProto

NAMES = st.text(min_size=1, max_size=12).filter(lambda k: k != "end_reason")


def make(
    tensor: str = "input_ids", column: str = "end_reasons", meta: str = "metrics"
) -> DataProto:
    return DataProto.from_dict(
        tensors={tensor: torch.arange(6).view(2, 3)},
        non_tensors={column: ["terminated", "error"]},
        meta_info={meta: {"x": 1.0}},
    )


@given(st.lists(NAMES, min_size=3, max_size=3, unique=True))
def test_any_key_in_the_wrong_part_says_where(names: list[str]) -> None:
    tensor, column, meta = names
    dp = make(tensor, column, meta)
    with pytest.raises(KeyError) as err:
        dp.non_tensor_batch[tensor]
    assert f"{tensor!r} is in batch.batch" in err.value.args[0]
    with pytest.raises(KeyError) as err:
        dp.select(batch_keys=[column])
    assert f"{column!r} is in batch.non_tensor_batch" in err.value.args[0]
    assert "not batch.batch" in err.value.args[0]
    with pytest.raises(KeyError) as err:
        dp.pop(non_tensor_batch_keys=[meta])
    assert f"{meta!r} is in batch.meta_info" in err.value.args[0]
    with pytest.raises(KeyError) as err:
        dp[meta]
    assert f"{meta!r} is in batch.meta_info" in err.value.args[0]
    with pytest.raises(KeyError) as err:
        dp.select(meta_info_keys=[tensor])
    assert f"{tensor!r} is in batch.batch" in err.value.args[0]


def test_a_key_nowhere_lists_the_keys_there_are() -> None:
    dp = make()
    with pytest.raises(KeyError, match=r"non_tensor_batch key 'nope' not found; .*'end_reasons'"):
        dp.non_tensor_batch["nope"]
    assert dp.non_tensor_batch.get("nope", 5) == 5


def test_the_old_name_end_reason_reads_end_reasons_with_a_warning() -> None:
    dp = make()
    column = dp.non_tensor_batch["end_reasons"]
    for read in (
        lambda: dp.non_tensor_batch["end_reason"],
        lambda: dp.non_tensor_batch.get("end_reason"),
        lambda: dp["end_reason"],
    ):
        with pytest.warns(DeprecationWarning, match="now named 'end_reasons'"):
            assert read() is column
    assert "end_reason" not in dp.non_tensor_batch and "end_reason" not in dp
    assert list(dp.non_tensor_batch) == ["end_reasons"]  # the old name is not a key
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dp["end_reasons"], dp.non_tensor_batch.get("end_reasons")
        bare = DataProto.from_dict(non_tensors={"uid": ["a"]})
        assert bare.non_tensor_batch.get("end_reason") is None  # nothing to point to


def copies(dp: DataProto, tmp: Path) -> list[DataProto]:
    dp.save(tmp / "b.pt")
    replaced = make()
    replaced.non_tensor_batch = {"end_reasons": np.array(["a", "b"], dtype=object)}
    return [
        pickle.loads(pickle.dumps(dp)),
        DataProto.load(tmp / "b.pt"),
        dp.clone(),
        dp[0:1],
        dp[[1, 0]],
        DataProto.concat([dp, dp]),
        dp.select(deepcopy=True),
        replaced,
    ]


def test_every_new_batch_still_says_where_and_reads_old_names(tmp_path: Path) -> None:
    for copy in copies(make(), tmp_path):
        with pytest.raises(KeyError, match=r"'input_ids' is in batch\.batch"):
            copy.non_tensor_batch["input_ids"]
        with pytest.warns(DeprecationWarning):
            assert copy.non_tensor_batch["end_reason"] is copy.non_tensor_batch["end_reasons"]


def test_non_tensor_batch_pickles_as_a_plain_dict() -> None:
    columns: Any = pickle.loads(pickle.dumps(make().non_tensor_batch))
    assert type(columns) is dict and list(columns) == ["end_reasons"]
