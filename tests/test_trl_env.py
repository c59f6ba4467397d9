"""A class written for TRL's ``environment_factory`` runs unchanged as a rollpipe tool env
(``rollpipe.integrations.trl_env.TRLEnv``), through the whole pipeline, with a scripted
engine (the model's text is the test's input) on the tiny tools model's tokenizer and
vLLM's hermes parser. Skips only without ``trl``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

from rollpipe import PipelineConfig, RolloutPipeline
from rollpipe.engines.records import SamplingParams
from rollpipe.engines.scripted import ScriptedEngine
from rollpipe.envs import register
from rollpipe.integrations.trl_env import TRLEnv, trl_tools
from rollpipe.training.tiny_model import default_model_path

RESETS: list[dict[str, Any]] = []
SCORES: list[tuple[int, int, float]] = []  # (target, count, reward) per get_reward call


class CounterEnv:
    """A TRL environment: tools are its public methods; reset(**row); get_reward()."""

    def reset(self, **kwargs: Any) -> str | None:
        RESETS.append(kwargs)
        self.target, self.count = int(kwargs["target"]), 0
        return f" Call increment until the counter reaches {self.target}."

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: how much to add
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        reward = 1.0 if self.count == self.target else 0.0
        SCORES.append((self.target, self.count, reward))
        return reward


class Other(CounterEnv):
    def get_reward(self) -> float:
        return -1.0


def call(name: str, **arguments: Any) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def counting_policy(tokenizer: Any, overshoot: bool) -> Any:
    """Increments by one until the target (one more with ``overshoot``), then answers."""

    def policy(prompt: list[int], params: SamplingParams) -> list[int]:
        text = tokenizer.decode(prompt)
        target = int(re.findall(r"reaches (\d+)", text)[0]) + int(overshoot)
        done = text.count("<tool_response>") >= target
        answer = "Done." if done else call("increment", step=1)
        return list(tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"])

    return policy


ROWS = [
    {"prompt": [{"role": "user", "content": "Count."}], "target": 2},
    {"prompt": [{"role": "user", "content": "Count."}], "target": 3},
]


def run(factory: Any, rows: list[dict[str, Any]], overshoot: bool = False) -> Any:
    from transformers import AutoTokenizer

    path = default_model_path(tools=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    register("test-trl-counter", lambda: TRLEnv(factory), overwrite=True)
    config = PipelineConfig(
        envs="test-trl-counter",
        dataset={"rows": rows, "shuffle": False},
        group_size=2,
        batch_size=2 * len(rows),
        episode={
            "tool_parser": "hermes",
            "max_turns": 6,
            "max_length": 2048,
            "sampling": {"max_tokens": 64},
        },
    )
    engine = ScriptedEngine(counting_policy(tokenizer, overshoot))
    with engine, RolloutPipeline(config, engine, tokenizer) as pipe:
        return pipe.get_batch(), tokenizer


def test_a_trl_env_class_runs_unchanged_as_a_rollpipe_tool_env() -> None:
    RESETS.clear()
    batch, tokenizer = run(CounterEnv, ROWS)
    assert batch.batch["episode_scores"].tolist() == [1.0] * 4
    assert sorted(r["target"] for r in RESETS) == [2, 2, 3, 3]  # one fresh instance each
    assert all(r["prompt"] == ROWS[0]["prompt"] for r in RESETS)  # reset(**row), as TRL
    metrics = batch.meta_info["metrics"]
    assert metrics["tool/calls/increment"] == 2 + 2 + 3 + 3
    assert metrics["tool/malformed"] == 0
    first = tokenizer.decode(batch.batch["input_ids"][0])
    assert "Count. Call increment until the counter reaches" in first  # TRL's prompt + obs
    assert '"name": "increment"' in first  # the method is a tool in the template


def test_get_reward_scores_the_episode() -> None:
    batch, _ = run(CounterEnv, ROWS[:1], overshoot=True)
    assert batch.batch["episode_scores"].tolist() == [0.0, 0.0]


def test_a_mapping_routes_by_the_rows_environment_field() -> None:
    RESETS.clear()
    rows = [{**ROWS[0], "environment": "a"}, {**ROWS[1], "environment": "b"}]
    batch, _ = run({"a": CounterEnv, "b": Other}, rows)
    assert sorted(batch.batch["episode_scores"].tolist()) == [-1.0, -1.0, 1.0, 1.0]
    assert all("environment" not in r for r in RESETS)  # TRL does not pass it to reset


def test_tools_are_the_public_methods() -> None:
    env = CounterEnv()
    assert [t.__name__ for t in trl_tools(env)] == ["increment"]


def test_errors_name_what_to_do() -> None:
    with pytest.raises(ValueError, match="callable returning a TRL env"):
        TRLEnv(42)  # type: ignore[arg-type]
    env = TRLEnv({"a": CounterEnv})
    with pytest.raises(ValueError, match="'environment' field is 'c'"):
        env.reset(0, {"environment": "c", "target": 1})
    with pytest.raises(ValueError, match="system_prompt"):
        system = [{"role": "system", "content": "x"}]
        env.reset(0, {"environment": "a", "target": 1, "prompt": system})
    env.close()


def trl_scores(overshoot: bool, out: Path) -> list[tuple[int, int, float]]:
    """CounterEnv through TRL's own ``environment_factory`` path: TRL's tool loop, tool
    calls and ``get_reward``; only TRL's generation step is replaced by the same
    scripted policy (the tiny model cannot be steered on CPU otherwise)."""
    import os

    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    path = str(default_model_path(tools=True))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.response_template = qwen3_template  # hermes-style calls, as qwen's
    args = GRPOConfig(
        output_dir=str(out),
        num_generations=2,
        per_device_train_batch_size=4,
        max_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        max_completion_length=256,
    )
    trainer = GRPOTrainer(
        path,
        args=args,
        train_dataset=Dataset.from_list(ROWS),
        processing_class=tokenizer,
        environment_factory=CounterEnv,
    )
    policy = counting_policy(tokenizer, overshoot)

    def scripted(prompt_ids: list[list[int]], *args: Any, **kw: Any) -> Any:
        ids = [policy(p, SamplingParams()) for p in prompt_ids]
        return ids, [[0.0] * len(i) for i in ids]

    trainer._generate_single_turn = scripted  # type: ignore[method-assign]
    SCORES.clear()
    trainer.train()
    return sorted(SCORES)


@pytest.mark.parametrize("overshoot", [False, True])
def test_rewards_equal_trls_own_environment_path(overshoot: bool, tmp_path: Path) -> None:
    expected = trl_scores(overshoot, tmp_path)
    assert len(expected) == 4 and {r for _, _, r in expected} == {float(not overshoot)}
    SCORES.clear()
    batch, _ = run(CounterEnv, ROWS, overshoot=overshoot)
    assert sorted(SCORES) == expected
    assert sorted(batch.batch["episode_scores"].tolist()) == [r for _, _, r in expected]
