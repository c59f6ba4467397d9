"""A YAML with sections and one with ROLL-style flat names build the same pipeline: equal
``PipelineConfig`` records, and the same first batch, token for token."""

from __future__ import annotations

from typing import Any

import yaml

from rollpipe.pipeline import PipelineConfig, RolloutPipeline

SECTIONED = """
source:
  envs:
    - {name: frozenlake, weight: 3, config: {size: 4}}
    - {name: "rollpipe.envs.sokoban:Sokoban", config: {dim_room: [5, 5]}, tag: soko}
  group_size: 2
  num_groups: 4
  seed: 7
episode:
  max_turns: 2
  max_length: 512
  sampling: {max_tokens: 12, temperature: 1.0}
  env_timeout_s: 30
rollout:
  concurrency: 4
groups:
  max_drops_in_a_row: 50
collate:
  pad_to_multiple_of: 8
batch_size: 4
async_generation_ratio: 0
"""

FLAT = """
envs:
  - {name: frozenlake, weight: 3, config: {size: 4}}
  - {name: "rollpipe.envs.sokoban:Sokoban", config: {dim_room: [5, 5]}, tag: soko}
group_size: 2
num_groups: 4
seed: 7
max_turns: 2
max_length: 512
sampling: {max_tokens: 12, temperature: 1.0}
env_timeout_s: 30
concurrency: 4
max_drops_in_a_row: 50
pad_to_multiple_of: 8
batch_size: 4
async_generation_ratio: 0
"""


def _config(text: str) -> PipelineConfig:
    return PipelineConfig.from_dict(yaml.safe_load(text))


def test_sectioned_and_flat_yaml_give_equal_configs() -> None:
    sectioned, flat = _config(SECTIONED), _config(FLAT)
    assert sectioned == flat
    assert flat.source.envs[1].name == "rollpipe.envs.sokoban:Sokoban"  # an import path
    assert (flat.episode.max_turns, flat.rollout.concurrency, flat.collate.pad_to_multiple_of) == (
        2,
        4,
        8,
    )


def _first_batch_ids(config: PipelineConfig, engine: Any, tokenizer: Any) -> list[list[int]]:
    with RolloutPipeline(config, engine, tokenizer) as pipe:
        batch = pipe.get_batch()
    assert batch is not None
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"].bool()
    return [ids[i][mask[i]].tolist() for i in range(len(batch))]


def test_sectioned_and_flat_yaml_give_the_same_first_batch(
    vllm_engine: Any, tokenizer: Any
) -> None:
    sectioned = _first_batch_ids(_config(SECTIONED), vllm_engine, tokenizer)
    flat = _first_batch_ids(_config(FLAT), vllm_engine, tokenizer)
    assert len(sectioned) == 4 and all(sectioned)
    assert sectioned == flat


def test_a_dataset_section_and_the_flat_name_give_equal_configs(tmp_path: Any) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": "4"}\n')
    envs = "[{name: task, config: {prompt_key: question}}]"
    sectioned = _config(
        f"source:\n  envs: {envs}\n  dataset: {{rows: {rows}, shuffle: false, epochs: 2}}\n"
    )
    flat = _config(f"envs: {envs}\ndataset: {{rows: {rows}, shuffle: false, epochs: 2}}\n")
    assert sectioned == flat
    assert flat.source.dataset is not None and flat.source.dataset.num_groups == 4
    other = _config(f"envs: {envs}\ndataset: {{rows: {rows}, epochs: 2}}\n")
    assert other != flat  # shuffled
