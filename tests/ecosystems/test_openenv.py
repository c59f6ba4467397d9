"""OpenEnv through ``OpenEnvEnv``: an OpenEnv env served by OpenEnv's own server (started by
the adapter, or running at a URL), a real batch on vLLM, a player that earns the env's
reward, the server stopped with its last client. ``nox -s openenv``."""

from __future__ import annotations

import asyncio
import re

import pytest

pytest.importorskip("openenv.core", reason="openenv-core is not installed: run `nox -s openenv`")

from playing import first_prompts, known_rate, play, real_batch

from rollpipe.envs.adapters.openenv import OpenEnvEnv
from rollpipe.envs.adapters.openenv_server import release, shared_server
from rollpipe.pipeline import PipelineConfig

OE = "rollpipe.envs.adapters.openenv:OpenEnvEnv"
APP = "openenv_guess:app"  # tests/ecosystems/openenv_guess.py


@pytest.fixture(scope="module")
def guess_server():
    """The APP server, started once: the adapters naming APP share it (so do the tests)."""
    server = shared_server(APP, startup_timeout_s=60)
    yield server
    release(server)


class BinarySearch:
    """Guesses the middle of what the env's hints leave open (1..32)."""

    def __init__(self) -> None:
        self.low, self.high, self.guess = 1, 32, 0

    def __call__(self, observation: str) -> str:
        if observation.startswith("Higher"):
            self.low = self.guess + 1
        elif observation.startswith("Lower"):
            self.high = self.guess - 1
        self.guess = (self.low + self.high) // 2
        return f"<guess>{self.guess}</guess>"


def test_a_real_batch_on_the_vllm_engine(vllm_engine, tokenizer, guess_server) -> None:
    batch = real_batch(vllm_engine, tokenizer, OE, {"app": APP})
    assert all("Guess my number between 1 and 32" in p for p in first_prompts(batch, tokenizer))
    known_rate(batch.meta_info["metrics"], "env/eco/valid_action_rate")


def test_a_player_that_plays_well_earns_the_envs_reward(tokenizer, guess_server) -> None:
    env = OpenEnvEnv(app=APP)
    try:
        for seed in range(4):  # binary search finds 1..32 within the env's 6 turns
            trajectory = play(env, BinarySearch(), tokenizer, seed, turns=6)
            assert trajectory.end_reason == "terminated", trajectory.error
            assert trajectory.success and trajectory.score == 1.0
            assert all(t.action_valid for t in trajectory.turns)
        assert env._server is guess_server  # one server per app per process
    finally:
        env.close()


def test_a_server_given_by_url(guess_server) -> None:
    env = OpenEnvEnv(url=guess_server.url, observation_field="text")

    async def episode() -> str:
        await env.reset(3)
        obs, reward, done, _, info = await env.step("no guess")
        assert info["action_valid"] is False and not done and reward == 0.0
        return obs

    assert asyncio.run(episode()) == "Answer like <guess>7</guess>."
    env.close()
    assert guess_server.alive  # a server given by URL is not the adapter's to stop


def test_too_few_sessions_on_the_server_says_what_to_do() -> None:
    first, second = (
        OpenEnvEnv(app="openenv_guess:one_session_app"),
        OpenEnvEnv(app="openenv_guess:one_session_app"),
    )

    async def both() -> None:
        await first.reset(0)
        await second.reset(0)

    try:
        with pytest.raises(RuntimeError, match=re.escape("max_concurrent_envs=N")):
            asyncio.run(both())
        server = first._server
        assert server is not None and server.alive
    finally:
        first.close()
        second.close()
    assert not server.alive  # its last client closed: the adapter stopped the server


def test_bad_targets_fail_when_the_config_is_built() -> None:
    for config in ({}, {"url": "http://127.0.0.1:1", "app": APP}, {"url": "localhost:8000"}):
        with pytest.raises(ValueError, match="url"):
            PipelineConfig(envs=[{"name": OE, "config": config}])
    with pytest.raises(ValueError, match="no_such_module:app"):
        PipelineConfig(envs=[{"name": OE, "config": {"app": "no_such_module:app"}}])
