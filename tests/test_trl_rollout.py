"""TRL's real GRPOTrainer trains on rollpipe's multi-turn FrozenLake rollouts through
``rollpipe.integrations.trl``: the engine follows the trainer's optimizer steps (version
and weights), and what TRL got is the pipeline's rows. Skips only without ``trl``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

from trl import GRPOConfig, GRPOTrainer

from rollpipe import PipelineConfig, RolloutPipeline
from rollpipe.engines.hf import HFEngine
from rollpipe.integrations.trl import (
    TRLRollout,
    episode_reward,
    pipeline_rollout,
    placeholder_dataset,
)
from rollpipe.integrations.trl_rows import trl_fields
from rollpipe.training.warm_start import warm_start_model_path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
GROUP = 2


def config(**kw: Any) -> PipelineConfig:
    return PipelineConfig(
        envs="frozenlake",
        group_size=GROUP,
        batch_size=4,
        max_turns=2,
        sampling={"max_tokens": 24, "temperature": 1.0},
        **kw,
    )


def args(tmp_path: Path, **kw: Any) -> GRPOConfig:
    settings: dict[str, Any] = {
        "output_dir": str(tmp_path),
        "num_generations": GROUP,
        "per_device_train_batch_size": 4,
        "max_steps": 3,
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "report_to": "none",
        "use_cpu": True,
        "save_strategy": "no",
        "temperature": 1.0,
        "max_completion_length": 256,
        "seed": 0,
    }
    settings.update(kw)
    return GRPOConfig(**settings)


class Recorder:
    """Wraps the rollout: keeps what TRL got and the engine's state at each call."""

    def __init__(self, rollout: TRLRollout, engine: HFEngine) -> None:
        self.rollout, self.engine = rollout, engine
        self.calls: list[dict[str, Any]] = []
        self.changes: list[bool] = []  # per call after the first: the weights moved
        self.previous = torch.empty(0)

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        out = self.rollout(prompts, trainer)
        name = "model.layers.0.self_attn.q_proj.weight"
        trained = trainer.accelerator.unwrap_model(trainer.model).state_dict()[name]
        if self.calls:
            self.changes.append(not torch.equal(self.previous, trained))
        self.previous = trained.clone()
        self.calls.append(
            {
                "step": trainer.state.global_step,
                "version": self.engine.version,
                "equal": torch.equal(self.engine.model.state_dict()[name], trained),
                "out": out,
                "batch": self.rollout.last_batch,
            }
        )
        return out


def token_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """An arbitrary score of the tokens: it differs within a group whenever the rows do
    (FrozenLake's score often does not), so steps move the weights and a missed sync
    would show."""
    return [sum(ids) % 101 / 101 for ids in completion_ids]


def trainer_for(rollout: Any, tmp_path: Path, **grpo: Any) -> GRPOTrainer:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(warm_start_model_path())
    grpo_args = args(tmp_path, **grpo)
    return GRPOTrainer(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        reward_funcs=[episode_reward, token_reward],
        args=grpo_args,
        train_dataset=placeholder_dataset(grpo_args),
        processing_class=AutoTokenizer.from_pretrained(path),
        rollout_func=rollout,
    )


def train(tmp_path: Path, **grpo: Any) -> tuple[Recorder, GRPOTrainer]:
    path = warm_start_model_path()
    with HFEngine(path) as engine, RolloutPipeline(config(), engine, path) as pipe:
        recorder = Recorder(pipeline_rollout(pipe), engine)
        trainer = trainer_for(recorder, tmp_path, **grpo)
        trainer.train()
    return recorder, trainer


def test_grpo_trainer_trains_on_rollpipe_rollouts(tmp_path: Path) -> None:
    recorder, trainer = train(tmp_path)
    assert [c["step"] for c in recorder.calls] == [0, 1, 2]
    assert [c["version"] for c in recorder.calls] == [1, 2, 3]  # one load per optimizer step
    assert recorder.rollout.syncs == [(0, 1), (1, 2), (2, 3)]
    assert all(c["equal"] for c in recorder.calls)  # the engine held the trainer's weights
    assert recorder.changes == [True, True]  # ... and they moved: the steps trained
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert any("rollpipe/success_rate" in h for h in trainer.state.log_history)
    for call in recorder.calls:
        batch, out = call["batch"], call["out"]
        versions = batch.batch["policy_versions"][batch.batch["response_mask"]]
        assert set(versions.tolist()) == {call["version"]}
        assert out == {**trl_fields(batch), "rollpipe_metrics": out["rollpipe_metrics"]}
        for i in range(len(out["prompt_ids"])):
            real = batch.batch["attention_mask"][i].bool()
            ids = batch.batch["input_ids"][i][real].tolist()
            assert out["prompt_ids"][i] + out["completion_ids"][i] == ids
            mask = batch.batch["response_mask"][i][real].int().tolist()
            assert [0] * len(out["prompt_ids"][i]) + out["env_mask"][i] == mask
            assert (
                0 in out["env_mask"][i] or batch.non_tensor_batch["end_reasons"][i] != "max_turns"
            )
        assert len(set(batch.batch["traj_group_id"][:GROUP].tolist())) == 1
    # multi-turn: env tokens between the model's turns are masked out of TRL's loss
    assert any(0 in mask for c in recorder.calls for mask in c["out"]["env_mask"])


def test_sync_only_when_the_optimizer_stepped(tmp_path: Path) -> None:
    """Gradient accumulation 2, one generation per micro-step: the weights change (and are
    loaded) every second call only."""
    recorder, _ = train(
        tmp_path,
        gradient_accumulation_steps=2,
        steps_per_generation=1,
        per_device_train_batch_size=2,
        max_steps=2,
    )
    assert [c["step"] for c in recorder.calls] == [0, 0, 1, 1]
    assert [c["version"] for c in recorder.calls] == [1, 1, 2, 2]
    assert recorder.rollout.syncs == [(0, 1), (1, 2)]
    assert all(c["equal"] for c in recorder.calls)


def test_num_iterations_reuse_one_generation(tmp_path: Path) -> None:
    """num_iterations=2: one generation per two optimizer steps; the version is
    start + global_step, so it jumps by two."""
    recorder, _ = train(tmp_path, num_iterations=2, max_steps=4)
    assert [c["step"] for c in recorder.calls] == [0, 2]
    assert [c["version"] for c in recorder.calls] == [1, 3]
    assert all(c["equal"] for c in recorder.calls)


def test_group_size_must_equal_num_generations(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = warm_start_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    grpo_args = args(tmp_path, num_generations=4, per_device_train_batch_size=4)
    with HFEngine(path) as engine, RolloutPipeline(config(), engine, tokenizer) as pipe:
        trainer = GRPOTrainer(
            str(path),
            reward_funcs=episode_reward,
            args=grpo_args,
            train_dataset=placeholder_dataset(grpo_args),
            processing_class=tokenizer,
            rollout_func=pipeline_rollout(pipe),
        )
        with pytest.raises(ValueError, match="num_generations=4 but the pipeline's group_size=2"):
            trainer.train()
        assert engine.version == 0  # nothing loaded before the check


def test_on_vllm_the_engine_ends_with_the_trainers_weights(tmp_path: Path) -> None:
    """The real vLLM engine: 3 steps, one load per optimizer step, and after the final
    ``sync`` the engine's greedy output is the trained model's."""
    from rollpipe.engines.records import SamplingParams
    from rollpipe.engines.vllm import VLLMEngine

    path = warm_start_model_path()
    engine = VLLMEngine(path, kv_cache_space_gib=1, max_model_len=2048, seed=0)
    with engine, RolloutPipeline(config(), engine, path) as pipe:
        rollout = pipeline_rollout(pipe)
        trainer = trainer_for(rollout, tmp_path)
        trainer.train()
        assert rollout.syncs == [(0, 1), (1, 2), (2, 3)]
        assert rollout.sync(trainer) == 4 == engine.version  # the last step's weights
        grads = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
        assert len(grads) == 3 and all(torch.isfinite(torch.tensor(grads)))
        model = trainer.accelerator.unwrap_model(trainer.model).eval()
        model.generation_config.eos_token_id = None  # greedy to max_new_tokens
        rows = rollout.last_batch.batch["input_ids"]
        prompts = [rows[0][:40].tolist(), rows[GROUP][:60].tolist()]
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        got = [list(g.token_ids) for g in engine.generate_batch(prompts, params)]
        with torch.no_grad():
            want = [
                model.generate(
                    torch.tensor([p]), max_new_tokens=16, do_sample=False, pad_token_id=0
                )[0, len(p) :].tolist()
                for p in prompts
            ]
        assert got == want


def test_the_docs_loop_runs(tmp_path: Path) -> None:
    """docs/trl.md's loop, as written, with the warm-start policy and 2 steps."""
    import re

    doc = (Path(__file__).resolve().parents[1] / "docs" / "trl.md").read_text()
    match = re.search(r"<!-- doctest: trl-loop -->\n```python\n(.*?)```", doc, re.S)
    assert match, "docs/trl.md lost its <!-- doctest: trl-loop --> block"
    code = (
        match.group(1)
        .replace('"/path/to/model"', repr(str(warm_start_model_path())))
        .replace('GRPOConfig("out"', f"GRPOConfig({str(tmp_path)!r}")
        .replace("max_steps=100", "max_steps=2, use_cpu=True")  # CPU-only here
    )
    exec(compile(code, "docs/trl.md", "exec"), {})


def fake_trainer(**kw: Any) -> Any:
    """What TRLRollout reads of a GRPOTrainer, for the checks that fail before any work."""
    from types import SimpleNamespace

    fields = {"num_generations": GROUP, "temperature": 1.0, "tools": [], "training": True}
    fields.update(kw)
    model = SimpleNamespace(training=fields.pop("training"))
    return SimpleNamespace(model=model, state=SimpleNamespace(global_step=0), **fields)


@pytest.mark.parametrize(
    ("trainer", "n", "match"),
    [
        (fake_trainer(temperature=0.7), 4, "GRPOConfig.temperature=0.7 but the pipeline samples"),
        (fake_trainer(tools=[len]), 4, "TRL would run its own tool loop"),
        (fake_trainer(training=False), 4, "eval_strategy='no'"),
        (fake_trainer(), 3, "3 completions on this process, not a multiple of group_size=2"),
    ],
)
def test_checks_name_what_to_change(trainer: Any, n: int, match: str) -> None:
    from rollpipe.engines.scripted import ScriptedEngine

    path = warm_start_model_path()
    with ScriptedEngine(lambda prompt, params: [0]) as engine:
        rollout = pipeline_rollout(config(), engine, path)
        try:
            with pytest.raises((ValueError, NotImplementedError), match=match):
                rollout([""] * n, trainer)
            assert engine.version == 0
        finally:
            rollout.pipeline.close()


def test_rows_must_be_trajectory_rows() -> None:
    from rollpipe.engines.scripted import ScriptedEngine

    path = warm_start_model_path()
    eot = [1]
    with (
        ScriptedEngine(lambda prompt, params: eot) as engine,
        RolloutPipeline(config(collate={"level": "step"}, history_window=2), engine, path) as pipe,
    ):
        batch = pipe.get_batch()
        with pytest.raises(ValueError, match="level='trajectory'"):
            trl_fields(batch)
    with pytest.raises(ValueError, match="give a pipeline alone"):
        pipeline_rollout(pipe, engine)
