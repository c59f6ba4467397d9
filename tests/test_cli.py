"""The ``rollpipe`` command: run (HF engine here; the demo session runs vLLM), inspect, errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from rollpipe.cli import LEGEND, SUMMARY_COLUMNS, main


def test_run_saves_batches_and_inspect_reads_them(tmp_path, tiny_model_path, capsys):
    out = tmp_path / "out"
    code = main(
        [
            "run",
            "--engine",
            "hf",
            "--model",
            str(tiny_model_path),
            "--batches",
            "2",
            "--batch-size",
            "4",
            "--group-size",
            "2",
            "--max-turns",
            "2",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert "total" in printed and "tokens/s" in printed
    rows = {
        cells[0]: cells
        for line in printed.splitlines()
        if len(cells := [c.strip() for c in line.strip("│ ").split("│")]) == 8
    }
    # the total's tokens/s is over the time in get_batch, like each batch's (start-up is
    # in the caption): not the whole run's wall time, which made it 4x lower than theirs
    tokens, wait = (sum(float(rows[b][i]) for b in ("0", "1")) for i in (5, 7))
    total_tokens, total_rate, total_wait = (float(rows["total"][i]) for i in (5, 6, 7))
    assert total_tokens == tokens
    assert total_wait == pytest.approx(wait, abs=0.011)  # each shown to 0.01 s
    # the rate is tokens over the unrounded wait, which lies within 0.005 s of the shown one
    fastest, slowest = tokens / max(total_wait - 0.005, 1e-3), tokens / (total_wait + 0.005)
    assert slowest - 0.5 <= total_rate <= fastest + 0.5
    lines = printed.splitlines()
    # a whole caption, and a legend that says what every column but the index means
    assert any(
        re.fullmatch(r"\s*The run took \d+\.\d s, the pipeline's start-up included\.\s*", x)
        for x in lines
    )
    legend = [
        line for line in lines if line.startswith(("score:", "success:", "resp ", "tokens/s:"))
    ]
    assert legend == list(LEGEND) and all(len(line) <= 80 for line in legend)
    explained = {part.split(":")[0].strip() for line in legend for part in line.split(" · ")}
    assert explained == set(SUMMARY_COLUMNS) - {"batch"}
    assert sorted(p.name for p in out.iterdir()) == [
        "batch_0000.pt",
        "batch_0001.pt",
        "trajectories.jsonl",
    ]
    records = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(records) == 8
    assert all(any(s["role"] == "response" for s in r["spans"]) for r in records)

    assert main(["inspect", str(out / "batch_0000.pt"), "--row", "1"]) == 0
    shown = capsys.readouterr().out
    assert "input_ids" in shown and "response_mask" in shown and "[[" in shown
    assert records[1]["traj_uid"] in shown


def test_config_file_errors_name_the_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("group_size: 4\nbatch_sise: 8\n")
    assert main(["run", "--config", str(bad)]) == 2
    assert "unknown keys ['batch_sise']" in capsys.readouterr().out
    bad.write_text("group_size: 0\n")
    assert main(["run", "--config", str(bad)]) == 2
    assert "group_size must be an int >= 1, got 0" in capsys.readouterr().out


def test_inspect_rejects_a_missing_file(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope.pt")]) == 2
    assert "nope.pt" in capsys.readouterr().out


def test_python_dash_m_help():
    result = subprocess.run(
        [sys.executable, "-m", "rollpipe", "run", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--batch-size" in result.stdout and "--engine" in result.stdout


@pytest.mark.parametrize("flag,value", [("--batches", "0")])
def test_bad_flag_values(flag, value, capsys):
    assert main(["run", flag, value]) == 2
    assert "--batches must be >= 1" in capsys.readouterr().out


def test_bad_engines_values(capsys):
    assert main(["run", "--engines", "0"]) == 2
    assert "--engines must be >= 1, got 0" in capsys.readouterr().out
    assert main(["run", "--engines", "2", "--engine", "hf"]) == 2
    assert "need --engine vllm" in capsys.readouterr().out
    assert main(["run", "--server", "http://x:1", "--engines", "2"]) == 2
    assert "--server takes no --engines" in capsys.readouterr().out


def test_a_server_that_is_down_is_a_clear_error(capsys):
    from rollpipe.engines.server import free_port

    url = f"http://127.0.0.1:{free_port()}"
    assert main(["run", "--server", url, "--batches", "1"]) == 2
    printed = capsys.readouterr().out
    assert url in printed


def test_run_defaults_to_the_warm_start_which_plays(tmp_path, capsys):
    """`rollpipe run` with no --model uses the shipped warm start, and it wins episodes
    (the random tiny model never writes a valid answer)."""
    from rollpipe.training.warm_start import SHIPPED_DIR

    out = tmp_path / "out"
    args = ["--batches", "1", "--batch-size", "16", "--group-size", "4", "--max-turns", "6"]
    assert main(["run", "--engine", "hf", *args, "--out", str(out)]) == 0
    assert str(SHIPPED_DIR) in capsys.readouterr().out
    records = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(records) == 16
    scores = [r["episode_scores"] for r in records]
    assert sum(s > 0 for s in scores) >= 4, scores


def test_train_runs_grpo_and_writes_the_curve(tmp_path, capsys):
    """`rollpipe train`: steps from the shipped warm start with weights pushed into the
    engine each step, held-out evaluations, the JSON history and the PNG curve."""
    out, png = tmp_path / "history.json", tmp_path / "curve.png"
    argv = ["train", "--steps", "2", "--batch-size", "8", "--group-size", "4"]
    argv += ["--eval-episodes", "10", "--out", str(out), "--plot", str(png)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert [h["step"] for h in result["history"]] == [0, 1]
    assert [h["version"] for h in result["history"]] == [1, 2]  # new weights every step
    assert [e["step"] for e in result["evals"]] == [0, 2]
    assert all(e["episodes"] == 10 for e in result["evals"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "held-out success" in printed and "learning curve written" in printed


@pytest.mark.parametrize("flag,value", [("--steps", "-1"), ("--group-size", "0")])
def test_train_rejects_bad_counts(flag, value, capsys):
    assert main(["train", flag, value]) == 2
    assert f"{flag} must be >= " in capsys.readouterr().out
