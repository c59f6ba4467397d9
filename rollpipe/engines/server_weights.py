"""Weights to a vLLM server: a safetensors file its worker reads from the same path.

vLLM's ``/collective_rpc`` carries strings only, so ``ServerBackend`` writes the weights
with ``write_weights`` into a directory the server can see (a temporary one when the
server runs on this machine: ``is_local``) and asks the worker to reload from it.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from urllib.parse import urlsplit

import torch

__all__ = ["is_local", "write_weights"]


def is_local(url: str) -> bool:
    """Whether ``url`` names this machine (so the server reads the files we write)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def write_weights(named: list[tuple[str, torch.Tensor]], target: Path) -> None:
    """Save ``named`` as ``target/model.safetensors`` (tensors sharing storage, such as
    tied embeddings, are copied: safetensors refuses shared storage)."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in named:
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    target.mkdir(parents=True)
    save_file(tensors, str(target / "model.safetensors"))
