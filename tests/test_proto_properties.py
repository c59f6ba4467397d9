"""hypothesis properties of DataProto: row and column operations that must round-trip."""

from __future__ import annotations

import pickle
import tempfile
from pathlib import Path

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.data.proto import DataProto
from rollpipe.data.proto.divisor import pad_to_divisor, unpad

SETTINGS = settings(max_examples=50, deadline=None)


@st.composite
def protos(draw, min_rows: int = 0, max_rows: int = 9) -> DataProto:
    """DataProtos with int and float tensors, strings, ragged lists and meta_info."""
    n = draw(st.integers(min_rows, max_rows))
    width = draw(st.integers(1, 4))
    ints = st.integers(-50, 50)
    ids = draw(st.lists(st.lists(ints, min_size=width, max_size=width), min_size=n, max_size=n))
    scores = draw(st.lists(st.floats(-1, 1, width=32), min_size=n, max_size=n))
    uids = draw(st.lists(st.sampled_from("abc"), min_size=n, max_size=n))
    ragged = draw(st.lists(st.lists(ints, max_size=3), min_size=n, max_size=n))
    return DataProto.from_dict(
        tensors={
            "ids": torch.tensor(ids, dtype=torch.long).reshape(n, width),
            "score": torch.tensor(scores, dtype=torch.float32),
            "row": torch.arange(n),
        },
        non_tensors={"uid": uids, "ragged": ragged},
        meta_info={"temperature": 1.0, "step": draw(st.integers(0, 3))},
    )


@SETTINGS
@given(dp=protos(), size=st.integers(1, 10))
def test_concat_of_split_is_identity(dp, size):
    parts = dp.split(size)
    assert all(len(p) == size for p in parts[:-1])
    assert DataProto.concat(parts).equals(dp)


@SETTINGS
@given(dp=protos(min_rows=1), data=st.data())
def test_chunk_then_concat_is_identity(dp, data):
    chunks = data.draw(st.integers(1, len(dp)))
    parts = dp.chunk(chunks)
    assert [len(p) for p in parts] == [len(a) for a in np.array_split(np.arange(len(dp)), chunks)]
    assert DataProto.concat(parts).equals(dp)


@SETTINGS
@given(dp=protos(), data=st.data())
def test_select_pop_union_round_trip(dp, data):
    bkeys = data.draw(st.lists(st.sampled_from(["ids", "score", "row"]), unique=True))
    nkeys = data.draw(st.lists(st.sampled_from(["uid", "ragged"]), unique=True))
    mkeys = data.draw(st.lists(st.sampled_from(["temperature", "step"]), unique=True))
    selected = dp.select(bkeys, nkeys, mkeys)
    assert sorted(selected.keys()) == sorted(bkeys + nkeys)
    assert len(selected) == len(dp)

    rest = dp.clone()
    popped = rest.pop(bkeys, nkeys, mkeys)
    assert popped.equals(selected)
    assert not set(rest.keys()) & set(popped.keys())
    assert rest.union(popped).equals(dp)

    # union of two overlapping selections is the whole again
    left = dp.select(bkeys, nkeys, mkeys)
    assert left.union(dp.select()).equals(dp)


@SETTINGS
@given(dp=protos(min_rows=1), k=st.integers(1, 12))
def test_pad_to_divisor_then_unpad(dp, k):
    padded, pad_size = pad_to_divisor(dp, k)
    assert len(padded) % k == 0
    assert 0 <= pad_size < k
    assert len(padded) == len(dp) + pad_size
    # pad rows repeat the rows from the start, as verl does
    assert padded["row"].tolist() == [i % len(dp) for i in range(len(padded))]
    assert unpad(padded, pad_size).equals(dp)


@SETTINGS
@given(dp=protos(), times=st.integers(1, 4), interleave=st.booleans())
def test_repeat_row_order(dp, times, interleave):
    out = dp.repeat(times, interleave=interleave)
    n = len(dp)
    expected = [i // times if interleave else i % n for i in range(n * times)]
    assert out["row"].tolist() == expected
    assert list(out["uid"]) == [dp["uid"][i] for i in expected]
    assert list(out["ragged"]) == [dp["ragged"][i] for i in expected]


@SETTINGS
@given(dp=protos(), data=st.data())
def test_sample_level_repeat_counts(dp, data):
    counts = data.draw(st.lists(st.integers(0, 3), min_size=len(dp), max_size=len(dp)))
    out = dp.sample_level_repeat(counts)
    assert out["row"].tolist() == [i for i, c in enumerate(counts) for _ in range(c)]


@SETTINGS
@given(dp=protos(), by_tensor=st.booleans())
def test_group_by_partitions_rows_exactly(dp, by_tensor):
    if by_tensor:
        dp["bucket"] = dp["row"] % 3
    groups = dp.group_by("bucket" if by_tensor else "uid")
    rows = sorted(r for g in groups.values() for r in g["row"].tolist())
    assert rows == list(range(len(dp)))  # every row exactly once
    for key, group in groups.items():
        assert len(group) > 0
        assert group["row"].tolist() == sorted(group["row"].tolist())  # order kept
        values = group["bucket"].tolist() if by_tensor else list(group["uid"])
        assert values == [key] * len(group)


@SETTINGS
@given(dp=protos(), k=st.integers(1, 4))
def test_group_by_two_keys_gives_tuples(dp, k):
    dp["mod"] = dp["row"] % k
    groups = dp.group_by(["uid", "mod"])
    assert sum(len(g) for g in groups.values()) == len(dp)
    for (uid, mod), group in groups.items():
        assert set(group["uid"]) == {uid} and set(group["mod"].tolist()) == {mod}


@SETTINGS
@given(dp=protos())
def test_pickle_round_trip_equal(dp):
    back = pickle.loads(pickle.dumps(dp))
    assert back.equals(dp)
    assert back.batch is not None and back.batch.is_consolidated()
    assert all(col.ndim == 1 and col.dtype == object for col in back.non_tensor_batch.values())


@settings(max_examples=15, deadline=None)
@given(dp=protos())
def test_save_load_round_trip_equal(dp):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "batch.pt"
        dp.save(path)
        assert DataProto.load(path).equals(dp)


@SETTINGS
@given(dp=protos())
def test_tensordict_round_trip_equal(dp):
    assert DataProto.from_tensordict(dp.to_tensordict()).equals(dp)


@SETTINGS
@given(dp=protos(), data=st.data())
def test_select_idxs_matches_numpy(dp, data):
    n = len(dp)
    idx = data.draw(st.lists(st.integers(-n, n - 1), max_size=12)) if n else []
    out = dp.select_idxs(idx)
    expected = np.arange(n)[np.asarray(idx, dtype=np.int64)].tolist()
    assert out["row"].tolist() == expected
    assert list(out["ragged"]) == [dp["ragged"][i] for i in expected]
    mask = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    assert dp[np.array(mask, dtype=bool)]["row"].tolist() == [i for i in range(n) if mask[i]]


@SETTINGS
@given(
    dp=protos(min_rows=1),
    size=st.integers(1, 5),
    epochs=st.integers(1, 3),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**20),
)
def test_iter_minibatches_cover_each_row_once_per_epoch(dp, size, epochs, drop_last, seed):
    if drop_last and size > len(dp):
        return
    batches = list(dp.iter_minibatches(size, seed=seed, epochs=epochs, drop_last=drop_last))
    per_epoch = len(dp) // size if drop_last else -(-len(dp) // size)
    assert len(batches) == per_epoch * epochs
    for e in range(epochs):
        rows = [r for b in batches[e * per_epoch : (e + 1) * per_epoch] for r in b["row"].tolist()]
        assert len(rows) == len(set(rows))
        assert len(rows) == (len(dp) - len(dp) % size if drop_last else len(dp))
    again = list(dp.iter_minibatches(size, seed=seed, epochs=epochs, drop_last=drop_last))
    assert [b["row"].tolist() for b in again] == [b["row"].tolist() for b in batches]
    assert all(b.meta_info == dp.meta_info for b in batches)
