"""The soak's fault accounting (bench/soak.py), on a tiny soak on the real vLLM engine.

Every fault kind the soak injects must produce its outcome, or the soak fails naming
the kind: a run with the timeout set where the hang exceeds it passes with every kind
reported as its exception type (a hang as ``EnvTimeoutError``); the same soak with
``env_timeout_s`` left above the hang — a setting that stopped applying — fails, and
says which kind and its counts.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root holds bench/

from bench.soak import EXPECTED, parse_args, soak, soak_config


@pytest.fixture(scope="module")
def weights(tiny_model_path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def tiny_soak(engine: Any, tokenizer: Any, weights: Any, *flags: str) -> dict[str, Any]:
    args = parse_args(["--batches", "6", "--cycle", "3", "--rate", "0.25", *flags])
    return soak(engine, tokenizer, weights, args)


def test_the_timeout_reaches_the_episodes() -> None:
    config = soak_config(parse_args(["--env-timeout-s", "0.7"]))
    assert config.episode.env_timeout_s == 0.7


def test_a_tiny_soak_accounts_for_every_fault(
    vllm_engine: Any, tokenizer: Any, weights: Any
) -> None:
    report = tiny_soak(vllm_engine, tokenizer, weights)
    assert report["failures"] == []
    assert report["lost"] == report["duplicated"] == report["hangs"] == 0
    assert report["trajectories"] == 6 * 16
    for kind, counts in report["faults_by_kind"].items():
        assert counts["injected"] > 0, kind
        assert counts["reported_as_expected"] > 0, kind
        assert counts["survived_in_whole_trajectories"] == 0, kind
    assert (
        report["errors_by_type"]["EnvTimeoutError"]
        == (report["faults_by_kind"]["hang"]["reported_as_expected"])
    )
    assert set(report["errors_by_type"]) <= set(EXPECTED.values())


def test_the_soak_fails_when_a_hang_never_reaches_the_timeout(
    vllm_engine: Any, tokenizer: Any, weights: Any
) -> None:
    report = tiny_soak(
        vllm_engine,
        tokenizer,
        weights,
        "--kinds",
        "hang",
        "--hang-s",
        "0.05",
        "--env-timeout-s",
        "30",
    )
    hang = report["faults_by_kind"]["hang"]
    assert hang["injected"] > 0 and hang["reported_as_expected"] == 0
    assert hang["survived_in_whole_trajectories"] > 0
    assert any(
        line.startswith("hang: never reported as EnvTimeoutError") for line in report["failures"]
    ), report["failures"]
    assert report["lost"] == report["duplicated"] == 0  # only the fault's outcome is wrong
