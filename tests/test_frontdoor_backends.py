"""An agent episode needs the engine's loop: ``env_backend="ray"`` (text envs hosted in
Ray actors) cannot run an ``AgentEnv``, and says so, naming what to use instead, before
any actor starts or any request reaches the engine."""

from __future__ import annotations

from typing import Any

import pytest
from tool_support import tools_model_path

from rollpipe.config import PipelineConfig
from rollpipe.engines.scripted import ScriptedEngine
from rollpipe.envs import register
from rollpipe.envs.ray_env import check_hostable
from rollpipe.frontdoor import AgentEnv
from rollpipe.pipeline import RolloutPipeline


async def agent(client: Any, task: Any) -> float:
    raise AssertionError("the agent must not run under env_backend='ray'")


register("frontdoor-ray-agent", lambda: AgentEnv(agent), overwrite=True)
SAYS = r"env 'frontdoor-ray-agent' is an AgentEnv: .*Use env_backend='local'.*FrontDoor"


def test_an_agent_env_is_not_hostable_by_a_ray_worker() -> None:
    with pytest.raises(ValueError, match=SAYS):
        check_hostable("frontdoor-ray-agent", {})
    check_hostable("frozenlake", {})  # a text env is


def test_a_ray_backed_pipeline_of_agents_fails_before_any_actor_or_request() -> None:
    config = PipelineConfig(
        envs="frontdoor-ray-agent", env_backend="ray", group_size=2, batch_size=2
    )
    requests: list[Any] = []

    def policy(prompt: Any, params: Any) -> list[int]:
        requests.append(prompt)
        return [0]

    with (
        ScriptedEngine(policy) as engine,
        RolloutPipeline(config, engine, tools_model_path()) as pipe,
        pytest.raises(ValueError, match=SAYS),
    ):
        pipe.get_batch()
    assert requests == []
