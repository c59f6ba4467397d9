"""The PPO CartPole example learns: a short fixed-seed run beats a random policy clearly."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ppo_cartpole.py"
RANDOM_POLICY_RETURN = 22.0  # CartPole-v1 mean episode length under uniform random actions


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ppo_cartpole_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_short_ppo_run_learns_well_above_random() -> None:
    example = _load_example()
    returns = example.main(total_steps=16 * 1024, seed=0)
    assert len(returns) == 16
    assert returns[0] < 40  # starts near random play
    final = float(np.mean(returns[-3:]))
    assert final > 60, returns
    assert final > 3 * RANDOM_POLICY_RETURN, returns


def test_config_validation_names_the_field() -> None:
    example = _load_example()
    with pytest.raises(ValueError, match=r"PPOConfig.gamma must be in \[0, 1\], got 1.5"):
        example.PPOConfig(gamma=1.5)
    with pytest.raises(ValueError, match=r"PPOConfig.num_envs must be > 0, got 0"):
        example.PPOConfig(num_envs=0)
