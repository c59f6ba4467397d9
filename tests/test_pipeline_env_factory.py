"""``RolloutPipeline(env_factory=...)``: the pipeline builds its envs with the given
factory instead of the one ``env_backend`` names (how Ray env workers are placed on
nodes: ``ray_env_factory(actor_options=...)``; tests/distributed/test_cluster_nodes.py)."""

from __future__ import annotations

from typing import Any

from rollpipe.agent.records import EpisodeSpec
from rollpipe.engines.scripted import ScriptedEngine
from rollpipe.envs import FrozenLake, make
from rollpipe.pipeline import PipelineConfig, RolloutPipeline


def test_the_pipeline_builds_every_env_with_the_given_factory(tokenizer: Any) -> None:
    built: list[Any] = []

    def factory(spec: EpisodeSpec) -> Any:
        built.append(make(spec.env_name, **spec.env_kwargs))
        return built[-1]

    right = tokenizer.encode("<answer>Right</answer>")
    config = PipelineConfig(group_size=2, batch_size=4, concurrency=2, max_turns=1)
    with (
        ScriptedEngine(lambda *_: right) as engine,
        RolloutPipeline(config, engine, tokenizer, env_factory=factory) as pipe,
    ):
        batch = pipe.get_batch()
    assert len(batch) == 4 and len(set(batch.non_tensor_batch["traj_uid"])) == 4
    assert 1 <= len(built) <= config.rollout.concurrency  # pooled: one per env slot at most
    assert all(isinstance(env, FrozenLake) for env in built)
