"""DataProto errors: every invalid call raises with a message naming the key and the sizes."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rollpipe.data.proto import DataProto
from rollpipe.data.proto.columns import object_array
from rollpipe.data.proto.divisor import pad_to_divisor, unpad


def make(n: int = 4, **meta) -> DataProto:
    return DataProto.from_dict(
        tensors={"ids": torch.arange(n * 3).reshape(n, 3), "score": torch.linspace(0, 1, n)},
        non_tensors={"uid": [f"u{i % 2}" for i in range(n)], "turns": [[i, i] for i in range(n)]},
        meta_info=meta or {"temperature": 1.0},
    )


def test_err_from_dict_mismatched_rows():
    with pytest.raises(ValueError, match="column 'b' has 3 rows but 'a' has 2"):
        DataProto.from_dict(tensors={"a": torch.zeros(2), "b": torch.zeros(3)})


def test_err_from_dict_non_tensor_rows():
    with pytest.raises(ValueError, match="column 'uid' has 1 rows but 'a' has 2"):
        DataProto.from_dict(tensors={"a": torch.zeros(2)}, non_tensors={"uid": ["x"]})


def test_err_from_dict_value_not_a_tensor():
    with pytest.raises(ValueError, match=r"tensors\['a'\] is a list, not a tensor"):
        DataProto.from_dict(tensors={"a": [1, 2]})


def test_err_zero_dim_tensor():
    with pytest.raises(ValueError, match="column 'a' is 0-d"):
        DataProto.from_dict(tensors={"a": torch.tensor(1.0)})


def test_err_key_in_both_kinds():
    with pytest.raises(ValueError, match="key 'a' is in both tensors and non_tensors"):
        DataProto.from_dict(tensors={"a": torch.zeros(2)}, non_tensors={"a": [1, 2]})
    with pytest.raises(ValueError, match="key 'a' is in both batch and non_tensor_batch"):
        DataProto(TensorDict({"a": torch.zeros(2)}, [2]), {"a": [1, 2]})


def test_err_batch_without_batch_dim():
    with pytest.raises(ValueError, match=r"exactly one batch dimension, got batch_size=\[\]"):
        DataProto(TensorDict({"a": torch.zeros(2)}, batch_size=[]))


def test_err_batch_not_a_tensordict():
    with pytest.raises(
        ValueError, match=re.escape("batch must be a tensordict.TensorDict or None, got dict")
    ):
        DataProto({"a": torch.zeros(2)})  # type: ignore[arg-type]


def test_err_two_dim_object_array():
    trap = np.array([[1, 2], [3, 4]], dtype=object)
    with pytest.raises(ValueError, match=r"'turns' must be a 1-D array .* got shape \(2, 2\)"):
        DataProto(non_tensor_batch={"turns": trap})
    assert DataProto(non_tensor_batch={"turns": object_array([[1, 2], [3, 4]])})["turns"].shape == (
        2,
    )


def test_err_non_tensor_scalar():
    with pytest.raises(ValueError, match="non-tensor column 'step' must be a numpy array"):
        DataProto.from_single_dict({"x": torch.zeros(2), "step": 3})


def test_err_check_consistency_after_mutation():
    dp = make(2)
    dp.non_tensor_batch["uid"] = object_array(["a", "b", "c"])
    with pytest.raises(
        ValueError, match=r"non_tensor_batch\['uid'\] has 3 rows but the DataProto has 2"
    ):
        dp.check_consistency()
    dp.non_tensor_batch["uid"] = np.array(["a", "b"])
    with pytest.raises(
        ValueError, match=r"non_tensor_batch\['uid'\] must be a 1-D numpy object array"
    ):
        dp.check_consistency()


def test_err_int_index_out_of_range():
    with pytest.raises(IndexError, match="row index 5 is out of range for a DataProto with 3 rows"):
        make(3)[5]


def test_err_list_index_out_of_range():
    with pytest.raises(
        IndexError, match="row index -4 is out of range for a DataProto with 3 rows"
    ):
        make(3)[[0, -4]]


def test_err_bool_mask_wrong_length():
    with pytest.raises(IndexError, match="bool mask has 2 entries but the DataProto has 3 rows"):
        make(3)[np.array([True, False])]


def test_err_float_indices():
    with pytest.raises(
        IndexError, match=r"row indices must be integers or bools, got \[0\.5\] \(dtype float"
    ):
        make(3)[np.array([0.5])]


def test_err_unsupported_index_type():
    with pytest.raises(IndexError, match=r"cannot index rows with 1\.5 \(float\)"):
        make(3)[1.5]


def test_err_unknown_column():
    with pytest.raises(KeyError, match="no column 'nope'; columns are"):
        make(2)["nope"]


def test_err_select_unknown_keys():
    with pytest.raises(KeyError, match="batch key 'nope' not found; batch keys are"):
        make(2).select(batch_keys=["nope"])
    with pytest.raises(KeyError, match="non_tensor_batch key 'x' not found"):
        make(2).select(non_tensor_batch_keys="x")
    with pytest.raises(KeyError, match="meta_info key 'step' not found"):
        make(2).pop(meta_info_keys=["step"])


def test_err_pop_is_atomic():
    dp = make(2)
    with pytest.raises(KeyError, match="non_tensor_batch key 'missing' not found"):
        dp.pop(batch_keys=["ids"], non_tensor_batch_keys=["missing"])
    assert "ids" in dp  # nothing was removed


def test_err_rename():
    with pytest.raises(KeyError, match="cannot rename 'x': no such column"):
        make(2).rename("x", "y")
    with pytest.raises(ValueError, match="cannot rename 'ids' to 'uid': 'uid' exists"):
        make(2).rename("ids", "uid")
    with pytest.raises(
        ValueError, match=r"rename got 2 old_keys \['ids', 'uid'\] but 1 new_keys \['a'\]"
    ):
        make(2).rename(["ids", "uid"], ["a"])


def test_err_union_row_counts():
    with pytest.raises(
        ValueError, match="union needs equal row counts: this DataProto has 3 rows, the other 2"
    ):
        make(3).union(make(2))


def test_err_union_conflicting_column():
    other = make(2)
    other["ids"] = other["ids"] + 1
    with pytest.raises(ValueError, match="union conflict on column 'ids'"):
        make(2).union(other)


def test_err_union_conflicting_meta():
    with pytest.raises(
        ValueError, match=re.escape("union conflict on meta_info key 'temperature': 1.0 vs 0.5")
    ):
        make(2).union(make(2, temperature=0.5))


def test_err_update_wrong_rows():
    with pytest.raises(ValueError, match="column 'z' has 3 rows but the DataProto has 2"):
        make(2).update({"z": torch.zeros(3)})


def test_err_concat_empty():
    with pytest.raises(ValueError, match="concat needs at least one DataProto"):
        DataProto.concat([])


def test_err_concat_mismatched_keys():
    with pytest.raises(
        ValueError,
        match=r"concat part 1 has batch keys \[.ids.\] but part 0 has .*\(missing \[.score.\]",
    ):
        DataProto.concat([make(2), make(2).select(batch_keys=["ids"])])


def test_err_concat_mismatched_widths():
    wide = make(2)
    wide["ids"] = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(
        ValueError, match=r"batch key 'ids' is \(2, 5\) torch.int64 in part 1 but \(2, 3\)"
    ):
        DataProto.concat([make(2), wide])


def test_err_concat_conflicting_meta():
    with pytest.raises(
        ValueError,
        match=re.escape("meta_info key 'temperature' conflicts: part 0 has 1.0 but part 2 has 0.7"),
    ):
        DataProto.concat([make(1), make(1), make(1, temperature=0.7)])


def test_err_concat_bad_metrics():
    with pytest.raises(ValueError, match=r"meta_info\['metrics'\] of part 1 must be a dict"):
        DataProto.concat([make(1, metrics={"a": 1}), make(1, metrics=3)])


def test_err_concat_not_dataproto():
    with pytest.raises(ValueError, match="concat part 1 is a dict, not a DataProto"):
        DataProto.concat([make(1), {}])  # type: ignore[list-item]


def test_err_more_chunks_than_rows():
    with pytest.raises(ValueError, match="cannot split 3 rows into 5 chunks"):
        make(3).chunk(5)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda dp: dp.chunk(0), "chunks must be an int >= 1, got 0"),
        (lambda dp: dp.split(0), "split_size must be an int >= 1, got 0"),
        (lambda dp: dp.repeat(0), "repeat_times must be an int >= 1, got 0"),
        (lambda dp: dp.iter_minibatches(0), "batch_size must be an int >= 1, got 0"),
        (lambda dp: dp.iter_minibatches(2, epochs=0), "epochs must be an int >= 1, got 0"),
        (lambda dp: pad_to_divisor(dp, 0), "size_divisor must be an int >= 1, got 0"),
        (lambda dp: unpad(dp, -1), "pad_size must be an int >= 0, got -1"),
        (lambda dp: dp.slice(0, 2, 0), r"slice step must not be 0, got slice\(0, 2, 0\)"),
    ],
)
def test_err_bad_counts(call, message):
    with pytest.raises(ValueError, match=message):
        call(make(3))


def test_err_sample_level_repeat():
    with pytest.raises(ValueError, match="one count per row: got 2 counts for 3 rows"):
        make(3).sample_level_repeat([1, 2])
    with pytest.raises(ValueError, match="repeat counts must be non-negative ints"):
        make(3).sample_level_repeat([1, -1, 0])


def test_err_reorder_not_a_permutation():
    with pytest.raises(
        ValueError, match="permutation of all 3 rows, got 3 indices with 2 distinct"
    ):
        make(3).reorder([0, 0, 1])


def test_err_group_by():
    with pytest.raises(KeyError, match="group_by key 'nope' not found"):
        make(2).group_by("nope")
    dp = DataProto.from_dict(non_tensors={"d": [{"a": 1}, {"a": 2}]})
    with pytest.raises(ValueError, match="group_by key 'd' holds an unhashable dict at row 0"):
        dp.group_by("d")


def test_err_pad_and_unpad_sizes():
    assert pad_to_divisor(make(0), 4)[1] == 0  # 0 rows is already a multiple
    with pytest.raises(ValueError, match="pad_size=5 is larger than the DataProto's 3 rows"):
        unpad(make(3), 5)


def test_err_minibatch_drop_last_would_yield_nothing():
    with pytest.raises(
        ValueError, match="batch_size=8 is larger than the 3 rows, so drop_last=True"
    ):
        make(3).iter_minibatches(8, drop_last=True)
    with pytest.raises(ValueError, match="derive_seed part 0 must be a non-negative int"):
        make(3).iter_minibatches(2, seed=-1)


def test_err_to_tensordict_meta_key_is_a_column():
    dp = make(2, uid="clash")
    with pytest.raises(ValueError, match="meta_info key 'uid' is also a column"):
        dp.to_tensordict()


def test_err_from_tensordict_needs_one_batch_dim():
    with pytest.raises(ValueError, match=r"one batch dimension, got batch_size=\[\]"):
        DataProto.from_tensordict(TensorDict({"a": torch.zeros(2)}, batch_size=[]))


def test_err_load_wrong_object(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"a": 1}, path)
    with pytest.raises(ValueError, match="holds a dict, not a DataProto"):
        DataProto.load(path)
