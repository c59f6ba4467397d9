"""The broadcast's byte buckets (``rollpipe.engines.weight_broadcast``): whatever the
tensors and the bucket size, unpacking the packed buckets gives back every tensor
bitwise, with its name, shape and dtype, and no bucket exceeds the limit unless it holds
one tensor larger than it (and empty ones)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.engines.weight_broadcast import (
    BroadcastChannel,
    pack_bucket,
    plan_message,
    unpack_buckets,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]
CPU = torch.device("cpu")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@st.composite
def named_tensors(draw: st.DrawFn) -> list[tuple[str, torch.Tensor]]:
    n = draw(st.integers(1, 8))
    out = []
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        seed = draw(st.integers(0, 2**16))
        gen = torch.Generator().manual_seed(seed)
        t = (torch.rand(shape, generator=gen) * 100).to(dtype)
        if draw(st.booleans()) and t.dim() == 2:
            t = t.t()  # not contiguous: packed as its contiguous bytes
        out.append((f"w{i}", t))
    return out


@settings(max_examples=60, deadline=None)
@given(named=named_tensors(), bucket_bytes=st.integers(1, 256))
def test_unpacked_buckets_equal_the_tensors_bitwise(
    named: list[tuple[str, torch.Tensor]], bucket_bytes: int
) -> None:
    message = plan_message(named, version=3, bucket_bytes=bucket_bytes)
    buffers = [pack_bucket(named, message, b, CPU) for b in range(len(message.bucket_bytes))]
    assert [b.numel() for b in buffers] == list(message.bucket_bytes)
    back = unpack_buckets([b.clone() for b in buffers], message)
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, got), (_, want) in zip(back, named, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(as_bytes(got), as_bytes(want))
    for b, size in enumerate(message.bucket_bytes):
        held = [s for s in message.tensors if s.bucket == b and s.nbytes > 0]
        assert size <= bucket_bytes or len(held) == 1  # (empty tensors go anywhere)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1"])
def test_the_bucket_size_is_checked(bad: object) -> None:
    with pytest.raises(ValueError, match="bucket_bytes must be an int >= 1"):
        BroadcastChannel(bucket_bytes=bad)  # type: ignore[arg-type]
