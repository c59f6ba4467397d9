"""The ROLL scheduler example in docs/coming-from-roll-verl.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from rollpipe.data.proto import DataProto
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

DOC = Path(__file__).resolve().parents[1] / "docs" / "coming-from-roll-verl.md"


def seed_block() -> str:
    """The fenced block after the ``<!-- doctest: roll-seed -->`` marker."""
    text = DOC.read_text()
    match = re.search(r"<!-- doctest: roll-seed -->\n```python\n(.*?)```", text, re.S)
    assert match, "the roll-seed example is missing from the doc"
    return match.group(1)


def test_the_roll_scheduler_example_runs_as_written(vllm_engine, tokenizer, tiny_model_path):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    config = PipelineConfig(
        group_size=4, batch_size=32, max_turns=2, sampling={"max_tokens": 16}, seed=21
    )
    trained: list[DataProto] = []
    with RolloutPipeline(config, vllm_engine, tokenizer) as scheduler:
        before = scheduler.version
        namespace = {
            "train_rollout_scheduler": scheduler,
            "model_update": lambda: scheduler.update_weights(policy),
            "train": trained.append,
            "DataProto": DataProto,
            "step": 3,
        }
        exec(compile(seed_block(), str(DOC), "exec"), namespace)
        assert scheduler.version == before + 1
    (batch,) = trained
    assert len(batch) == 32 and batch.meta_info["global_step"] == 3
    versions = batch.batch["policy_versions"][batch.batch["response_mask"].bool()]
    assert set(versions.unique().tolist()) == {before + 1}  # on-policy, as ROLL's default
