"""A training driver that checkpoints after every batch, for the SIGKILL tests and the
fault campaign's ``sigkill`` points (``bench/driver_kill.py`` starts, kills and resumes it).

``python bench/driver_run.py WORKDIR --batches N --engine scripted|vllm`` runs a
``RolloutPipeline`` with a fixed seed. For each batch ``k`` it appends ``k DIGEST`` to
``WORKDIR/results.txt`` (fsynced), then saves ``{"batches": k + 1, "pipeline":
pipe.state_dict()}`` with ``save_step_checkpoint`` into ``WORKDIR/checkpoints``. On
start it resumes from ``latest_checkpoint`` if there is one, first cutting
``results.txt`` back to the batches that checkpoint covers (lines of batches whose
checkpoint never completed are the work a crash undoes; they are made again).

It reports each step on stdout, one flushed line each after the prefix ``@driver ``
(vLLM logs on stdout too), so a test can pick its kill moment from what the driver did
(never from elapsed time)::

    start RESUMED_FROM DROPPED     (-1: a fresh run; DROPPED results lines cut)
    batch K DIGEST                 (line K is on disk)
    saved K                        (checkpoint K is on disk)
    writing K WRITTEN TOTAL        (with --pause-in-write O:F, in the O-th checkpoint this
                                    run writes (0: its first), once F of it is written,
                                    or at its last chunk before the end if that comes
                                    first: the partial file holds WRITTEN < TOTAL bytes; the
                                    driver then blocks reading stdin until it is killed)
    holding                        (with --hold-at-end: the last batch's line is on disk;
                                    the driver blocks before its checkpoint, so a kill
                                    aimed earlier can never arrive after the run ended)
    done

``forked_main`` runs the same driver in a process forked from a ``multiprocessing``
fork server that has imported torch, transformers and rollpipe once (``PRELOAD``), so a
test can kill and restart a driver many times without paying those imports each time.

``batch_digest`` is the batch's content: every tensor and non-tensor column and the
metrics, leaving out the wall-clock ones (``time/``, ``throughput/``) and ``env_ids``:
the pooled env instance that ran an episode is whichever was free when it started, so
it follows completion order, not the seed (a resumed run starts with a new pool).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import multiprocessing.connection
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PRELOAD_SCRIPTED = ["torch", "transformers", "rollpipe.pipeline", "rollpipe.engines.scripted"]
PRELOAD_SCRIPTED += ["rollpipe.checkpoint", "transformers.models.auto.tokenization_auto", __name__]
PRELOAD = [*PRELOAD_SCRIPTED, "vllm", "vllm.engine.arg_utils", "vllm.v1.engine.async_llm"]
PRELOAD += ["rollpipe.engines.vllm"]
"""What the fork server imports once: ``PRELOAD_SCRIPTED`` for scripted drivers only."""
RESULTS = "results.txt"
CHECKPOINTS = "checkpoints"
SEED = 11
PREFIX = "@driver "
CHUNK_BYTES = 512  # the checkpoint is written in chunks this size, to pause between them
WALL_CLOCK = ("time/", "throughput/")
NOT_CONTENT = ("env_ids",)  # which pooled env instance ran it: scheduling, not the seed


def batch_digest(batch: Any) -> str:
    """sha256 of a DataProto's content, in a stable order: each tensor's key, dtype, shape
    and bytes; each non-tensor column's values; ``meta_info`` without wall-clock metrics.
    ``NOT_CONTENT`` columns are left out."""
    h = hashlib.sha256()
    keys = batch.batch.keys()  # not iter(batch.batch): a TensorDict iterates its rows
    for key in sorted(k for k in keys if k not in NOT_CONTENT):
        t = batch.batch[key].contiguous()
        h.update(f"T {key} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.numpy().tobytes())
    for key in sorted(k for k in batch.non_tensor_batch if k not in NOT_CONTENT):
        h.update(f"N {key} {batch.non_tensor_batch[key].tolist()!r}\n".encode())
    for key in sorted(batch.meta_info):
        value = batch.meta_info[key]
        if key == "metrics":
            value = sorted((k, v) for k, v in value.items() if not k.startswith(WALL_CLOCK))
        h.update(f"M {key} {value!r}\n".encode())
    return h.hexdigest()


def _say(line: str) -> None:
    sys.stdout.write(PREFIX + line + "\n")
    sys.stdout.flush()


def _hold() -> None:
    """Block until this process is killed, or until the test that started it is gone
    (stdin closes, or a forked driver's parent sentinel fires): never an orphan."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        multiprocessing.connection.wait([parent.sentinel])
    else:
        sys.stdin.read()
    raise SystemExit("the test that paused this driver is gone")


def _cut_results(path: Path, lines: int) -> int:
    """Cut ``path`` back to its first ``lines`` complete lines; the number cut (a torn
    last line counts). Fewer complete lines than ``lines`` means results were lost."""
    data = path.read_bytes() if path.exists() else b""
    ends = [i for i, b in enumerate(data) if b == ord("\n")]
    if len(ends) < lines:
        raise RuntimeError(
            f"{path} has {len(ends)} complete lines but the checkpoint covers {lines} "
            "batches: a result written before its checkpoint is missing"
        )
    keep = ends[lines - 1] + 1 if lines else 0
    dropped = len(data[keep:].splitlines())
    if keep < len(data):
        os.truncate(path, keep)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    return dropped


def _append(path: Path, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def _engine(kind: str) -> tuple[Any, Any, dict[str, Any]]:
    """(engine, tokenizer, sampling) for ``kind``: the tiny model on vLLM, or a scripted
    policy whose action is a hash of the prompt and the request's seed."""
    from transformers import AutoTokenizer

    from rollpipe.training.tiny_model import default_model_path

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if kind == "vllm":
        from rollpipe.engines.vllm import VLLMEngine

        engine = VLLMEngine(path, kv_cache_space_gib=1, max_model_len=2048, seed=0)
        return engine, tokenizer, {"max_tokens": 16, "temperature": 1.0}
    from rollpipe.engines.scripted import ScriptedEngine

    actions = [tokenizer.encode(f"<answer>{a}</answer>") for a in ("Left", "Down", "Right")]
    actions.append(tokenizer.encode("no idea"))  # an invalid action now and then

    def policy(prompt: Sequence[int], params: Any) -> list[int]:
        key = hashlib.sha256(repr((list(prompt), params.seed)).encode()).digest()
        return actions[key[0] % len(actions)]

    return ScriptedEngine(policy), tokenizer, {"max_tokens": 16, "temperature": 1.0}


def run(
    workdir: Path,
    batches: int,
    engine_kind: str,
    pause_in_write: str | None,
    hold_at_end: bool = False,
) -> None:
    """The driver: resume if a checkpoint exists, then make batches up to ``batches``."""
    from rollpipe.checkpoint import latest_checkpoint, load_checkpoint, save_step_checkpoint
    from rollpipe.pipeline import PipelineConfig, RolloutPipeline

    workdir.mkdir(parents=True, exist_ok=True)
    results, checkpoints = workdir / RESULTS, workdir / CHECKPOINTS
    engine, tokenizer, sampling = _engine(engine_kind)
    config = PipelineConfig(
        envs="frozenlake",
        group_size=2,
        batch_size=4,
        max_turns=3,
        max_length=512,
        concurrency=8,
        seed=SEED,
        async_generation_ratio=1,  # the next step's groups run while a checkpoint is taken
        sampling=sampling,
    )
    offset, fraction = (None, 0.0) if pause_in_write is None else pause_in_write.split(":")
    with RolloutPipeline(config, engine, tokenizer, owns_engine=True) as pipe:
        latest = latest_checkpoint(checkpoints)
        done, resumed = 0, -1
        if latest is not None:
            state = load_checkpoint(latest)
            pipe.load_state_dict(state["pipeline"])
            done = int(state["batches"])
            resumed = done - 1
        _say(f"start {resumed} {_cut_results(results, done)}")
        for k in range(done, batches):
            batch = pipe.get_batch()
            digest = batch_digest(batch)
            _append(results, f"{k} {digest}")
            _say(f"batch {k} {digest}")
            if hold_at_end and k == batches - 1:
                _say("holding")
                _hold()

            def on_chunk(written: int, total: int, k: int = k) -> None:
                at = offset is not None and done + int(offset) == k
                # at the first chunk past the fraction, or at the last chunk before the
                # end when none lies between them (a small file: fraction 0.9 of 4.6 kB
                # falls inside its last 512-byte chunk): always mid-write, never done
                last_before_end = written + CHUNK_BYTES >= total
                past = written >= float(fraction) * total or last_before_end
                if at and past and written < total:
                    _say(f"writing {k} {written} {total}")
                    _hold()  # the test kills the driver here, mid-write

            state = {"batches": k + 1, "pipeline": pipe.state_dict()}
            save_step_checkpoint(
                checkpoints, k, state, keep=2, chunk_bytes=CHUNK_BYTES, on_chunk=on_chunk
            )
            _say(f"saved {k}")
    _say("done")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--batches", type=int, required=True)
    parser.add_argument("--engine", choices=("scripted", "vllm"), default="scripted")
    parser.add_argument("--pause-in-write", metavar="O:F", default=None)
    parser.add_argument("--hold-at-end", action="store_true")
    args = parser.parse_args(argv)
    run(args.workdir, args.batches, args.engine, args.pause_in_write, args.hold_at_end)


def forked_main(argv: Sequence[str], out: Any, err_path: str) -> None:
    """``main(argv)`` in a forked child: stdout to the pipe end ``out`` (a
    ``multiprocessing`` connection's), stderr appended to ``err_path``."""
    os.dup2(out.fileno(), 1)
    out.close()
    err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(err, 2)
    os.close(err)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 (fd 1 lives as long as we do)
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    main(argv)


if __name__ == "__main__":
    main()
