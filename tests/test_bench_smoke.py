"""Smoke test of the benchmark suite at toy sizes: figures exist and are sane.

Never asserts speed (that is what ``python -m bench.run`` reports); only that each
benchmark runs, produces the documented keys with finite positive values, and that
the baselines it compares against compute the same thing as rollpipe.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root holds bench/

from bench import collate, efficiency, long_tail
from bench.common import BenchContext, median, rounded
from bench.run import table, write_results
from rollpipe.data.rows import trajectory_rows


def positive(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (math.isfinite(value) and value > 0)
    )


def quiet_ctx(engine=None, tokenizer=None, path=None) -> BenchContext:
    return BenchContext(engine, tokenizer, path, quick=True, repeats=1, log=lambda _: None)


def test_collate_benchmark_figures() -> None:
    figures = collate.run(quiet_ctx(), n=24, max_len=300)
    for key in (
        "collate_vs_memcpy",
        "collate_speedup_vs_concat",
        "collate_rows_per_s",
        "collate_ms",
        "collate_concat_ms",
        "collate_memcpy_ms",
        "collate_output_mb",
    ):
        assert positive(figures[key]), (key, figures[key])
    assert figures["collate_outputs_equal"] is True
    assert figures["collate_trajectories"] == 24
    assert 24 * 16 <= figures["collate_tokens"] <= 24 * 300


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 6), max_len=st.integers(16, 80), seed=st.integers(0, 1000))
def test_per_row_baseline_builds_the_same_rows(n: int, max_len: int, seed: int) -> None:
    trajs = collate.synthetic_trajectories(n, max_len=max_len, seed=seed)
    assert all(16 <= sum(len(u.prompt_ids) + len(u.response_ids) for u in t.turns) <= max_len
               for t in trajs)  # fmt: skip
    assert collate.same_tensors(trajectory_rows(trajs, collate.PAD_ID), collate.concat_way(trajs))


def test_requests_by_turn_rebuild_each_engine_prompt() -> None:
    trajs = collate.synthetic_trajectories(6, max_len=64, seed=3)
    by_turn = efficiency.requests_by_turn(trajs)
    assert [len(reqs) for reqs in by_turn] == [
        sum(len(t.turns) > i for t in trajs) for i in range(max(len(t.turns) for t in trajs))
    ]
    seen = [0] * len(by_turn)  # requests of turn i appear in trajectory order
    for traj in trajs:
        context: list[int] = []
        for i, turn in enumerate(traj.turns):
            prompt, params = by_turn[i][seen[i]]
            seen[i] += 1
            assert prompt == [*context, *turn.prompt_ids]
            assert params.max_tokens == len(turn.response_ids) and params.ignore_eos
            context = [*prompt, *turn.response_ids]


def test_long_tail_workload_is_fixed_by_seeds_and_uneven() -> None:
    turns = [long_tail.turns_for(s) for s in range(400)]
    lengths = [long_tail.length_for(s) for s in range(400)]
    assert turns == [long_tail.turns_for(s) for s in range(400)]
    assert min(turns) == 1 and max(turns) == len(long_tail.TURN_WEIGHTS)
    assert min(lengths) >= long_tail.SHORT[0] and max(lengths) <= long_tail.LONG[1]
    assert sum(n >= long_tail.LONG[0] for n in lengths) > 20  # a real tail
    env = long_tail.LongTailEnv()
    env.reset(seed=11)
    steps = 1
    while not env.step("anything")[2]:
        steps += 1
    assert steps == long_tail.turns_for(11)


def test_results_are_one_flat_json_object(tmp_path: Path) -> None:
    figures = {"efficiency_frozenlake": 0.95, "machine": "m", "date": "d", "ok": True}
    paths = write_results(figures, tmp_path, quick=True)
    data = json.loads((tmp_path / "latest.json").read_text())
    assert data == figures
    assert all(not isinstance(v, (dict, list)) for v in data.values())
    assert {p.name for p in paths} >= {"latest.json", "latest.md"}
    assert (
        "| 1 | Pipeline efficiency, FrozenLake | `efficiency_frozenlake` | ≥ 0.9 | 0.95 |"
        in (tmp_path / "latest.md").read_text()
    )
    assert "—" in table({})  # missing figures show as a dash
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert rounded(1234.5678) == 1235.0 and rounded(0.012345) == 0.0123


@pytest.mark.slow
def test_efficiency_benchmark_on_the_real_engine(vllm_engine, tokenizer, tiny_model_path) -> None:
    ctx = quiet_ctx(vllm_engine, tokenizer, tiny_model_path)
    figures = efficiency.run(ctx, envs=("frozenlake",), sizes=(4, 2, 4))
    assert positive(figures["efficiency_frozenlake"])
    assert positive(figures["efficiency_frozenlake_pipeline_tokens_per_s"])
    assert positive(figures["efficiency_frozenlake_raw_tokens_per_s"])
    # the ratio is pipeline / raw of the two medians' runs (one repeat here)
    ratio = (
        figures["efficiency_frozenlake_pipeline_tokens_per_s"]
        / figures["efficiency_frozenlake_raw_tokens_per_s"]
    )
    assert figures["efficiency_frozenlake"] == pytest.approx(ratio, rel=0.02)
