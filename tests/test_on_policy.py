"""On-policy by default, ROLL's scheduler calls as written, validation passes.

ROLL's defaults: ``async_generation_ratio=0`` (a batch holds only tokens of the current
weights), ``suspend()`` aborts in-flight requests, ``get_batch(data, batch_size)`` resumes
a suspended scheduler, ``shutdown()``; each validation ``get_batch(-1)`` is a full pass.
"""

from __future__ import annotations

import torch

from rollpipe.data.proto import DataProto
from rollpipe.pipeline import PipelineConfig, RolloutPipeline


def config(**changes) -> PipelineConfig:
    base = dict(
        envs="frozenlake",
        group_size=4,
        batch_size=8,
        max_turns=3,
        max_length=512,
        concurrency=16,
        seed=11,
        sampling={"max_tokens": 16},
    )
    return PipelineConfig(**(base | changes))


def response_versions(batch: DataProto) -> set[int]:
    mask = batch.batch["response_mask"].bool()
    return set(batch.batch["policy_versions"][mask].unique().tolist())


def weights_of(engine_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(engine_path, dtype=torch.float32)


def test_default_batches_hold_only_the_current_policy(vllm_engine, tokenizer, tiny_model_path):
    """The seed's loop: suspend -> model update -> get_batch(data, batch_size), as written."""
    policy = weights_of(tiny_model_path)
    pipe = RolloutPipeline(config(), vllm_engine, tokenizer)
    try:
        for step in range(4):
            pipe.suspend()  # ROLL: abort all in-flight requests and wait
            version = pipe.update_weights(policy)
            batch = pipe.get_batch(DataProto(meta_info={"global_step": step}), 8)  # resumes
            assert batch is not None and len(batch) == 8
            assert response_versions(batch) == {version}
            assert batch.meta_info["global_step"] == step
            assert batch.meta_info["metrics"]["dropped/wasted_tokens"] == 0  # nothing stale
            # nothing runs ahead: the source issued exactly the groups granted so far
            assert pipe.nodes.source._group == 2 * (step + 1)
    finally:
        pipe.shutdown()
    assert pipe.nodes.rollout._closed


def test_async_ratio_bounds_how_far_generation_runs_ahead(vllm_engine, tokenizer):
    pipe = RolloutPipeline(config(async_generation_ratio=1), vllm_engine, tokenizer)
    with pipe:
        pipe.get_batch()
        # one batch ahead was granted at the start: 2 batches' groups, no more
        assert pipe.nodes.signals.requests_made == 4
        pipe.get_batch()
        assert pipe.nodes.signals.requests_made == 6


def test_each_validation_pass_is_fresh_and_identical(vllm_engine, tokenizer):
    """A val pipeline shares the training pipeline's engine; every get_batch(-1) runs the
    same episodes again, even while the training pipeline is suspended."""
    train = RolloutPipeline(config(), vllm_engine, tokenizer)
    val = RolloutPipeline(config(num_groups=2, seed=99), vllm_engine, tokenizer)
    with train, val:
        train.get_batch()
        train.suspend()
        passes = [val.get_batch(-1) for _ in range(2)]
        train.get_batch()
    assert all(p is not None and len(p) == 8 for p in passes)
    first, second = passes
    assert list(first.non_tensor_batch["traj_uid"]) == list(second.non_tensor_batch["traj_uid"])
    assert torch.equal(first.batch["input_ids"], second.batch["input_ids"])


def test_max_traj_per_env_starts_more_and_first_finishers_fill_on_policy_batches(
    vllm_engine, tokenizer, tiny_model_path
):
    """ROLL's over-provisioning: 1 trajectory per env slot x 12 slots = 3 groups a step for
    2-group batches; the surplus group never leaks old-policy tokens into a later batch."""
    policy = weights_of(tiny_model_path)
    cfg = config(max_traj_per_env=1, concurrency=12)
    assert cfg.groups_per_step == 3 and not cfg.admission_order
    pipe = RolloutPipeline(cfg, vllm_engine, tokenizer)
    with pipe:
        first = pipe.get_batch(DataProto(meta_info={"global_step": 0}), 8)
        assert first is not None and len(first) == 8
        assert pipe.nodes.signals.requests_made == 3
        for step in (1, 2):
            pipe.suspend()
            version = pipe.update_weights(policy)
            batch = pipe.get_batch(DataProto(meta_info={"global_step": step}), 8)
            assert batch is not None and len(batch) == 8
            assert response_versions(batch) == {version}
        assert pipe.nodes.signals.requests_made >= 9  # 3 a step, plus replacements


def test_global_step_must_be_a_count_that_never_goes_back(vllm_engine, tokenizer):
    with RolloutPipeline(config(), vllm_engine, tokenizer) as pipe:
        for bad in ("3", 1.5, -1, True):
            try:
                pipe.get_batch(DataProto(meta_info={"global_step": bad}))
            except ValueError as e:
                assert "global_step" in str(e) and repr(bad) in str(e)
            else:
                raise AssertionError(f"global_step={bad!r} was accepted")
        pipe.get_batch(DataProto(meta_info={"global_step": 5}))
        try:
            pipe.get_batch(DataProto(meta_info={"global_step": 4}))
        except ValueError as e:
            assert "global_step=4" in str(e) and "5" in str(e)
        else:
            raise AssertionError("a step going back was accepted")
        again = pipe.get_batch(DataProto(meta_info={"global_step": 6}))  # nothing was lost
        assert again is not None and len(again) == 8 and again.meta_info["global_step"] == 6
