"""Errors that name their cause (issue 22), on the real pipeline and vLLM engine.

Before, an env that failed every episode (a NaN reward on every step, a ``reset`` that
raises, an int observation) made ``get_batch`` raise ``GroupAssembler: 20 groups in a
row were dropped and none kept ({'errored': 20}); with keep_group=None, drop_group=None
and max_staleness=0 ...``: not why the episodes errored, and a setting that is no longer
a ``PipelineConfig`` field. With ``raise_env_errors=True`` the env's exception came back
bare (``EnvTimeoutError: no return within 0.5 s``: no env, call or seed). Each case here
asserts what the message says: env name, call, seed, field and value.
"""

from __future__ import annotations

import re
import traceback
from typing import Any

import pytest
from faulty import FaultLake, config

from rollpipe.agent.env_returns import EnvReturnError
from rollpipe.agent.env_threads import EnvTimeoutError
from rollpipe.pipeline import RolloutPipeline

CAP = 4  # max_drops_in_a_row: groups dropped in a row before get_batch gives up

# fault (at every step or reset) -> (call, what the quoted error says)
ALWAYS = {
    "nan_reward": (
        "step",
        "EnvReturnError('FaultLake.step: reward is nan; a reward must be a finite number')",
    ),
    "raise_reset": ("reset", "OSError('injected reset failure (seed {seed})')"),
    "obs_not_str": (
        "step",
        "EnvReturnError('FaultLake.step: observation must be a str, got int 7')",
    ),
}


@pytest.fixture(autouse=True)
def _clear_log() -> Any:
    FaultLake.clear()
    yield
    FaultLake.unhang.set()  # never leave a hung env thread behind


@pytest.mark.parametrize("fault", sorted(ALWAYS))
def test_an_env_that_always_fails_stops_the_stream_quoting_its_errors(
    fault: str, vllm_engine: Any, tokenizer: Any
) -> None:
    cfg = config(env_config={"fault": fault, "rate": 1.0}, max_drops_in_a_row=CAP)
    with RolloutPipeline(cfg, vllm_engine, tokenizer) as pipe, pytest.raises(RuntimeError) as info:
        pipe.get_batch()
    message = str(info.value)
    assert message.startswith(
        f"GroupAssembler: {CAP} groups in a row were dropped and none kept ({{'errored': {CAP}}})"
    )
    assert "redundancy=0" in message and "fix the env" in message
    assert "max_staleness" not in message  # no longer a PipelineConfig field
    assert f"max_drops_in_a_row={CAP}" in message
    call, says = ALWAYS[fault]
    quoted = re.findall(r"^  \* (.*)$", message, flags=re.M)
    assert len(quoted) == 3 and "the last 3 errors:" in message
    logged = {seed for _, seed, _, _ in FaultLake.log}
    for line in quoted:
        where = re.search(
            rf"\(in FaultLake\.{call}: env 'fault_lake', seed (\d+), episode \d+, turn \d+, "
            r"env_timeout_s=60\.0\)$",
            line,
        )
        assert where is not None, line  # env name, call and seed
        seed = int(where.group(1))
        assert seed in logged  # a fault that was injected
        assert says.format(seed=seed) in line  # the exception: field and value


def test_raise_env_errors_keeps_the_type_and_says_where(vllm_engine: Any, tokenizer: Any) -> None:
    cfg = config(env_config={"fault": "nan_reward", "rate": 1.0}, raise_env_errors=True)
    with (
        RolloutPipeline(cfg, vllm_engine, tokenizer) as pipe,
        pytest.raises(EnvReturnError) as info,
    ):
        pipe.get_batch()
    error = info.value
    assert str(error).startswith("FaultLake.step: reward is nan;")  # the env's own text
    where = re.search(  # then where, in the text itself (issue 34)
        r" \(in FaultLake\.step: env 'fault_lake', seed (\d+), episode \d+, "
        r"turn 0, env_timeout_s=60\.0\)$",
        str(error),
    )
    assert where is not None, str(error)
    assert int(where.group(1)) in {seed for _, seed, _, _ in FaultLake.log}
    assert str(error) in "".join(traceback.format_exception(error))  # printed with the traceback


def test_a_timeout_re_raised_says_which_env_call_and_seed(vllm_engine: Any, tokenizer: Any) -> None:
    """The user's case: ``EnvTimeoutError: no return within 0.5 s`` and nothing else. The
    first step hangs (until the test ends); ``env_timeout_s=0.5`` fails it."""
    cfg = config(
        env_config={"fault": "hang_once", "hang_s": 60.0},
        env_timeout_s=0.5,
        raise_env_errors=True,
    )
    with (
        RolloutPipeline(cfg, vllm_engine, tokenizer) as pipe,
        pytest.raises(TimeoutError) as info,  # EnvTimeoutError is a TimeoutError
    ):
        pipe.get_batch()
    FaultLake.unhang.set()
    error = info.value
    assert type(error) is EnvTimeoutError  # a user catching EnvTimeoutError still does
    text = str(error)
    assert text.startswith("no return within 0.5 s (waited ")  # then where (issue 34)
    ((_, seed, step, _),) = FaultLake.log  # the one hang that was injected
    assert f"(in FaultLake.step: env 'fault_lake', seed {seed}, episode " in text
    assert text.endswith(f"turn {step - 1}, env_timeout_s=0.5; raise env_timeout_s or fix the env)")
    printed = "".join(traceback.format_exception(error))
    assert f"EnvTimeoutError: {text}" in printed
