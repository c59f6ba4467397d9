"""EnginePool: two real vLLM engines behind one, with ROLL's shrink / expand.

Every test starts and ends with both ranks in the pool, resumed, at the original weights.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from waiting import wait_until

from rollpipe.data.proto import DataProto
from rollpipe.engines.pool import EnginePool
from rollpipe.engines.records import SamplingParams
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

CONFIG = PipelineConfig(
    envs="frozenlake",
    group_size=4,
    batch_size=8,
    max_turns=3,
    max_length=512,
    concurrency=8,
    seed=5,
    sampling={"max_tokens": 16},
)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pool(tiny_model_path: Path) -> Iterator[EnginePool]:
    engines = EnginePool.vllm(tiny_model_path, 2, kv_cache_space_gib=0.25, max_model_len=2048)
    yield engines
    engines.close()


@pytest.fixture(scope="module")
def hf_model(tiny_model_path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path)).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture
def fresh(pool: EnginePool, hf_model: Any) -> Iterator[EnginePool]:
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    yield pool
    hf_model.load_state_dict(original)
    if pool.is_paused:
        pool.resume()
    out = [r for r in range(pool.num_engines) if r not in pool.active_ranks]
    if out:
        pool.expand(sorted(d for r in out for d in pool.rank_devices(r)))
    pool.update_weights(original)


def perturb(model: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def rank_1_busy(pool: EnginePool) -> Callable[[], bool]:
    return lambda: any(load.rank == 1 and load.requests for load in pool.loads())


def response_versions(batch: DataProto) -> set[int]:
    mask = batch.batch["response_mask"].bool()
    return set(batch.batch["policy_versions"][mask].tolist())


def check_whole(batches: list[DataProto], group_size: int = 4) -> None:
    """Every batch holds whole groups; no trajectory appears twice across batches."""
    seen: list[int] = []
    for batch in batches:
        groups = Counter(batch.batch["traj_group_id"].tolist())
        assert all(n == group_size for n in groups.values()), groups
        seen += batch.batch["traj_id"].tolist()
    assert len(seen) == len(set(seen)), "a trajectory was duplicated"


def in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # surfaced by the test
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def joined(thread: threading.Thread, out: dict[str, Any], timeout: float = 120.0) -> Any:
    thread.join(timeout)
    assert not thread.is_alive(), "get_batch did not return"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_every_turn_of_an_episode_reaches_one_rank(fresh: EnginePool, tokenizer: Any) -> None:
    start = len(fresh.routing_log)
    with RolloutPipeline(CONFIG, fresh, tokenizer) as pipe:
        batch = pipe.get_batch()
    log = list(fresh.routing_log)[start:]
    ranks: defaultdict[Any, set[int]] = defaultdict(set)
    for episode, rank in log:
        ranks[episode].add(rank)
    assert all(len(r) == 1 for r in ranks.values()), ranks  # sticky across turns
    assert set(ranks) == set(batch.batch["traj_id"].tolist())
    assert set().union(*ranks.values()) == {0, 1}  # new episodes spread by load
    turns = sum(len(s) for s in batch.non_tensor_batch["step_scores"])
    assert len(log) == turns  # one routed request per turn, none re-sent


@pytest.mark.parametrize("mode", [None, "keep", "abort", "wait"])
def test_shrink_mid_batch_then_update_and_expand(
    fresh: EnginePool, tokenizer: Any, hf_model: Any, mode: str | None
) -> None:
    """ROLL's partial-GPU step: shrink while a batch is being generated (suspended in
    ``mode`` or running), update the weights, expand back; the batch stays whole, its
    tokens are all of the new weights, and greedy outputs equal transformers'."""
    cfg = CONFIG.replace(sampling={"max_tokens": 400, "ignore_eos": True}, seed=7)
    with RolloutPipeline(cfg, fresh, tokenizer) as pipe:
        first = pipe.get_batch()
        rerouted = fresh.rerouted
        thread, out = in_background(pipe.get_batch)
        # 400 tokens a turn (of max_length 512): far more steps than the next call takes
        wait_until(rank_1_busy(fresh), 30, "a request on rank 1")
        if mode is not None:
            pipe.suspend(mode)
        shrunk = pipe.shrink_sampler([1])
        assert shrunk["offload_ranks"] == [1] and fresh.active_ranks == [0]
        assert set(shrunk) >= {"aborted", "remapped", "offload_ranks", "shrink_duration_ms"}
        if mode == "keep":  # frozen requests were on rank 1: aborted there, re-sent
            assert shrunk["aborted"] >= 1 and shrunk["remapped"] >= 1
        perturb(hf_model, seed=3)
        version = pipe.update_weights(hf_model)
        expanded = pipe.expand_sampler([1])
        assert expanded["load_ranks"] == [1] and fresh.active_ranks == [0, 1]
        assert expanded["expand_duration_ms"] > 0
        if mode is not None:
            pipe.resume()
        second = joined(thread, out)
        third = pipe.get_batch()
    assert fresh.rerouted >= rerouted + shrunk["aborted"]
    check_whole([first, second, third])
    assert response_versions(third) == {version}
    assert len(second) == 8 and response_versions(second) <= {version - 1, version}
    prompts = [list(range(3, 15)), list(range(40, 47))]
    greedy = fresh.generate_batch(prompts * 4, GREEDY)  # spread over both ranks
    expected = [hf_greedy(hf_model, p, 12) for p in prompts] * 4
    assert [list(g.token_ids) for g in greedy] == expected
    assert all(set(g.versions) == {version} for g in greedy)


def test_expand_with_skip_load_refuses_a_rank_behind(fresh: EnginePool, hf_model: Any) -> None:
    fresh.shrink([1])
    perturb(hf_model, seed=4)
    version = fresh.update_weights(hf_model)
    with pytest.raises(ValueError, match=rf"rank 1 .* version 0 but the pool is at {version}"):
        fresh.expand([1], skip_load=True)
    assert fresh.active_ranks == [0] and fresh.engine(1) is None  # nothing changed
    fresh.expand([1])
    assert fresh.engine(1) is not None and fresh.engine(1).version == version
    fresh.shrink([0])  # only the expanded rank generates now
    prompt = list(range(5, 20))
    (gen,) = fresh.generate_batch([prompt], GREEDY)
    assert list(gen.token_ids) == hf_greedy(hf_model, prompt, 12)


def test_skip_load_accepts_a_rank_at_the_pool_version(fresh: EnginePool) -> None:
    assert fresh.update_weights({"model.norm.weight": _norm()}, version=0) == 0
    fresh.shrink([1])
    result = fresh.expand([1], skip_load=True)  # rebuilt from the checkpoint: version 0
    assert result["load_ranks"] == [1] and fresh.active_ranks == [0, 1]


@functools.cache
def _norm() -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from rollpipe.training.tiny_model import default_model_path

    model = AutoModelForCausalLM.from_pretrained(str(default_model_path()))
    return model.state_dict()["model.norm.weight"]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: p.shrink([]), "target_gpus is empty"),
        (lambda p: p.shrink([1, 1]), r"duplicates \[1\]"),
        (lambda p: p.shrink([7]), r"unknown devices \[7\]"),
        (lambda p: p.shrink(["0"]), "device ids are ints"),
        (lambda p: p.shrink([0, 1]), "every active rank"),
        (lambda p: p.expand([0]), r"rank 0 \(devices \[0\]\) already in the pool"),
        (lambda p: p.expand([0], skip_load=True), "already in the pool"),
    ],
)
def test_bad_calls_fail_at_once_and_change_nothing(
    fresh: EnginePool, call: Callable[[EnginePool], Any], message: str
) -> None:
    engines = [fresh.engine(r) for r in range(2)]
    with pytest.raises(ValueError, match=message):
        call(fresh)
    assert fresh.active_ranks == [0, 1] and [fresh.engine(r) for r in range(2)] == engines


def test_shrinking_a_rank_already_out_is_an_error(fresh: EnginePool) -> None:
    fresh.shrink([0])
    with pytest.raises(ValueError, match=r"rank 0 \(devices \[0\]\) already out"):
        fresh.shrink([0])
    with pytest.raises(ValueError, match="every active rank"):
        fresh.shrink([1])
    assert fresh.active_ranks == [1]


def test_a_rank_whose_engine_dies_is_taken_out_and_its_requests_rerouted(
    fresh: EnginePool, tokenizer: Any
) -> None:
    cfg = CONFIG.replace(sampling={"max_tokens": 400, "ignore_eos": True}, seed=9)
    with RolloutPipeline(cfg, fresh, tokenizer) as pipe:
        thread, out = in_background(pipe.get_batch)
        # 400 tokens a turn (of max_length 512): far more steps than the next call takes
        wait_until(rank_1_busy(fresh), 30, "a request on rank 1")
        dying = fresh.engine(1)
        assert dying is not None
        dying.close()  # behind the pool's back, mid-request
        batch = joined(thread, out)
    check_whole([batch])
    assert len(batch) == 8
    assert fresh.active_ranks == [0] and set(fresh.failures()) == {1}
    fresh.expand([1])  # rebuilt
    assert fresh.active_ranks == [0, 1] and fresh.failures() == {}


def test_pipeline_without_a_pool_says_what_shrink_needs(vllm_engine: Any, tokenizer: Any) -> None:
    with (
        RolloutPipeline(CONFIG, vllm_engine, tokenizer) as pipe,
        pytest.raises(TypeError, match=r"shrink_sampler needs .* EnginePool"),
    ):
        pipe.shrink_sampler([0])


OPS = ("shrink0", "shrink1", "expand0", "expand1", "keep", "abort", "wait", "resume", "update")


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(st.sampled_from(OPS), min_size=2, max_size=6), seed=st.integers(0, 99))
def test_any_control_sequence_during_batches_loses_nothing(
    fresh: EnginePool, tokenizer: Any, ops: list[str], seed: int
) -> None:
    """Shrink / expand / suspend / resume / update_weights in any order while a batch is
    being generated in another thread: every batch comes back whole, in bounded time,
    and no trajectory is lost or duplicated; an invalid shrink / expand (the last rank,
    a rank already in or out) fails and changes nothing."""
    cfg = CONFIG.replace(sampling={"max_tokens": 32, "ignore_eos": True}, seed=seed)
    batches: list[DataProto] = []
    with RolloutPipeline(cfg, fresh, tokenizer) as pipe:
        thread, out = in_background(pipe.get_batch)
        suspended = False
        for op in ops:
            if op.startswith(("shrink", "expand")):
                rank = int(op[-1])
                active = fresh.active_ranks
                valid = (
                    (rank in active and len(active) > 1)
                    if op.startswith("shrink")
                    else (rank not in active)
                )
                call = fresh.shrink if op.startswith("shrink") else fresh.expand
                if valid:
                    call([rank])
                else:
                    with pytest.raises(ValueError):
                        call([rank])
                    assert fresh.active_ranks == active
            elif op in ("keep", "abort", "wait") and not suspended:
                pipe.suspend(op)
                suspended = True
            elif op == "resume" and suspended:
                pipe.resume()
                suspended = False
            elif op == "update":
                pipe.update_weights(fresh_weights())
            if not thread.is_alive():  # that batch is done: start the next one
                batches.append(joined(thread, out))
                thread, out = in_background(pipe.get_batch)
        if suspended:
            pipe.resume()
        batches.append(joined(thread, out, timeout=60))
    assert all(len(b) == 8 for b in batches)
    check_whole(batches)


def fresh_weights() -> dict[str, torch.Tensor]:
    """The checkpoint's final norm: a real (if unchanged) weight update."""
    return {"model.norm.weight": _norm()}


def test_a_streamed_request_whose_rank_leaves_continues_on_another(fresh: EnginePool) -> None:
    """The ids already streamed stay: the request goes on from them on the other rank,
    with the budget left, instead of starting again (which would repeat them)."""
    import asyncio

    streamed: list[int] = []
    params = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)  # many steps
    thread, out = in_background(
        lambda: asyncio.run(fresh.generate([5, 6, 7], params, on_tokens=streamed.extend))
    )
    wait_until(lambda: len(streamed) > 0, 60, "the first streamed ids")
    (busy,) = [load.rank for load in fresh.loads() if load.requests]
    fresh.shrink(sorted(fresh.rank_devices(busy)))  # it leaves mid-request
    gen = joined(thread, out)
    assert list(gen.token_ids) == streamed and len(streamed) == 1500  # none twice, none lost
    assert gen.finish_reason == "length" and fresh.active_ranks == [1 - busy]
