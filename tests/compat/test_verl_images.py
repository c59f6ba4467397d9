"""Image rows through verl's own code (``nox -s compat``: verl 0.9.1 and the vision extra).

A real Visual FrozenLake batch (``RolloutPipeline`` on the in-process vLLM engine and the
tiny Qwen2-VL), with ``with_mrope_positions``, goes through ``to_verl()`` and then through
what verl does with an agent-loop image batch:

- ``verl.protocol.DataProto``: ``check_consistency``, ``chunk`` / ``concat``,
  ``to_tensordict`` (what the trainer hands its workers);
- the trainer's ``images_seqlens`` gathering: inline in ``RayPPOTrainer.fit`` (and in the
  separation trainer's step method), so only its key access is repeated here;
- verl's Qwen2-VL ``get_rope_index`` (``verl.models.transformers.qwen2_vl``) and the
  model's ``get_rope_index`` as verl's ``hf_processor`` binds it to the processor (what
  ``AgentLoopWorker._compute_position_ids`` calls) on each row: rows 1-3 of
  ``position_ids``;
- ``left_right_2_no_padding`` -> ``FSDPEngineWithLMHead.prepare_model_inputs`` (which
  calls ``extract_multi_modal_inputs``) -> an HF forward of the tiny VLM on exactly the
  inputs verl prepared -> verl's ``logprobs_from_logits`` -> ``no_padding_2_padding``:
  the batch's ``rollout_log_probs`` (the engine's logprobs) within 1e-4.

``AgentLoopWorker`` itself (``_compute_position_ids``, ``_compute_multi_modal_inputs``,
``_postprocess``) cannot be imported here: ``verl.experimental.agent_loop`` imports
``hydra`` (and ``ray``'s serving stack), which the ``compat`` extra does not install.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from verl.models.transformers.qwen2_vl import get_rope_index
from verl.protocol import DataProto as VerlDataProto
from verl.utils import tensordict_utils as tu
from verl.utils.model import compute_position_id_with_mask, extract_multi_modal_inputs
from verl.utils.tokenizer import hf_processor
from verl.utils.torch_functional import logprobs_from_logits
from verl.workers.engine.fsdp.transformer_impl import (
    FSDPEngine,
    FSDPEngineWithLMHead,
)
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

import rollpipe.vision  # noqa: F401  (the torchvision guard, before any processor import)
from rollpipe.data.proto import DataProto
from rollpipe.pipeline import PipelineConfig, RolloutPipeline
from rollpipe.vision.rows import with_mrope_positions

CONFIG = PipelineConfig(
    envs="frozenlake_visual",
    group_size=2,
    batch_size=4,
    num_groups=2,
    max_turns=2,
    max_length=1024,
    concurrency=4,
    seed=3,
    sampling={"max_tokens": 8, "temperature": 1.0},
)


def _vlm_path() -> Any:
    try:  # the tiny VLM's module (training material; older trees kept it in vision/)
        from rollpipe.training.tiny_vlm import default_vlm_path
    except ImportError:
        from rollpipe.vision.tiny_vlm import default_vlm_path  # type: ignore[no-redef]
    return default_vlm_path()


@pytest.fixture(scope="module")
def vlm_path() -> Any:
    return _vlm_path()


@pytest.fixture(scope="module")
def hf_vlm(vlm_path: Any) -> Any:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(vlm_path)).eval()


@pytest.fixture(scope="module")
def native(vlm_path: Any, hf_vlm: Any) -> Iterator[DataProto]:
    """One Visual FrozenLake batch of the real pipeline, with the model's 3-D positions."""
    from transformers import AutoTokenizer

    from rollpipe.engines.vllm import VLLMEngine

    tokenizer = AutoTokenizer.from_pretrained(str(vlm_path))
    engine = VLLMEngine(vlm_path, kv_cache_space_gib=0.5, max_model_len=2048, seed=0)
    try:
        with RolloutPipeline(CONFIG, engine, tokenizer) as pipe:
            batch = pipe.get_batch()
    finally:
        engine.close()
    assert batch is not None
    yield with_mrope_positions(batch, hf_vlm)


@pytest.fixture(scope="module")
def data(native: DataProto) -> VerlDataProto:
    return native.to_verl()


def _valid(data: VerlDataProto, i: int) -> torch.Tensor:
    return data.batch["attention_mask"][i].bool()


def test_image_rows_are_a_consistent_verl_dataproto(data):
    assert isinstance(data, VerlDataProto)
    data.check_consistency()
    width = data.batch["input_ids"].shape[1]
    assert data.batch["position_ids"].shape == (len(data), 4, width)
    inputs = data.non_tensor_batch["multi_modal_inputs"]
    assert all("pixel_values" in mm and "image_grid_thw" in mm for mm in inputs)
    halves = data.chunk(2)
    for half in halves:
        half.check_consistency()
    whole = VerlDataProto.concat(halves)
    for key in ("input_ids", "position_ids", "rollout_log_probs"):
        assert torch.equal(whole.batch[key], data.batch[key])
    for a, b in zip(whole.non_tensor_batch["multi_modal_inputs"], inputs, strict=True):
        assert torch.equal(a["pixel_values"], b["pixel_values"])
        assert torch.equal(a["image_grid_thw"], b["image_grid_thw"])
    td = data.to_tensordict()  # what the trainer sends its workers
    assert td["position_ids"].shape == data.batch["position_ids"].shape


def test_the_trainers_images_seqlens_read(data):
    """``RayPPOTrainer.fit`` gathers ``images_seqlens`` inline (no function to call): for
    each row's ``multi_modal_inputs`` that has ``image_grid_thw``, extend with
    ``images_seqlens.tolist()``. The same key access, and what it must come to."""
    gathered = []
    for mm in data.non_tensor_batch["multi_modal_inputs"]:
        if "image_grid_thw" not in mm:
            continue
        gathered.extend(mm["images_seqlens"].tolist())
    grids = torch.cat([mm["image_grid_thw"] for mm in data.non_tensor_batch["multi_modal_inputs"]])
    assert gathered == (grids[:, 1] * grids[:, 2]).repeat_interleave(grids[:, 0]).tolist()
    assert sum(gathered) == sum(
        mm["pixel_values"].shape[0] for mm in data.non_tensor_batch["multi_modal_inputs"]
    )


def test_verls_get_rope_index_gives_the_rope_rows(data, vlm_path):
    processor = hf_processor(str(vlm_path))  # verl's: the model's get_rope_index bound to it
    assert processor is not None and hasattr(processor, "get_rope_index")
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    positions = data.batch["position_ids"]
    text = compute_position_id_with_mask(data.batch["attention_mask"])
    for i in range(len(data)):
        ids, mask = data.batch["input_ids"][i], data.batch["attention_mask"][i]
        grid = data.non_tensor_batch["multi_modal_inputs"][i]["image_grid_thw"]
        ours = get_rope_index(processor, ids, image_grid_thw=grid, attention_mask=mask)
        assert torch.equal(positions[i, 1:], ours)  # padding included: 1, as verl's
        bound, _ = processor.get_rope_index(  # what AgentLoopWorker._compute_position_ids calls
            input_ids=ids[None],
            attention_mask=mask[None],
            image_grid_thw=grid,
            mm_token_type_ids=(ids[None] == pad).to(torch.int64),
        )
        valid = _valid(data, i)
        assert torch.equal(positions[i, 1:, valid], bound[:, 0, valid])
        # on padding transformers 5's get_rope_index leaves 0 where verl's own (above) and
        # rollpipe write 1; left_right_2_no_padding drops padding, so the model never sees it
        assert (bound[:, 0, ~valid] == 0).all()
        assert torch.equal(positions[i, 0, valid], text[i, valid])
        assert (positions[i, 0, ~valid] == 1).all()  # _compute_position_ids' text row


def _fsdp_stand_in() -> Any:
    """The least of an ``FSDPEngineWithLMHead`` that ``prepare_model_inputs`` reads on one
    process: no static packed padding (``pad_to_length`` off, verl's own
    ``_get_packed_pad_size``), no Ulysses sequence parallelism, no packed ``cu_seqlens``."""
    engine = types.SimpleNamespace(pad_to_length=False, use_ulysses_sp=False)
    engine._get_packed_pad_size = types.MethodType(FSDPEngine._get_packed_pad_size, engine)
    return engine


@pytest.mark.parametrize("remove_padding", [True, False], ids=["packed", "padded"])
def test_an_hf_forward_on_verls_model_inputs_gives_the_engines_logprobs(
    data, hf_vlm, remove_padding
):
    batch_td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(batch_td, temperature=1.0, use_remove_padding=remove_padding)
    assert batch_td["position_ids"].is_nested and batch_td["position_ids"].dim() == 3
    features = extract_multi_modal_inputs(batch_td.get("multi_modal_inputs"))
    grids = torch.cat([m["image_grid_thw"] for m in data.non_tensor_batch["multi_modal_inputs"]])
    assert torch.equal(features["image_grid_thw"], grids)
    model_inputs, output_args = FSDPEngineWithLMHead.prepare_model_inputs(
        _fsdp_stand_in(), batch_td
    )
    assert torch.equal(model_inputs["pixel_values"], features["pixel_values"])
    with torch.no_grad():
        # FSDPEngineWithLMHead.forward_step calls the module with use_cache=False; without
        # it transformers builds a cache and stops telling packed rows apart
        logits = hf_vlm(**model_inputs, use_cache=False).logits.float()
    lengths = batch_td["input_ids"].offsets().diff().tolist()
    if remove_padding:  # one packed row (1, total tokens), rows told apart by position_ids
        flat = logits[0]
    else:  # padded rows: the first `length` tokens of each
        flat = torch.cat([logits[i, :n] for i, n in enumerate(lengths)])
    log_probs = logprobs_from_logits(flat, output_args["input_ids_rmpad_rolled"])
    nested = torch.nested.nested_tensor_from_jagged(
        log_probs, offsets=batch_td["input_ids"].offsets()
    )
    padded = no_padding_2_padding(nested, batch_td)  # [B, R], as the trainer re-pads
    mask = data.batch["response_mask"].bool()
    assert padded.shape == mask.shape
    engine = data.batch["rollout_log_probs"]
    assert mask.any()
    assert np.abs((padded - engine)[mask].numpy()).max() < 1e-4
