"""verifiers 0.4 envs through ``VerifiersEnv`` and the front door: a real batch on vLLM for
a single-turn, a multi-turn and a tool env, and a scripted policy that earns the rubric's
reward. ``nox -s verifiers``.

The test tasksets (``vf_add``, ``vf_guess``, ``vf_tools`` + ``vf_calculator``) are modules
on the path, as verifiers loads tasksets by id; the tool server runs as ``python -m
vf_calculator``, so this folder goes on ``PYTHONPATH`` too.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verifiers.v1", reason="verifiers is not installed: nox -s verifiers")

from playing import first_prompts, real_batch

from rollpipe.agent.episode import EpisodeSettings
from rollpipe.engines.scripted import ScriptedEngine
from rollpipe.envs import make
from rollpipe.envs.registry import EnvRegistryError
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

VF = "rollpipe.envs.adapters.verifiers:VerifiersEnv"
HERE = str(Path(__file__).parent)


@pytest.fixture(autouse=True)
def _tool_servers_import_from_here(monkeypatch: pytest.MonkeyPatch) -> None:
    paths = [HERE, *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))


def test_single_turn_real_batch(vllm_engine, tokenizer) -> None:
    batch = real_batch(vllm_engine, tokenizer, VF, {"taskset": "vf_add"})
    assert all(re.search(r"What is \d+ \+ \d+\?", p) for p in first_prompts(batch, tokenizer))
    metrics = batch.meta_info["metrics"]
    assert metrics["env/eco/turns/max"] == 1.0  # the chat program stops at the first reply
    assert "env/eco/reward/exact_sum" in metrics and "env/eco/metric/reply_words" in metrics


def test_multi_turn_real_batch(vllm_engine, tokenizer) -> None:
    batch = real_batch(vllm_engine, tokenizer, VF, {"taskset": "vf_guess"})
    assert all("Guess my number" in p for p in first_prompts(batch, tokenizer))
    metrics = batch.meta_info["metrics"]
    assert "env/eco/reward/won" in metrics
    assert metrics["env/eco/turns/max"] >= 2  # a wrong guess gets the env's hint, a new turn


def test_tool_env_real_batch(vllm_engine, tokenizer) -> None:
    batch = real_batch(
        vllm_engine,
        tokenizer,
        VF,
        {"taskset": "vf_tools"},
        episode=EpisodeSettings(tool_parser="hermes", max_length=2048, sampling={"max_tokens": 24}),
    )
    # the tool server started and the harness ran against it: no episode errored
    assert all("Use the tool: what is" in p for p in first_prompts(batch, tokenizer))
    assert "env/eco/reward/exact_sum" in batch.meta_info["metrics"]


def scripted(tokenizer: Any, answer) -> ScriptedEngine:
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def policy(prompt: list[int], params: Any) -> list[int]:
        last = tokenizer.decode(prompt).rsplit("<|im_start|>user\n", 1)[-1]
        return [*tokenizer.encode(answer(last), add_special_tokens=False), eot]

    return ScriptedEngine(policy)


def adder(user: str) -> str:
    a, b = re.search(r"What is (\d+) \+ (\d+)\?", user).groups()  # type: ignore[union-attr]
    return f"It is {int(a) + int(b)}"


def scripted_batch(engine: ScriptedEngine, tokenizer: Any, taskset: str) -> Any:
    config = PipelineConfig(
        envs=[{"name": VF, "config": {"taskset": taskset}, "tag": "vf"}],
        group_size=2,
        batch_size=4,
        seed=3,
    )
    with engine, RolloutPipeline(config, engine, tokenizer) as pipe:
        return pipe.get_batch()


def test_a_right_answer_earns_the_rubric_reward(tokenizer) -> None:
    batch = scripted_batch(scripted(tokenizer, adder), tokenizer, "vf_add")
    metrics = batch.meta_info["metrics"]
    assert metrics["dropped/errored"] == 0
    assert metrics["env/vf/reward/exact_sum"] == 1.0
    assert batch.batch["episode_scores"].tolist() == [1.0] * 4


def test_a_wrong_answer_earns_nothing(tokenizer) -> None:
    batch = scripted_batch(scripted(tokenizer, lambda _: "It is -1"), tokenizer, "vf_add")
    assert batch.meta_info["metrics"]["env/vf/reward/exact_sum"] == 0.0
    assert batch.batch["episode_scores"].tolist() == [0.0] * 4


def test_a_bad_taskset_fails_when_built() -> None:
    with pytest.raises((EnvRegistryError, ModuleNotFoundError, ValueError)):
        make(VF, taskset="no_such_taskset_here")
    with pytest.raises(ValueError, match="num_tasks"):
        make(VF, taskset="vf_add", num_tasks=0)
