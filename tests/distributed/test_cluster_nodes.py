"""Ray engines and env workers on a cluster of several nodes on this machine.

One ``ray.cluster_utils.Cluster`` per module (``bench.ray_nodes``): a head node that
hosts nothing of ours (the driver joins it) and worker nodes each with a custom resource
naming its role, so every actor lands where its options ask: ``engine_0`` and
``engine_1`` host the two ranks of an ``EnginePool`` of ``RayEngine``s, ``envs`` hosts
the env workers (``ray_env_factory`` with ``{"resources": {"envs": ...}}``, given to the
pipeline as its ``env_factory``). Placement is read from Ray's own actor table (GCS),
not from rollpipe.

The tests run in order on the one cluster and one pipeline (its env workers start once,
its batches are the granted groups in order): placement; the engine node killed mid-batch
(the pool takes its rank out and re-sends its requests: the batch is the groups granted,
none dropped); a new node for that rank and ``expand_sampler`` (requests reach it
again); the env node killed mid-batch (the episodes whose env worker died fail and their
groups are replaced, per docs/ray-envs.md; new env workers start on a replacement node).
A node is killed as Ray's tests kill one: its raylet and workers by SIGKILL
(``remove_node(..., allow_graceful=False)``), chosen when the pool's own counters say the
batch is under way.
"""

from __future__ import annotations

import concurrent.futures
import functools
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from torchdata.nodes import Mapper
from waiting import wait_until

from rollpipe.engines.pool import EnginePool
from rollpipe.engines.ray_engine import RayEngine, WeightStore
from rollpipe.engines.records import EngineError
from rollpipe.engines.vllm import VLLMEngine
from rollpipe.envs.ray_env import ray_env_factory
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

ray = pytest.importorskip("ray")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root holds bench/
from bench.ray_nodes import Nodes, ray_cluster  # noqa: E402  (after the importorskip)

CONFIG = PipelineConfig(
    group_size=2,
    batch_size=8,
    max_turns=2,
    max_length=1024,
    concurrency=4,
    seed=38,
    sampling={"max_tokens": 128, "ignore_eos": True},  # long turns: a kill lands mid-request
)
ENV_WORKERS = ray_env_factory(num_cpus=0.25, actor_options={"resources": {"envs": 0.01}})
DEADLINE_S = 180  # a deadline for states that must come, never an expected duration


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    assert not ray.is_initialized(), "a Ray session from another module is still up"
    with ray_cluster(("engine_0", "engine_1", "envs")) as found:
        yield found


@pytest.fixture(scope="module")
def pool(nodes: Nodes, tiny_model_path: Path) -> Iterator[EnginePool]:
    """Rank ``r`` on the node with the resource ``engine_r`` (``expand`` rebuilds it there)."""
    make = functools.partial(VLLMEngine, str(tiny_model_path), kv_cache_space_gib=0.25)
    store = WeightStore()

    def rank_engine(rank: int) -> RayEngine:
        placed = {"resources": {f"engine_{rank}": 1}}
        return RayEngine(make, num_cpus=1, weights=store, actor_options=placed)

    with concurrent.futures.ThreadPoolExecutor(2) as starting:  # both actors start at once
        first = iter(list(starting.map(rank_engine, (0, 1))))

    def started_first(rank: int) -> RayEngine:  # ranks 0 and 1 take them; expand builds anew
        engine = next(first, None)
        return engine if engine is not None else rank_engine(rank)

    engines = EnginePool(started_first, 2)
    yield engines
    engines.close()


@attrs.define
class Run:
    """The module's pipeline on the pool, and every trajectory its rollout yielded."""

    pipe: RolloutPipeline
    seen: list[Any]

    def since(self, mark: int) -> list[Any]:
        return self.seen[mark:]


@pytest.fixture(scope="module")
def run(pool: EnginePool, tokenizer: Any) -> Iterator[Run]:
    """One pipeline for the module: its env workers start once and serve every batch."""
    seen: list[Any] = []
    hooks = {"rollout": lambda node: Mapper(node, lambda t: seen.append(t) or t)}
    with RolloutPipeline(CONFIG, pool, tokenizer, env_factory=ENV_WORKERS, hooks=hooks) as pipe:
        yield Run(pipe, seen)


def node_of(actor: Any) -> str:
    """The node Ray's actor table (GCS) places ``actor`` on."""
    info = ray._private.state.actors(actor._actor_id.hex())
    return str(info["Address"]["NodeID"])


def node_alive(node_id: str) -> bool:
    """Whether Ray's node table still has ``node_id`` alive (it marks a SIGKILLed node
    dead once its health checks fail)."""
    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


def env_worker_nodes() -> list[str]:
    """The node of every live env worker (``EnvHost`` actor), from Ray's actor table."""
    table = ray._private.state.actors().values()
    return sorted(
        str(a["Address"]["NodeID"])
        for a in table
        if a["ActorClassName"] == "EnvHost" and a["State"] == "ALIVE"
    )


def batch_in_thread(pipe: RolloutPipeline) -> tuple[threading.Thread, dict[str, Any]]:
    """``pipe.get_batch()`` in a thread; its result (or error) lands in the dict."""
    out: dict[str, Any] = {}

    def fetch() -> None:
        try:
            out["batch"] = pipe.get_batch()
        except BaseException as exc:  # re-raised by finished()
            out["error"] = exc

    thread = threading.Thread(target=fetch)
    thread.start()
    return thread, out


def finished(thread: threading.Thread, out: dict[str, Any]) -> Any:
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), f"get_batch did not return within {DEADLINE_S} s"
    if "error" in out:
        raise out["error"]
    return out["batch"]


def requests_on(pool: EnginePool, rank: int | None = None) -> int:
    """Requests in flight through the pool (on ``rank`` only, if given)."""
    return sum(load.requests for load in pool.loads() if rank in (None, load.rank))


def check_complete(batch: Any) -> tuple[set[str], set[int]]:
    """The batch's rows: whole groups, each trajectory once; its traj ids and group ids."""
    ids = [str(uid) for uid in batch.non_tensor_batch["traj_uid"]]
    groups = Counter(batch.batch["traj_group_id"].tolist())
    assert len(batch) == CONFIG.batch_size and len(set(ids)) == len(ids)
    assert set(groups.values()) == {CONFIG.group_size}
    assert "error" not in set(batch.non_tensor_batch["end_reasons"])
    return set(ids), set(groups)


def dropped_errored(run: Run, batch: Any) -> int:
    """Groups dropped for an errored trajectory: in this batch's metrics, or not yet
    reported (dropped after the batch was cut)."""
    metrics = batch.meta_info["metrics"]
    pending = run.pipe.nodes.groups.pending_drops.get("errored", 0)
    return int(metrics.get("dropped/errored", 0)) + pending


def test_engines_and_env_workers_run_on_the_nodes_their_options_name(
    nodes: Nodes, pool: EnginePool, run: Run
) -> None:
    batch = run.pipe.get_batch()
    check_complete(batch)
    assert [node_of(pool.engine(r).actor) for r in (0, 1)] == [  # type: ignore[union-attr]
        nodes.id("engine_0"),
        nodes.id("engine_1"),
    ]
    assert env_worker_nodes() == [nodes.id("envs")] * CONFIG.rollout.concurrency  # a slot each
    assert {rank for _, rank in pool.routing_log} == {0, 1}  # both nodes generated


def test_an_engine_node_lost_mid_batch_loses_no_episode(
    nodes: Nodes, pool: EnginePool, run: Run
) -> None:
    """The rank on the lost node leaves the pool (``failures``), its requests are re-sent
    to rank 0 (``rerouted``) and the batch holds the very groups it was granted (the next
    four), none dropped, each trajectory once."""
    rerouted, mark, victim = pool.rerouted, len(run.seen), pool.engine(1)
    thread, out = batch_in_thread(run.pipe)
    wait_until(lambda: requests_on(pool, 1), DEADLINE_S, "requests in flight on rank 1")
    nodes.kill("engine_1")
    batch = finished(thread, out)
    traj_ids, group_ids = check_complete(batch)
    assert pool.active_ranks == [0] and list(pool.failures()) == [1]
    assert isinstance(pool.failures()[1], EngineError) and "rank 1" in str(pool.failures()[1])
    assert victim is not None and not victim.alive
    assert pool.rerouted > rerouted  # what rank 1 ran was generated again on rank 0
    assert group_ids == {4, 5, 6, 7} and dropped_errored(run, batch) == 0  # none replaced
    seen = run.since(mark)
    assert [t.end_reason for t in seen].count("error") == 0
    assert sorted(t.traj_id for t in seen) == sorted(traj_ids)  # each came out once


def test_a_new_node_brings_the_lost_rank_back_with_expand(
    nodes: Nodes, pool: EnginePool, run: Run
) -> None:
    replacement = nodes.add("engine_1")
    report = run.pipe.expand_sampler([1])
    assert report["load_ranks"] == [1] and pool.active_ranks == [0, 1]
    assert pool.failures() == {}
    assert node_of(pool.engine(1).actor) == replacement.node_id  # type: ignore[union-attr]
    routed_before = len(pool.routing_log)
    check_complete(run.pipe.get_batch())
    later = [rank for _, rank in list(pool.routing_log)[routed_before:]]
    assert 1 in later and 0 in later  # new episodes reach the rank on the new node


def test_an_env_node_lost_mid_batch_fails_its_episodes_and_replaces_their_groups(
    nodes: Nodes, pool: EnginePool, run: Run
) -> None:
    """The episodes whose env worker died end as errors and their groups are dropped and
    replaced (docs/ray-envs.md); env workers start again on a node that has the resource."""
    mark, lost = len(run.seen), nodes.id("envs")
    thread, out = batch_in_thread(run.pipe)
    wait_until(lambda: requests_on(pool), DEADLINE_S, "episodes generating")
    nodes.kill("envs")
    replacement = nodes.add("envs")  # the env slots' next resets start actors here
    batch = finished(thread, out)
    traj_ids, group_ids = check_complete(batch)
    seen = run.since(mark)
    errors = [t for t in seen if t.end_reason == "error"]
    assert errors, "no episode noticed its env worker's death"
    for t in errors:
        assert t.error.startswith("RayEnvError(") and "during" in t.error, t.error
    failed_groups = {t.group_id for t in errors}
    assert dropped_errored(run, batch) == len(failed_groups)  # each dropped once, replaced
    assert not failed_groups & group_ids and not {t.traj_id for t in errors} & traj_ids
    wait_until(lambda: not node_alive(lost), DEADLINE_S, "Ray to mark the lost node dead")
    live = env_worker_nodes()  # its actors are dead in Ray's table too, now
    assert live and set(live) == {str(replacement.node_id)} and lost not in live
    done = [t.traj_id for t in seen if t.end_reason != "error"]
    assert len(done) == len(set(done))  # no trajectory came out twice


def test_episode_workers_on_a_lost_node_are_replaced_and_their_episodes_run_again(
    nodes: Nodes, pool: EnginePool, tokenizer: Any
) -> None:
    """Episode workers (``rollpipe.workers``) on a node of their own, the engines on
    theirs: the workers' node killed mid-batch, a new one added; the slots' new workers
    start there, the episodes they were running run again from their specs, and the batch
    is whole with no error and each trajectory once (docs/episode-workers.md)."""
    nodes.add("workers", num_cpus=2)
    placed = {"resources": {"workers": 0.01}, "num_cpus": 0.5}
    config = CONFIG.replace(
        rollout={"concurrency": 4, "episode_workers": 2, "worker_options": placed}
    )
    seen: list[Any] = []
    hooks = {"rollout": lambda node: Mapper(node, lambda t: seen.append(t) or t)}
    with RolloutPipeline(config, pool, tokenizer, hooks=hooks) as pipe:
        workers = pipe.nodes.rollout.workers
        check_complete(pipe.get_batch())
        lost = nodes.id("workers")
        assert [node_of(actor) for actor in workers.actors] == [lost, lost]
        thread, out = batch_in_thread(pipe)
        wait_until(
            lambda: requests_on(pool) and any(link.running for link in workers._links),
            DEADLINE_S,
            "episodes running on the workers, generating",
        )
        nodes.kill("workers")
        replacement = nodes.add("workers", num_cpus=2)
        batch = finished(thread, out)
        check_complete(batch)
        # each slot replaced at least once; a replacement Ray placed on the lost node before
        # it was marked dead dies too and is replaced again (counted: 3 or 4 happen)
        assert workers.replaced >= 2 and workers.reruns >= 1
        assert [node_of(actor) for actor in workers.actors] == [str(replacement.node_id)] * 2
    assert [t.end_reason for t in seen].count("error") == 0
    ids = [t.traj_id for t in seen]
    assert len(ids) == len(set(ids))  # a re-run episode came out once
