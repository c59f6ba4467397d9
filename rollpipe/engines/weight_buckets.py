"""The layout of one weight update for a broadcast: named tensors packed into byte buckets.

``plan_message`` lays the tensors out (bucket, aligned byte offset, length) in a
``WeightsMessage``, the metadata each engine host gets before the broadcast;
``pack_bucket`` builds one bucket on the sender, ``unpack_buckets`` gives the receiver
views of its buckets as the named tensors. One collective per bucket, not per tensor
(``rollpipe.engines.weight_broadcast`` sends them).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

__all__ = ["TensorSpec", "WeightsMessage", "pack_bucket", "plan_message", "unpack_buckets"]

_ALIGN = 64  # bytes: every tensor starts aligned in its bucket, so its view can take its dtype


@attrs.frozen
class TensorSpec:
    """Where one named tensor lies in the broadcast: bucket, byte offset and length."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bucket: int
    offset: int
    nbytes: int


@attrs.frozen
class WeightsMessage:
    """The metadata each host gets (a Ray call) before the tensors are broadcast."""

    version: int
    tensors: tuple[TensorSpec, ...]
    bucket_bytes: tuple[int, ...]  # each bucket's length

    @property
    def nbytes(self) -> int:
        return sum(self.bucket_bytes)


def plan_message(
    named: Sequence[tuple[str, torch.Tensor]], version: int, bucket_bytes: int
) -> WeightsMessage:
    """Lay ``named`` out in byte buckets of at most ``bucket_bytes`` (a larger tensor
    gets a bucket of its own), in order, each tensor aligned.

    Examples:
        >>> named = [("a", torch.zeros(3)), ("b", torch.zeros(2, 2, dtype=torch.float16))]
        >>> message = plan_message(named, version=1, bucket_bytes=1 << 20)
        >>> [(s.name, s.bucket, s.offset, s.nbytes) for s in message.tensors]
        [('a', 0, 0, 12), ('b', 0, 64, 8)]
        >>> message.bucket_bytes, plan_message(named, 1, bucket_bytes=16).bucket_bytes
        ((72,), (12, 8))
    """
    specs: list[TensorSpec] = []
    sizes: list[int] = []
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        start = -(-sizes[-1] // _ALIGN) * _ALIGN if sizes else 0
        if not sizes or (start + nbytes > bucket_bytes and sizes[-1] > 0):
            sizes.append(0)
            start = 0
        sizes[-1] = start + nbytes
        specs.append(
            TensorSpec(name, tuple(tensor.shape), tensor.dtype, len(sizes) - 1, start, nbytes)
        )
    return WeightsMessage(version, tuple(specs), tuple(sizes))


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def pack_bucket(
    named: Sequence[tuple[str, torch.Tensor]],
    message: WeightsMessage,
    bucket: int,
    device: torch.device,
) -> torch.Tensor:
    """Bucket ``bucket`` of ``message`` as one flat uint8 tensor on ``device`` (a bucket of
    one contiguous tensor already there is that tensor's own bytes, not a copy)."""
    members = [
        (s, t) for s, (_, t) in zip(message.tensors, named, strict=True) if s.bucket == bucket
    ]
    size = message.bucket_bytes[bucket]
    if len(members) == 1 and members[0][1].device == device:
        data = _bytes_of(members[0][1])
        if data.numel() == size:
            return data
    buffer = torch.empty(size, dtype=torch.uint8, device=device)
    for spec, tensor in members:
        buffer[spec.offset : spec.offset + spec.nbytes].copy_(_bytes_of(tensor))
    return buffer


def unpack_buckets(
    buffers: Sequence[torch.Tensor], message: WeightsMessage
) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of ``message`` as views of the received ``buffers``.

    Examples:
        >>> named = [("a", torch.arange(3.0)), ("b", torch.ones(2, 2, dtype=torch.bfloat16))]
        >>> message = plan_message(named, version=1, bucket_bytes=1 << 20)
        >>> buffers = [pack_bucket(named, message, 0, torch.device("cpu"))]
        >>> [(n, t.tolist()) for n, t in unpack_buckets(buffers, message)]
        [('a', [0.0, 1.0, 2.0]), ('b', [[1.0, 1.0], [1.0, 1.0]])]
    """
    out = []
    for s in message.tensors:
        data = buffers[s.bucket][s.offset : s.offset + s.nbytes]
        out.append((s.name, data.view(s.dtype).view(s.shape)))
    return out
