"""Checkpoint files that are either complete or refused: never half-loaded.

A run that checkpoints after each batch and may be killed at any moment (SIGKILL, a lost
node, a power cut) needs two things from its files: a kill mid-write must leave the
previous checkpoint untouched, and a file that is torn or corrupted anyway (a copy cut
short, a flipped bit) must be detected before any of it is used.

``save_checkpoint`` writes ``torch.save(state)`` to a temporary file beside the target
(``.NAME.partial``), fsyncs it, renames it over the target with ``os.replace`` (atomic
on POSIX and Windows) and fsyncs the directory, so the target name only ever points at
a complete file. The file frames the payload::

    header  b"RPCKPT\\r\\n"  format version (u32)  payload length (u64)  sha256 (32 bytes)
    payload torch.save(state)
    footer  b"RPCKEND\\n"

``load_checkpoint`` checks the frame, the length and the digest before it unpickles
anything (with ``torch.load(weights_only=True)``: plain data and tensors only) and
raises ``CheckpointError`` naming the file and what is wrong. ``save_step_checkpoint``
and ``latest_checkpoint`` keep numbered checkpoints in a directory (one writer per
directory) and find the newest complete one. docs/checkpointing.md has the rules.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import struct
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointWarning",
    "checkpoint_path",
    "latest_checkpoint",
    "load_checkpoint",
    "partial_path",
    "save_checkpoint",
    "save_step_checkpoint",
    "step_checkpoints",
    "verify_checkpoint",
]

FORMAT_VERSION = 1
MAGIC = b"RPCKPT\r\n"  # \r\n: a text-mode copy that rewrites line ends breaks the magic
FOOTER = b"RPCKEND\n"
_HEADER = struct.Struct("<8sIQ32s")  # magic, version, payload length, payload sha256
PARTIAL_SUFFIX = ".partial"
_STEP_NAME = re.compile(r"^checkpoint-(\d+)\.ckpt$")

ChunkHook = Callable[[int, int], None]


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used: torn, truncated, corrupted, not a
    checkpoint, or of a format version this rollpipe does not read.

    Examples:
        >>> import tempfile
        >>> path = save_checkpoint(Path(tempfile.mkdtemp()) / "run.ckpt", {"step": 3})
        >>> _ = path.write_bytes(path.read_bytes()[:-5])  # torn: its last 5 bytes lost
        >>> try:
        ...     load_checkpoint(path)
        ... except CheckpointError as e:
        ...     print(str(e).split(": ", 1)[1])
        truncated: ... bytes, its header says ...; it was not loaded
    """


class CheckpointWarning(UserWarning):
    """``latest_checkpoint`` passed over a numbered checkpoint that does not verify."""


def _frame(payload: bytes) -> tuple[bytes, bytes]:
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), hashlib.sha256(payload).digest())
    return header, FOOTER


def _payload_of(state: Mapping[str, Any]) -> bytes:
    """``torch.save(state)`` as bytes, refused now if ``torch.load(weights_only=True)``
    could not read it back (better at save time than after the crash it is kept for)."""
    if not isinstance(state, Mapping):
        raise TypeError(
            f"save_checkpoint: state must be a mapping (a state_dict()), got {type(state).__name__}"
        )
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    payload = buffer.getvalue()
    try:
        torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as e:
        why = [line.strip() for line in str(e).splitlines() if "Unpickler error" in line]
        reason = why[0].split(". Please")[0] if why else str(e)
        raise TypeError(
            "save_checkpoint: the state holds objects torch.load(weights_only=True) refuses "
            f"({reason}); keep only plain data (dicts, lists, str, numbers) and tensors"
        ) from e
    return payload


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # Windows: directories cannot be opened; its rename is durable enough
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def partial_path(path: str | os.PathLike[str]) -> Path:
    """The temporary file ``save_checkpoint(path, ...)`` writes before renaming it."""
    path = Path(path)
    return path.with_name(f".{path.name}{PARTIAL_SUFFIX}")


def save_checkpoint(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    chunk_bytes: int = 1 << 20,
    on_chunk: ChunkHook | None = None,
) -> Path:
    """Write ``state`` (a ``state_dict()``: plain data and tensors) to ``path`` atomically.

    Until this returns, ``path`` holds what it held before (or nothing); afterwards it
    holds the complete new file, on disk. ``on_chunk(written, total)`` is called after
    each ``chunk_bytes`` reach the temporary file (flushed to the OS), e.g. to observe
    or test a write cut short.

    Examples:
        >>> import tempfile, torch
        >>> d = Path(tempfile.mkdtemp())
        >>> _ = save_checkpoint(d / "run.ckpt", {"step": 3, "ids": torch.arange(3)})
        >>> load_checkpoint(d / "run.ckpt")
        {'step': 3, 'ids': tensor([0, 1, 2])}
    """
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"save_checkpoint: chunk_bytes must be an int >= 1, got {chunk_bytes!r}")
    path = Path(path)
    payload = _payload_of(state)
    header, footer = _frame(payload)
    data = memoryview(header + payload + footer)
    partial = partial_path(path)
    with open(partial, "wb") as f:
        for start in range(0, len(data), chunk_bytes):
            f.write(data[start : start + chunk_bytes])
            if on_chunk is not None:
                f.flush()
                on_chunk(min(start + chunk_bytes, len(data)), len(data))
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    _fsync_directory(path.parent)
    return path


def _read_payload(path: Path) -> bytes:
    """The payload of the checkpoint at ``path``, after checking its frame and digest."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: no such file") from None

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path}: {what}; it was not loaded")

    if len(data) < _HEADER.size:
        raise bad(f"truncated: {len(data)} bytes, shorter than the {_HEADER.size}-byte header")
    magic, version, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise bad(f"not a rollpipe checkpoint (starts with {data[:8]!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise bad(f"format version {version}; this rollpipe reads version {FORMAT_VERSION}")
    expected = _HEADER.size + length + len(FOOTER)
    if len(data) != expected:
        state = "truncated" if len(data) < expected else "has trailing bytes"
        raise bad(f"{state}: {len(data)} bytes, its header says {expected}")
    if data[-len(FOOTER) :] != FOOTER:
        raise bad(f"footer corrupted ({data[-len(FOOTER) :]!r}, expected {FOOTER!r})")
    payload = data[_HEADER.size : _HEADER.size + length]
    if hashlib.sha256(payload).digest() != digest:
        raise bad("corrupted: the payload's sha256 differs from the one in its header")
    return payload


def verify_checkpoint(path: str | os.PathLike[str]) -> None:
    """Raise ``CheckpointError`` unless ``path`` is a complete checkpoint (frame, length
    and sha256 checked; nothing unpickled)."""
    _read_payload(Path(path))


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The state saved at ``path``, or ``CheckpointError`` naming the file and what is
    wrong (torn, truncated, corrupted, another format). Nothing of a bad file is used.

    Examples:
        >>> import tempfile
        >>> path = save_checkpoint(Path(tempfile.mkdtemp()) / "run.ckpt", {"step": 3})
        >>> load_checkpoint(path)
        {'step': 3}
        >>> data = bytearray(path.read_bytes()); data[70] ^= 1; _ = path.write_bytes(data)
        >>> try:
        ...     load_checkpoint(path)
        ... except CheckpointError as e:
        ...     print(str(e).split(": ", 1)[1])
        corrupted: the payload's sha256 differs from the one in its header; it was not loaded
    """
    path = Path(path)
    payload = _read_payload(path)
    try:
        state = torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as e:  # digest fine, so written by something other than save_checkpoint
        raise CheckpointError(f"checkpoint {path}: its payload does not load ({e})") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path}: holds a {type(state).__name__}, not a dict")
    return state


# -- numbered checkpoints in a directory ---------------------------------------------
def checkpoint_path(directory: str | os.PathLike[str], step: int) -> Path:
    """``directory/checkpoint-STEP.ckpt``: the name ``save_step_checkpoint`` uses."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be an int >= 0, got {step!r}")
    return Path(directory) / f"checkpoint-{step:09d}.ckpt"


def step_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The numbered checkpoints in ``directory`` as ``(step, path)``, oldest first
    (complete or not; partial files are not listed)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(_STEP_NAME.match(p.name), p) for p in directory.iterdir()]
    return sorted((int(m.group(1)), p) for m, p in found if m is not None)


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete numbered checkpoint in ``directory``, or None if there is none.

    A numbered file that does not verify (torn, corrupted) is passed over with a
    ``CheckpointWarning`` naming it and what is wrong, and the one before it is tried.

    Examples:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> for step in range(3):
        ...     _ = save_step_checkpoint(d, step, {"step": step})
        >>> latest_checkpoint(d).name, [s for s, _ in step_checkpoints(d)]
        ('checkpoint-000000002.ckpt', [1, 2])
    """
    for _, path in reversed(step_checkpoints(directory)):
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            warnings.warn(f"{e}; trying the one before", CheckpointWarning, stacklevel=2)
            continue
        return path
    return None


def save_step_checkpoint(
    directory: str | os.PathLike[str],
    step: int,
    state: Mapping[str, Any],
    *,
    keep: int = 2,
    chunk_bytes: int = 1 << 20,
    on_chunk: ChunkHook | None = None,
) -> Path:
    """``save_checkpoint(checkpoint_path(directory, step), state)``, then prune.

    Afterwards the directory holds the ``keep`` newest checkpoints up to ``step``:
    older ones are deleted, and so are any numbered above ``step`` (left by a timeline
    this run abandoned when it resumed from an older checkpoint), as are partial files
    left by a writer that was killed. Keeping more than one guards against a complete
    file corrupted later (on disk, by a copy); a kill mid-write never needs it.

    Examples:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> for step in range(4):
        ...     _ = save_step_checkpoint(d, step, {"step": step}, keep=3)
        >>> _ = save_step_checkpoint(d, 2, {"step": 2, "again": True}, keep=3)  # resumed at 1
        >>> [s for s, _ in step_checkpoints(d)], load_checkpoint(latest_checkpoint(d))
        ([1, 2], {'step': 2, 'again': True})
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"save_step_checkpoint: keep must be an int >= 1, got {keep!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(directory, step)
    save_checkpoint(path, state, chunk_bytes=chunk_bytes, on_chunk=on_chunk)
    numbered = step_checkpoints(directory)
    kept = [p for s, p in numbered if s <= step][-keep:]
    for _, p in numbered:
        if p not in kept:
            p.unlink(missing_ok=True)
    for p in directory.glob(f".checkpoint-*{PARTIAL_SUFFIX}"):
        p.unlink(missing_ok=True)
    _fsync_directory(directory)
    return path
