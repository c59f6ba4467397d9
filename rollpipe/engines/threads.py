"""Torch threads for an engine's compute thread on CPU.

A tiny model gains nothing from intra-op parallelism, and OpenMP workers spin-waiting
on a busy machine slow every step down many times over, so engines compute with one
thread unless told otherwise; only their own thread (or child process) is affected.
"""

from __future__ import annotations

import os

import torch

from rollpipe._utils.checks import check_int

__all__ = ["resolve_cpu_threads", "set_thread_torch_threads"]

# vLLM's CPU worker replaces torch.set_num_threads with a no-op in its process; keep
# the real one so engines can set (and restore) it.
_TORCH_SET_NUM_THREADS = torch.set_num_threads


def resolve_cpu_threads(cpu_threads: int | None) -> int | None:
    """The torch threads an engine computes with on CPU.

    ``None`` means 1 unless ``OMP_NUM_THREADS`` is set (then torch's own setting is
    kept, and ``None`` is returned).
    """
    if cpu_threads is None:
        return None if "OMP_NUM_THREADS" in os.environ else 1
    return check_int("cpu_threads", cpu_threads, 1)


def set_thread_torch_threads(n: int | None) -> None:
    """Set torch's intra-op thread count for the calling thread only (OpenMP per-thread
    setting); ``None`` leaves it alone. Also undoes vLLM's no-op patch of the setter."""
    if torch.set_num_threads is not _TORCH_SET_NUM_THREADS:
        torch.set_num_threads = _TORCH_SET_NUM_THREADS
    if n is not None:
        _TORCH_SET_NUM_THREADS(n)
