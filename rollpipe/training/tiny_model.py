"""The built-in tiny model: a random Qwen2 causal LM plus a locally trained tokenizer.

There is no model hub here, so tests, examples and the CLI use a model built on the
spot. ``build_tiny_model`` writes a HuggingFace-format directory (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json``) that both transformers and vLLM load. Every file is
written by hand with sorted keys and a seeded generator, so the same arguments give
byte-identical files (for the same ``tokenizers``/``safetensors`` versions).

``tools=True`` builds the tool-calling variant (``rollpipe.training.tiny_tools``): a
Hermes-style template, ``<tool_call>`` markers as special tokens, ``<think>`` tokens.

This module used to be ``rollpipe.engines.tiny_model``; that path now fails at import,
naming this one.
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

from rollpipe.training._tiny_corpus import training_corpus
from rollpipe.training.tiny_tools import (
    SPECIAL_TOOL_TOKENS,
    TOOL_TOKENS,
    TOOLS_CHAT_TEMPLATE,
    tool_corpus,
)

__all__ = [
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "TOOLS_CHAT_TEMPLATE",
    "TOOL_TOKENS",
    "build_tiny_model",
    "default_model_path",
]

FORMAT_VERSION = 2  # bump when the files written for the same arguments change
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, EOS_TOKEN)  # ids 0, 1, 2

# Qwen-style ChatML template (no default system prompt).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _train_tokenizer(vocab_size: int, tools: bool = False) -> str:
    """Train a byte-level BPE tokenizer on the built-in corpus; returns tokenizer.json text.
    ``tools``: add :data:`TOOL_TOKENS` (ids 3-6) and the tool corpus."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    # The same normalizer / pre-tokenizer as transformers' Qwen2Tokenizer, which
    # AutoTokenizer picks for model_type "qwen2": raw `tokenizers`, transformers and
    # vLLM then all tokenize identically.
    special = SPECIAL_TOKENS + (TOOL_TOKENS if tools else ())
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = training_corpus() + (tool_corpus() if tools else [])
    tok.train_from_iterator(corpus, trainer=trainer)
    for i, t in enumerate(special):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t!r} got id {tok.token_to_id(t)}, expected {i}")
    # Round-trip through JSON with sorted keys so the file bytes are canonical.
    data = json.loads(tok.to_str())
    for entry in data["added_tokens"]:  # <think> / </think> are plain added tokens
        entry["special"] = entry["content"] in SPECIAL_TOKENS or entry["content"] in (
            SPECIAL_TOOL_TOKENS
        )
    return json.dumps(data, ensure_ascii=False, indent=1, sort_keys=True) + "\n"


def _model_config(
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
) -> dict[str, Any]:
    eos_id = SPECIAL_TOKENS.index(EOS_TOKEN)
    pad_id = SPECIAL_TOKENS.index(PAD_TOKEN)
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": pad_id,
        "dtype": "float32",
        "eos_token_id": eos_id,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "max_window_layers": num_layers,
        "model_type": "qwen2",
        "num_attention_heads": num_heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": num_kv_heads,
        "pad_token_id": pad_id,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def _init_weights(cfg: dict[str, Any], seed: int, init_std: float) -> dict[str, torch.Tensor]:
    """Seeded random weights in the HF Qwen2 naming (lm_head tied to the embedding)."""
    gen = torch.Generator().manual_seed(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim

    def normal(*shape: int, std: float = init_std) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        w[p + "self_attn.q_proj.weight"] = normal(h, h)
        w[p + "self_attn.q_proj.bias"] = normal(h)
        w[p + "self_attn.k_proj.weight"] = normal(kv, h)
        w[p + "self_attn.k_proj.bias"] = normal(kv)
        w[p + "self_attn.v_proj.weight"] = normal(kv, h)
        w[p + "self_attn.v_proj.bias"] = normal(kv)
        w[p + "self_attn.o_proj.weight"] = normal(h, h)
        w[p + "mlp.gate_proj.weight"] = normal(inter, h)
        w[p + "mlp.up_proj.weight"] = normal(inter, h)
        w[p + "mlp.down_proj.weight"] = normal(h, inter)
    w["model.norm.weight"] = torch.ones(h)
    return {k: v.contiguous() for k, v in sorted(w.items())}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2, sort_keys=True) + "\n")


def build_tiny_model(
    path: str | os.PathLike[str],
    seed: int = 0,
    *,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 4096,
    init_std: float = 0.1,
    tools: bool = False,
) -> Path:
    """Write a tiny random Qwen2 model with a ChatML tokenizer to ``path``; returns it.

    ``hidden_size / num_heads`` must be 64 or more (vLLM's CPU attention rejects
    head_dim 16). ``init_std`` is larger than the usual 0.02 so the random model's
    next-token distribution has clear winners (greedy decoding is not a coin flip
    between near-tied logits). ``tools=True``: the tool-calling variant (module doc).
    The directory is created; existing files are replaced.

    Examples:
        >>> with tempfile.TemporaryDirectory() as tmp:  # a fraction of a second
        ...     cfg = json.loads((build_tiny_model(tmp, seed=1) / "config.json").read_text())
        >>> cfg["model_type"], cfg["vocab_size"], cfg["hidden_size"]
        ('qwen2', 512, 128)
    """
    _check_args(
        seed,
        vocab_size,
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        intermediate_size,
        max_position_embeddings,
        init_std,
    )
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok_json = _train_tokenizer(vocab_size, tools=tools)
    actual_vocab = len(json.loads(tok_json)["model"]["vocab"])
    cfg = _model_config(
        actual_vocab,
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        intermediate_size,
        max_position_embeddings,
    )
    eos_id = SPECIAL_TOKENS.index(EOS_TOKEN)
    pad_id = SPECIAL_TOKENS.index(PAD_TOKEN)

    (out / "tokenizer.json").write_text(tok_json)
    _write_json(
        out / "tokenizer_config.json",
        {
            "add_prefix_space": False,
            "bos_token": None,
            "chat_template": TOOLS_CHAT_TEMPLATE if tools else CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": EOS_TOKEN,
            "extra_special_tokens": {},
            "model_max_length": max_position_embeddings,
            "pad_token": PAD_TOKEN,
            "padding_side": "left",
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": None,
        },
    )
    _write_json(out / "special_tokens_map.json", {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN})
    _write_json(out / "config.json", cfg)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": pad_id,
            "do_sample": True,
            "eos_token_id": [eos_id, pad_id],
            "pad_token_id": pad_id,
            "temperature": 1.0,
            "top_k": 0,
            "top_p": 1.0,
        },
    )
    save_file(
        _init_weights(cfg, seed, init_std),
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (out / "model.safetensors").chmod(0o644)
    return out


def _check_args(
    seed: int,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    init_std: float,
) -> None:
    ints = {
        "seed": (seed, 0),
        "vocab_size": (vocab_size, len(SPECIAL_TOKENS) + 256),
        "hidden_size": (hidden_size, 1),
        "num_layers": (num_layers, 1),
        "num_heads": (num_heads, 1),
        "num_kv_heads": (num_kv_heads, 1),
        "intermediate_size": (intermediate_size, 1),
        "max_position_embeddings": (max_position_embeddings, 16),
    }
    for name, (value, low) in ints.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"build_tiny_model: {name} must be an int >= {low}, got {value!r}")
    if hidden_size % num_heads or hidden_size // num_heads < 64:
        raise ValueError(
            f"build_tiny_model: hidden_size/num_heads must be an integer >= 64 (vLLM CPU "
            f"attention rejects small head dims), got {hidden_size}/{num_heads}; "
            "raise hidden_size or lower num_heads"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"build_tiny_model: num_heads ({num_heads}) must be a multiple of num_kv_heads "
            f"({num_kv_heads})"
        )
    if not (isinstance(init_std, (int, float)) and 0 < init_std < 10):
        raise ValueError(f"build_tiny_model: init_std must be in (0, 10), got {init_std!r}")


def _cache_root() -> Path:
    if env := os.environ.get("ROLLPIPE_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rollpipe"


def default_model_path(seed: int = 0, **kwargs: Any) -> Path:
    """The tiny model for ``(seed, **kwargs)``, built once into the user cache dir.

    The cache is ``$ROLLPIPE_CACHE_DIR`` or ``$XDG_CACHE_HOME/rollpipe`` (default
    ``~/.cache/rollpipe``); the directory name hashes the arguments. The model is built
    into a temporary directory and renamed into place, so concurrent processes are safe:
    the first rename wins, the others discard their copy.

    Examples:
        >>> path = default_model_path()  # built on the first call, then found in the cache
        >>> (path / "model.safetensors").is_file(), str(path) == model_path
        (True, True)
    """
    key = json.dumps({"format": FORMAT_VERSION, "seed": seed, **kwargs}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    root = _cache_root()
    final = root / f"tiny-qwen2-{digest}"
    if (final / "model.safetensors").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        build_tiny_model(tmp, seed, **kwargs)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is readable like any other
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
