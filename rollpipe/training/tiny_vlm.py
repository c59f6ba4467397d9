"""The built-in tiny vision-language model: a random Qwen2-VL on the tiny tokenizer.

There is no model hub here, so the image tests build a VLM on the spot, like the text
tiny model (``rollpipe.training.tiny_model``). ``build_tiny_vlm`` writes a HuggingFace
directory that transformers (``AutoModelForImageTextToText``, ``AutoProcessor``) and
vLLM load: ``config.json`` (``Qwen2VLForConditionalGeneration``), ``model.safetensors``,
the tiny model's byte-level BPE tokenizer plus ``<|vision_start|>``, ``<|vision_end|>``,
``<|image_pad|>`` and ``<|video_pad|>``, Qwen2-VL's chat template, and the processor's
configs (image and video processors). Text hidden size 128 in 2 layers with head_dim 64
(vLLM's CPU attention rejects 16), a 2-block vision tower of width 64; about 1.1M
parameters, 4.4 MiB. A 64x64 image becomes 56x56: ``image_grid_thw`` [1, 4, 4],
``pixel_values`` (16, 1176), 4 image tokens after the 2x2 merge.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from rollpipe.training.tiny_model import EOS_TOKEN, PAD_TOKEN, default_model_path

__all__ = [
    "IMAGE_PAD",
    "QWEN2_VL_CHAT_TEMPLATE",
    "VIDEO_PAD",
    "VISION_END",
    "VISION_START",
    "VISION_TOKENS",
    "build_tiny_vlm",
    "default_vlm_path",
]

FORMAT_VERSION = 1  # bump when the files written for the same arguments change
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
"""Added after the tiny tokenizer's vocabulary, in this order."""

QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2-VL-Instruct's chat template, verbatim (one ``<|image_pad|>`` per image part)."""

MIN_PIXELS = 56 * 56
MAX_PIXELS = 256 * 28 * 28  # at most 256 image tokens an image (448x448)


def _tokenizer_json() -> tuple[str, dict[str, int]]:
    """The tiny model's tokenizer with the four vision tokens added; and their ids."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(default_model_path() / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    data = json.loads(tok.to_str())
    ids = {t: tok.token_to_id(t) for t in VISION_TOKENS}
    if None in ids.values():
        raise RuntimeError(f"the vision tokens did not get ids: {ids}")
    text = json.dumps(data, ensure_ascii=False, indent=1, sort_keys=True) + "\n"
    return text, {t: int(i) for t, i in ids.items() if i is not None}


def _config(vocab_size: int, ids: dict[str, int], pad_id: int, eos_id: int) -> Any:
    from transformers import Qwen2VLConfig

    text = {
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.1,  # clear greedy winners, as the text tiny model
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [8, 12, 12],  # halves of head_dim 64: temporal, height, width
        },
        "bos_token_id": pad_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": "float32",
    }
    vision = {
        "depth": 2,
        "embed_dim": 64,
        "hidden_size": 128,  # the merger's output: the text hidden size
        "num_heads": 2,
        "mlp_ratio": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "initializer_range": 0.1,
    }
    return Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
        dtype="float32",
    )


def build_tiny_vlm(path: str | os.PathLike[str], seed: int = 0) -> Path:
    """Write the tiny random Qwen2-VL (module doc) to ``path``; returns it.

    The directory is created; existing files are replaced. Weights are drawn from a
    generator seeded with ``seed`` (the global RNGs are left as they were).

    Examples:
        >>> with tempfile.TemporaryDirectory() as tmp:  # a few seconds
        ...     cfg = json.loads((build_tiny_vlm(tmp) / "config.json").read_text())
        >>> cfg["model_type"], cfg["text_config"]["hidden_size"], cfg["vision_config"]["depth"]
        ('qwen2_vl', 128, 2)
    """
    from tokenizers import Tokenizer
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    import rollpipe.vision  # noqa: F401  (its torchvision guard: the processor imports it)

    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"build_tiny_vlm: seed must be an int >= 0, got {seed!r}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok_json, ids = _tokenizer_json()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tok_json),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    pad_id, eos_id = (int(tokenizer.convert_tokens_to_ids(t)) for t in (PAD_TOKEN, EOS_TOKEN))  # type: ignore[arg-type]
    config = _config(len(tokenizer), ids, pad_id, eos_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config).eval()
    model.generation_config.update(
        bos_token_id=pad_id, eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, do_sample=True
    )
    model.save_pretrained(str(out))
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def default_vlm_path(seed: int = 0) -> Path:
    """The tiny VLM for ``seed``, built once into the user cache dir (the text tiny
    model's: ``$ROLLPIPE_CACHE_DIR``, else ``$XDG_CACHE_HOME/rollpipe``), into a
    temporary directory renamed into place (concurrent processes are safe).

    Examples:
        >>> path = default_vlm_path()  # built on the first call, then found in the cache
        >>> (path / "model.safetensors").is_file(), path.name.startswith("tiny-qwen2-vl-")
        (True, True)
    """
    import transformers

    key = json.dumps(
        {"format": FORMAT_VERSION, "seed": seed, "transformers": transformers.__version__},
        sort_keys=True,
    )
    root = default_model_path().parent  # the tiny model's cache dir (built if missing)
    final = root / f"tiny-qwen2-vl-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (final / "model.safetensors").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build_tiny_vlm(tmp, seed)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
