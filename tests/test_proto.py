"""DataProto: construction, indexing, column operations, many-at-once, copies and pickling."""

from __future__ import annotations

import pickle

import numpy as np
import torch
from tensordict import TensorDict

from rollpipe.data.proto import DataProto
from rollpipe.data.proto.divisor import pad_dataproto_to_divisor, pad_to_divisor, unpad


def make(n: int = 4, **meta) -> DataProto:
    return DataProto.from_dict(
        tensors={"ids": torch.arange(n * 3).reshape(n, 3), "score": torch.linspace(0, 1, n)},
        non_tensors={"uid": [f"u{i % 2}" for i in range(n)], "turns": [[i, i] for i in range(n)]},
        meta_info=meta or {"temperature": 1.0},
    )


# ---------------------------------------------------------------- construction


def test_from_dict_keeps_equal_length_lists_one_per_row():
    dp = make(3)
    assert dp["turns"].shape == (3,) and dp["turns"].dtype == object
    assert dp["turns"][1] == [1, 1]
    assert len(dp) == 3 and dp.batch is not None and dp.batch.batch_size == (3,)


def test_from_dict_without_tensors_has_no_batch():
    dp = DataProto.from_dict(non_tensors={"uid": ["a", "b"]})
    assert dp.batch is None and len(dp) == 2
    assert DataProto().batch is None and len(DataProto()) == 0


def test_from_single_dict_splits_tensors_and_non_tensors():
    dp = DataProto.from_single_dict(
        {"x": torch.zeros(2, 3), "names": np.array(["a", "b"]), "raw": [{"k": 1}, None]},
        meta_info={"m": 1},
    )
    assert list(dp.batch.keys()) == ["x"]
    assert sorted(dp.non_tensor_batch) == ["names", "raw"]
    assert dp["names"].dtype == object and dp["raw"][0] == {"k": 1}
    assert dp.meta_info == {"m": 1}


def test_constructor_converts_numeric_arrays_to_object():
    dp = DataProto(TensorDict({}, batch_size=[3]), {"r": np.arange(3)})
    assert dp["r"].dtype == object and dp["r"].tolist() == [0, 1, 2]


def test_tensordict_layout_matches_verl():
    td = make(2).to_tensordict()
    assert type(td.get("uid")).__name__ == "NonTensorStack"
    assert type(td.get("temperature")).__name__ == "NonTensorData"
    back = DataProto.from_tensordict(td)
    assert back.meta_info == {"temperature": 1.0}
    assert back.equals(make(2))


# ---------------------------------------------------------------- rows


def test_int_index_gives_one_row_dataproto():
    dp = make(4)
    row = dp[-1]
    assert isinstance(row, DataProto) and len(row) == 1
    assert row["ids"].tolist() == [[9, 10, 11]] and list(row["uid"]) == ["u1"]
    assert dp[np.int64(2)]["score"].shape == (1,)
    assert dp[torch.tensor(0)]["ids"].tolist() == [[0, 1, 2]]


def test_index_kinds_agree():
    dp = make(5)
    by_list = dp[[4, 0]]
    assert by_list.equals(dp[np.array([4, 0])])
    assert by_list.equals(dp[torch.tensor([4, 0])])
    assert by_list.equals(dp.select_idxs([-1, -5]))
    assert dp[[True, False, True, False, False]]["ids"][:, 0].tolist() == [0, 6]
    assert dp[1:4:2]["ids"][:, 0].tolist() == [3, 9]
    assert dp[::-2]["ids"][:, 0].tolist() == [12, 6, 0]
    assert dp.slice(1, 3).equals(dp[1:3])
    assert len(dp[[]]) == 0


def test_string_index_gives_the_column():
    dp = make(2)
    assert torch.equal(dp["ids"], dp.batch["ids"])
    assert dp["uid"] is dp.non_tensor_batch["uid"]


def test_slices_are_views_and_select_idxs_copies():
    dp = make(3)
    dp[0:2]["ids"][0, 0] = 100
    assert dp["ids"][0, 0] == 100
    dp[[0]]["ids"][0, 0] = -1
    assert dp["ids"][0, 0] == 100


def test_reorder_in_place():
    dp = make(3)
    assert dp.reorder([2, 0, 1]) is None
    assert dp["ids"][:, 0].tolist() == [6, 0, 3]
    assert list(dp["turns"]) == [[2, 2], [0, 0], [1, 1]]


def test_iterating_yields_single_rows():
    assert [len(r) for r in make(3)] == [1, 1, 1]


# ---------------------------------------------------------------- columns


def test_select_none_means_all_and_shares_tensors():
    dp = make(2)
    sub = dp.select()
    assert sub.equals(dp) and sub["ids"].data_ptr() == dp["ids"].data_ptr()
    deep = dp.select(deepcopy=True)
    assert deep.equals(dp) and deep["ids"].data_ptr() != dp["ids"].data_ptr()


def test_select_no_columns_keeps_rows():
    dp = make(3).select(batch_keys=[], non_tensor_batch_keys=[], meta_info_keys=[])
    assert len(dp) == 3 and dp.keys() == [] and dp.meta_info == {}


def test_pop_default_pops_nothing():
    dp = make(2)
    popped = dp.pop()
    assert popped.keys() == [] and len(popped) == 2 and len(dp.keys()) == 4


def test_rename_batch_and_non_tensor_keys():
    dp = make(2).rename(["ids", "uid"], ["input_ids", "group"])
    assert sorted(dp.keys()) == ["group", "input_ids", "score", "turns"]


def test_union_adds_columns_and_meta():
    dp = make(3)
    other = DataProto.from_dict(
        tensors={"ids": dp["ids"].clone(), "adv": torch.ones(3)},
        non_tensors={"tag": ["x"] * 3},
        meta_info={"temperature": 1.0, "step": 5},
    )
    assert dp.union(other) is dp
    assert sorted(dp.keys()) == ["adv", "ids", "score", "tag", "turns", "uid"]
    assert dp.meta_info == {"temperature": 1.0, "step": 5}


def test_update_and_setitem_overwrite_and_move_columns():
    dp = make(2)
    dp["score"] = ["lo", "hi"]  # tensor column becomes a non-tensor one
    assert "score" in dp.non_tensor_batch and "score" not in dp.batch
    dp.update({"uid": torch.tensor([1, 2])})
    assert dp["uid"].tolist() == [1, 2] and "uid" not in dp.non_tensor_batch
    dp.update(DataProto.from_dict(tensors={"x": torch.zeros(2)}, meta_info={"temperature": 0.5}))
    assert dp.meta_info["temperature"] == 0.5 and "x" in dp


def test_update_empty_dataproto_adopts_row_count():
    dp = DataProto()
    dp["x"] = torch.zeros(4, 2)
    assert len(dp) == 4


# ---------------------------------------------------------------- many at once


def test_concat_merges_metrics_into_lists():
    a = make(2, temperature=1.0, metrics={"reward": 0.5, "len": 3})
    b = make(1, temperature=1.0, metrics={"reward": 1.0})
    c = make(1, temperature=1.0, metrics=[{"reward": 0.0}, {"len": 4}])
    out = DataProto.concat([a, b, c])
    assert out.meta_info == {
        "temperature": 1.0,
        "metrics": {"reward": [0.5, 1.0, 0.0], "len": [3, 4]},
    }
    again = DataProto.concat([out, make(1, temperature=1.0, metrics={"reward": 2.0})])
    assert again.meta_info["metrics"]["reward"] == [0.5, 1.0, 0.0, 2.0]


def test_chunk_sizes_follow_array_split():
    assert [len(p) for p in make(7).chunk(3)] == [3, 2, 2]
    assert [len(p) for p in make(7).split(3)] == [3, 3, 1]
    assert [len(p) for p in make(0).split(3)] == [0]


def test_pad_to_divisor_noop_and_verl_alias():
    dp = make(4)
    padded, pad = pad_to_divisor(dp, 2)
    assert pad == 0 and padded is dp
    assert pad_dataproto_to_divisor is pad_to_divisor
    padded, pad = pad_to_divisor(make(2), 7)  # more pad rows than rows: cycle from the start
    assert pad == 5 and padded["ids"][:, 0].tolist() == [0, 3, 0, 3, 0, 3, 0]
    with_metrics = make(3, metrics={"reward": 1.0})
    padded, pad = pad_to_divisor(with_metrics, 4)
    assert padded.meta_info == {"metrics": {"reward": 1.0}}
    assert unpad(padded, pad).equals(with_metrics)


def test_iter_minibatches_unshuffled_order_and_seed_dependence():
    dp = make(5)
    ordered = [b["ids"][:, 0].tolist() for b in dp.iter_minibatches(2, shuffle=False)]
    assert ordered == [[0, 3], [6, 9], [12]]
    dp = make(20)
    orders = {
        seed: [b["ids"][:, 0].tolist() for b in dp.iter_minibatches(20, seed=seed)]
        for seed in (0, 1)
    }
    assert orders[0] != orders[1]


# ---------------------------------------------------------------- copies, devices, disk


def test_clone_is_deep():
    dp = make(2)
    twin = dp.clone()
    twin["ids"][0, 0] = 99
    twin["turns"][0].append(7)
    twin.meta_info["temperature"] = 0.1
    assert dp["ids"][0, 0] == 0 and dp["turns"][0] == [0, 0] and dp.meta_info["temperature"] == 1.0


def test_to_device_in_place():
    dp = make(2)
    assert dp.to("cpu") is dp and dp.batch.device == torch.device("cpu")


def test_pickle_uses_one_consolidated_buffer():
    dp = DataProto.from_dict(tensors={f"t{i}": torch.zeros(4, 1000) for i in range(5)})
    payload = pickle.dumps(dp)
    data_bytes = 5 * 4 * 1000 * 4
    assert data_bytes < len(payload) < data_bytes * 1.1  # the tensors are stored once
    back = pickle.loads(payload)
    assert back.batch.is_consolidated() and not dp.batch.is_consolidated()
