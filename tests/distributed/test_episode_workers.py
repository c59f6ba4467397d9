"""Episode workers (``rollout={"episode_workers": N}``) on real Ray and the real vLLM engine.

Every episode runs in a worker process (a Ray actor with its own loop); the driver admits,
routes and generates each request. What must hold: the same seed gives the same rows as
in-process; suspend, weight updates and checkpoints keep their meaning; a worker killed
mid-batch is replaced and its episodes run again, nothing lost or duplicated; tool and
agent episodes (the ``openai`` client and its front door) run on the workers, not on the
driver.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from tool_support import tools_model_path
from waiting import wait_until

from rollpipe.agent.episode import EpisodeSettings
from rollpipe.config import PipelineConfig
from rollpipe.data.proto import DataProto
from rollpipe.frontdoor import AgentEnv
from rollpipe.pipeline import RolloutPipeline
from rollpipe.workers import ENV_IDS_PER_WORKER

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the envs below, by value

DEADLINE_S = 300.0  # a deadline on a busy 2-core machine, never an expected duration


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    ray.init(
        address="local",  # never another session's cluster
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=200 << 20,
    )
    yield
    ray.shutdown()


def frozenlake_config(workers: int, **kw: Any) -> PipelineConfig:
    settings: dict[str, Any] = {
        "group_size": 2,
        "batch_size": 4,
        "num_groups": 64,
        "max_turns": 3,
        "rollout": {"episode_workers": workers, "concurrency": 4},
    }
    return PipelineConfig(**(settings | kw))


def batches(config: PipelineConfig, engine: Any, tokenizer: Any, n: int) -> list[DataProto]:
    with RolloutPipeline(config, engine, tokenizer) as pipe:
        return [pipe.get_batch() for _ in range(n)]


def assert_same_rows(a: DataProto, b: DataProto, version: int | None = None) -> None:
    """Bitwise the same rows; ``env_ids`` name instances per worker (ENV_IDS_PER_WORKER).
    ``version``: ``b`` was generated after weight updates (the shared engine's tests before
    it): its tokens carry that version where ``a``'s carry theirs."""
    keys = sorted(a.batch.keys())
    assert keys == sorted(b.batch.keys())
    for key in keys:
        if key == "policy_versions" and version is not None:
            generated = a.batch[key] >= 0
            assert torch.equal(generated, b.batch[key] >= 0), key
            assert set(b.batch[key][generated].tolist()) == {version}, key
        elif key != "env_ids":
            assert torch.equal(a.batch[key], b.batch[key]), key
    assert a.non_tensor_batch.keys() == b.non_tensor_batch.keys()
    for key, column in a.non_tensor_batch.items():
        assert column.tolist() == b.non_tensor_batch[key].tolist(), key


@contextlib.contextmanager
def next_batch_in_thread(pipe: RolloutPipeline) -> Iterator[list[DataProto]]:
    """``get_batch()`` on a thread while the block runs; its batch in the list after."""
    got: list[DataProto] = []
    thread = threading.Thread(target=lambda: got.append(pipe.get_batch()), daemon=True)
    thread.start()
    yield got
    thread.join(DEADLINE_S)
    assert got, "get_batch() on the thread did not return"


@pytest.fixture(scope="module")
def reference(vllm_engine: Any, tokenizer: Any) -> list[DataProto]:
    """Three FrozenLake batches run in-process: what every worker run must reproduce."""
    return batches(frozenlake_config(0), vllm_engine, tokenizer, 3)


def test_workers_give_the_rows_of_the_in_process_run(
    reference: list[DataProto], vllm_engine: Any, tokenizer: Any
) -> None:
    with RolloutPipeline(frozenlake_config(2), vllm_engine, tokenizer) as pipe:
        got = [pipe.get_batch() for _ in range(3)]
        workers = pipe.nodes.rollout.workers
        stats = [ray.get(actor.stats.remote()) for actor in workers.actors]
    for a, b in zip(reference, got, strict=True):
        assert_same_rows(a, b)
    assert sum(s["started"] for s in stats) >= 12  # every episode ran on a worker...
    assert all(s["started"] > 0 for s in stats)  # ...on both of them
    assert {s["pid"] for s in stats}.isdisjoint({os.getpid()})
    slots = {int(e) // ENV_IDS_PER_WORKER for b in got for e in b.batch["env_ids"].tolist()}
    assert slots <= {0, 1} and slots


def test_a_checkpoint_taken_with_workers_resumes_the_same_stream(
    reference: list[DataProto], vllm_engine: Any, tokenizer: Any
) -> None:
    with RolloutPipeline(frozenlake_config(1), vllm_engine, tokenizer) as pipe:
        assert_same_rows(reference[0], pipe.get_batch())
        state = pipe.state_dict()  # episodes in flight on the worker are recorded as specs
    with RolloutPipeline(frozenlake_config(1), vllm_engine, tokenizer) as fresh:
        fresh.load_state_dict(state)
        assert_same_rows(reference[1], fresh.get_batch())
        assert_same_rows(reference[2], fresh.get_batch())


@pytest.fixture(scope="module")
def weights(tiny_model_path: Path) -> dict[str, torch.Tensor]:
    """The tiny model's own weights (an update that changes the version only)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
def test_suspend_and_a_weight_update_with_workers(
    mode: str, vllm_engine: Any, tokenizer: Any, weights: dict[str, torch.Tensor]
) -> None:
    with RolloutPipeline(frozenlake_config(2), vllm_engine, tokenizer) as pipe:
        first = pipe.get_batch()
        workers = pipe.nodes.rollout.workers
        with next_batch_in_thread(pipe) as second:
            # the suspend comes while the next batch's requests are under way on the workers
            wait_until(lambda: workers._serving, DEADLINE_S, "requests in flight")
            with pipe.suspended(mode):  # type: ignore[arg-type]
                version = pipe.update_weights(weights)
        after = [second[0], pipe.get_batch()]
    ids = [i for b in (first, *after) for i in b.batch["traj_id"].tolist()]
    assert len(ids) == len(set(ids)) == 12  # nothing lost or duplicated
    newest = max(int(b.batch["policy_versions"].max()) for b in after)
    assert newest == version  # tokens generated after the update carry its version


def test_a_killed_worker_is_replaced_and_its_episodes_run_again(
    reference: list[DataProto], vllm_engine: Any, tokenizer: Any
) -> None:
    with RolloutPipeline(frozenlake_config(2), vllm_engine, tokenizer) as pipe:
        assert_same_rows(reference[0], pipe.get_batch(), vllm_engine.version)
        workers = pipe.nodes.rollout.workers
        with next_batch_in_thread(pipe) as second:
            victim = wait_until(
                lambda: next((link for link in workers._links if link.running), None),
                DEADLINE_S,
                "a worker running episodes",
            )
            ray.kill(victim.actor, no_restart=True)
        rest = [second[0], pipe.get_batch()]
        assert workers.replaced == 1
        # the dead worker's episodes, each run once more: at least the one it was running,
        # at most the pipeline's concurrency (never more in flight; its count when killed
        # is no bound: episodes go on being placed on it until its death is seen)
        concurrency = pipe.config.rollout.concurrency
        assert 1 <= workers.reruns <= concurrency
    for a, b in zip(reference[1:], rest, strict=True):
        assert_same_rows(a, b, vllm_engine.version)  # the re-run episodes are the same


def calculator_config(workers: int) -> PipelineConfig:
    return PipelineConfig(
        envs="calculator",
        group_size=2,
        batch_size=4,
        num_groups=4,
        episode=EpisodeSettings(
            tool_parser="hermes", max_turns=2, max_length=1024, sampling={"max_tokens": 24}
        ),
        rollout={"episode_workers": workers, "concurrency": 8},
    )


def test_tool_episodes_on_workers_give_the_in_process_rows(tools_vllm_engine: Any) -> None:
    tokenizer = tools_model_path()
    reference = batches(calculator_config(0), tools_vllm_engine, tokenizer, 1)
    got = batches(calculator_config(2), tools_vllm_engine, tokenizer, 1)
    assert_same_rows(reference[0], got[0])


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]


async def pid_agent(pids: Path, client: Any, task: str) -> float:
    """Two calls through the front door; notes the process the agent runs in."""
    with pids.open("a") as out:
        out.write(f"{os.getpid()}\n")
    messages: list[Any] = [{"role": "user", "content": task}]
    for _ in range(2):
        reply = await client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, max_tokens=12
        )
        messages.append(reply.choices[0].message)
        messages.append({"role": "user", "content": "And then?"})
    return 1.0


def test_agents_run_on_the_workers_with_their_own_front_door(
    tools_vllm_engine: Any, tmp_path: Path
) -> None:
    pids = tmp_path / "agent-pids"
    agent = functools.partial(pid_agent, pids)

    def agent_env_for(spec: Any) -> AgentEnv:
        return AgentEnv(agent, task=lambda seed: f"What is {seed % 50} + 3?")

    config = PipelineConfig(
        group_size=2,
        batch_size=4,
        num_groups=2,
        episode=EpisodeSettings(tool_parser="hermes", max_length=1024),
        rollout={"episode_workers": 2, "concurrency": 4},
    )
    with RolloutPipeline(
        config, tools_vllm_engine, tools_model_path(), env_factory=agent_env_for
    ) as pipe:
        batch = pipe.get_batch()
        workers = {ray.get(a.stats.remote())["pid"] for a in pipe.nodes.rollout.workers.actors}
    assert batch.non_tensor_batch["end_reasons"].tolist() == ["terminated"] * 4
    agents = {int(line) for line in pids.read_text().split()}
    assert agents and agents <= workers  # every agent ran in a worker process...
    assert os.getpid() not in agents  # ...none on the driver
    # each agent's two calls became one row of exact ids, scored by the agent
    assert batch.batch["scores"].sum(-1).tolist() == [1.0] * 4
    assert int(batch.batch["response_mask"].sum()) > 0


def test_an_engine_pool_keeps_each_worker_episode_on_one_rank(tokenizer: Any) -> None:
    """Routing stays the driver's: every request of an episode run on a worker goes to the
    rank its first went to (the route's rank travels with each request and answer). The
    pool's ranks are scripted engines: the test is about routing, not generation."""
    from rollpipe.engines.pool import EnginePool
    from rollpipe.engines.scripted import ScriptedEngine

    answer = tokenizer("Up", add_special_tokens=False)["input_ids"]
    with (
        EnginePool(lambda rank: ScriptedEngine(lambda p, s: answer), 2) as pool,
        RolloutPipeline(frozenlake_config(2), pool, tokenizer) as pipe,
    ):
        batch = pipe.get_batch()
        log = list(pool.routing_log)
    ranks: dict[Any, set[int]] = {}
    for key, rank in log:
        ranks.setdefault(key, set()).add(rank)
    assert len(batch) == 4 and None not in ranks  # every request carried its route
    assert len(ranks) >= 4 and all(len(r) == 1 for r in ranks.values())
    assert {r for rs in ranks.values() for r in rs} == {0, 1}  # both ranks served
    turns = sum(1 for _ in log)
    assert turns > len(ranks)  # episodes of several turns, each kept on its rank


def test_async_generation_ratio_bounds_staleness_with_workers(
    vllm_engine: Any, tokenizer: Any, weights: dict[str, torch.Tensor]
) -> None:
    """ROLL's loop (get_batch, suspend, update, resume) with ``async_generation_ratio=1``:
    collection runs ahead on the workers between updates, and no batch holds a response
    token more than one version behind the weights it is trained on."""
    config = frozenlake_config(2, async_generation_ratio=1)
    seen: list[int] = []
    with RolloutPipeline(config, vllm_engine, tokenizer) as pipe:
        for _ in range(3):
            batch = pipe.get_batch()
            mask = batch.batch["response_mask"].bool()
            oldest = int(batch.batch["policy_versions"][mask].min())
            assert pipe.version - oldest <= 1, (pipe.version, oldest)
            seen += batch.batch["traj_id"].tolist()
            with pipe.suspended():
                pipe.update_weights(weights)
    assert len(seen) == len(set(seen)) == 12  # none lost to the workers, none twice
