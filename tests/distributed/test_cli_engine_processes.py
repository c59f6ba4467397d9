"""``rollpipe run --engines 2`` as a user runs it: a fresh interpreter whose vLLM engines
each run their engine core in a process of their own (the rest of the command's tests are
in ``tests/test_cli.py``)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_run_on_two_engines_in_their_own_processes(tmp_path):
    """``rollpipe run --engines 2``: a pool of two multiprocess vLLM engines, as a user
    runs it (a fresh interpreter: vLLM spawns each engine core)."""
    out = tmp_path / "out"
    args = ["--engines", "2", "--batches", "2", "--batch-size", "8", "--group-size", "4"]
    result = subprocess.run(
        [sys.executable, "-m", "rollpipe", "run", *args, "--max-turns", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "2 vllm engines" in result.stdout and "total" in result.stdout
    records = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(records) == 16 and len({r["traj_uid"] for r in records}) == 16
