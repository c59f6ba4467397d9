"""Checkpoint files (rollpipe.checkpoint) are complete or refused, never half-loaded.

Torn files (hypothesis: cut at any length, any bit flipped, bytes added, another
format) raise ``CheckpointError`` naming the file and what is wrong, and
``latest_checkpoint`` falls back to the complete one before; a write in progress leaves
the target as it was; numbered checkpoints are pruned to ``keep``. The states are a real
pipeline's (``RolloutPipeline.state_dict()`` with specs in flight) plus a tensor. The
SIGKILL tests of a whole driver are in ``tests/distributed/test_driver_kill.py``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollpipe.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    partial_path,
    save_checkpoint,
    save_step_checkpoint,
    step_checkpoints,
    verify_checkpoint,
)
from rollpipe.engines.scripted import ScriptedEngine
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

FIXTURE_OK = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> tuple[Path, bytes, dict]:
    """A directory with two complete checkpoints of a real pipeline state (specs in flight
    included, and a tensor); the newest one's bytes and state."""
    answer = tokenizer.encode("<answer>Right</answer>")
    config = PipelineConfig(
        envs="frozenlake", group_size=2, batch_size=4, max_turns=3, seed=5,
        async_generation_ratio=1,
    )  # fmt: skip
    directory = tmp_path_factory.mktemp("torn")
    engine = ScriptedEngine(lambda *_: answer)
    with RolloutPipeline(config, engine, tokenizer, owns_engine=True) as pipe:
        for step in range(2):
            pipe.get_batch()
            state = {"step": step, "pipeline": pipe.state_dict(), "w": torch.randn(64)}
            path = save_step_checkpoint(directory, step, state)
    assert state["pipeline"]["loader"]["root"]  # a real, nested state
    return directory, path.read_bytes(), state


def same(a: object, b: object) -> bool:
    """Equal nested data, tensors compared bitwise (dtype included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        both = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return both and a.dtype == b.dtype and torch.equal(a, b)  # type: ignore[union-attr,arg-type]
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def assert_refused(directory: Path, torn: bytes) -> str:
    """Put ``torn`` in place of the newest checkpoint: it is refused, and the one before
    is the latest complete one (with a warning naming the torn one). The message."""
    newest = checkpoint_path(directory, 1)
    newest.write_bytes(torn)
    with pytest.raises(CheckpointError, match=f"checkpoint {newest}: .*; it was not loaded") as e:
        load_checkpoint(newest)
    with pytest.raises(CheckpointError):
        verify_checkpoint(newest)
    with pytest.warns(CheckpointWarning, match=newest.name):
        assert latest_checkpoint(directory) == checkpoint_path(directory, 0)
    assert load_checkpoint(checkpoint_path(directory, 0))["step"] == 0
    return str(e.value)


@FIXTURE_OK
@given(data=st.data())
def test_a_truncated_checkpoint_is_refused(saved: tuple[Path, bytes, dict], data: Any) -> None:
    directory, good, _ = saved
    length = data.draw(st.integers(0, len(good) - 1), label="length")
    message = assert_refused(directory, good[:length])
    assert "truncated" in message or "not a rollpipe checkpoint" in message  # cut in the magic


@FIXTURE_OK
@given(data=st.data())
def test_a_flipped_bit_is_refused(saved: tuple[Path, bytes, dict], data: Any) -> None:
    directory, good, _ = saved
    torn = bytearray(good)
    byte = data.draw(st.integers(0, len(good) - 1), label="byte")
    torn[byte] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    assert_refused(directory, bytes(torn))


def test_extra_bytes_and_other_files_are_refused(saved: tuple[Path, bytes, dict]) -> None:
    directory, good, state = saved
    assert "trailing bytes" in assert_refused(directory, good + b"\0")
    assert "not a rollpipe checkpoint" in assert_refused(directory, b"PK\x03\x04" + good[4:])
    version = bytearray(good)
    version[8] = 9  # the format version's low byte
    assert "format version 9" in assert_refused(directory, bytes(version))
    checkpoint_path(directory, 1).write_bytes(good)  # whole again: loads equal, no warning
    assert same(load_checkpoint(checkpoint_path(directory, 1)), state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert latest_checkpoint(directory) == checkpoint_path(directory, 1)


def test_a_write_in_progress_leaves_the_target_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    save_checkpoint(path, {"step": 0})
    seen: list[tuple[int, int, dict]] = []

    def during(written: int, total: int) -> None:  # between two chunks of the new file
        assert partial_path(path).stat().st_size == written
        seen.append((written, total, load_checkpoint(path)))

    state = {"step": 1, "w": torch.arange(1000)}
    save_checkpoint(path, state, chunk_bytes=1000, on_chunk=during)
    assert len(seen) > 2 and all(old == {"step": 0} for *_, old in seen)
    assert seen[-1][0] == seen[-1][1]  # the last call: everything written, not yet renamed
    assert same(load_checkpoint(path), state) and not partial_path(path).exists()


def test_a_state_weights_only_cannot_read_is_refused_at_save(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"weights_only=True\) refuses .*plain data"):
        save_checkpoint(tmp_path / "run.ckpt", {"env": object()})
    assert not list(tmp_path.iterdir())  # nothing written, not even a partial file
    with pytest.raises(TypeError, match="state must be a mapping"):
        save_checkpoint(tmp_path / "run.ckpt", [1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda d: save_step_checkpoint(d, 0, {}, keep=0), "keep must be an int >= 1, got 0"),
        (lambda d: save_step_checkpoint(d, -1, {}), "step must be an int >= 0, got -1"),
        (lambda d: save_checkpoint(d / "x", {}, chunk_bytes=0), "chunk_bytes must be an int"),
    ],
)
def test_bad_arguments_name_the_field(tmp_path: Path, call: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(tmp_path)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=f"checkpoint {tmp_path / 'nope.ckpt'}: no such"):
        load_checkpoint(tmp_path / "nope.ckpt")
    assert latest_checkpoint(tmp_path / "absent") is None


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.integers(0, 12), min_size=1, max_size=12), keep=st.integers(1, 3))
def test_numbered_checkpoints_keep_the_newest_up_to_the_last_saved(
    tmp_path_factory: pytest.TempPathFactory, steps: list[int], keep: int
) -> None:
    """Saving step s (going back included: a resume from an older one) leaves the
    ``keep`` newest of the saved steps up to s; the latest is s's, with s's state."""
    directory = tmp_path_factory.mktemp("steps")
    partial_path(checkpoint_path(directory, 99)).write_bytes(b"left by a killed writer")
    model: list[int] = []
    for s in steps:
        save_step_checkpoint(directory, s, {"step": s}, keep=keep)
        model = sorted({x for x in model if x <= s} | {s})[-keep:]
        assert [x for x, _ in step_checkpoints(directory)] == model
        latest = latest_checkpoint(directory)
        assert latest is not None and load_checkpoint(latest) == {"step": s}
    assert not list(directory.glob(".*.partial"))
