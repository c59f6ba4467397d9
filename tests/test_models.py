"""The built-in tiny model: deterministic files, loadable, a tokenizer that fits env text."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.training.tiny_model import EOS_TOKEN, PAD_TOKEN, build_tiny_model, default_model_path


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_same_arguments_give_byte_identical_files(tmp_path: Path) -> None:
    a = _files(build_tiny_model(tmp_path / "a", seed=3))
    b = _files(build_tiny_model(tmp_path / "b", seed=3))
    assert set(a) >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    assert a == b


def test_seed_changes_weights_not_tokenizer(tmp_path: Path) -> None:
    a = _files(build_tiny_model(tmp_path / "a", seed=0))
    b = _files(build_tiny_model(tmp_path / "b", seed=1))
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]


def test_bad_arguments_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="hidden_size/num_heads"):
        build_tiny_model(tmp_path, hidden_size=128, num_heads=8)
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_model(tmp_path, vocab_size=10)
    with pytest.raises(ValueError, match="seed"):
        build_tiny_model(tmp_path, seed=-1)


def test_loads_in_transformers_with_chat_template(tiny_model_path: Path, tokenizer: Any) -> None:
    from transformers import AutoModelForCausalLM

    cfg = json.loads((tiny_model_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["hidden_size"] // cfg["num_attention_heads"] >= 64
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.pad_token == PAD_TOKEN
    assert len(tokenizer) == cfg["vocab_size"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "P_G"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nP_G<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer(text)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg["vocab_size"])
    assert torch.isfinite(logits).all()


def test_env_text_tokenizes_compactly(tokenizer: Any) -> None:
    assert len(tokenizer("<answer>Left</answer>")["input_ids"]) <= 6
    grid = "P _ _ O\n_ O _ G\n# X √ S"
    assert len(tokenizer(grid)["input_ids"]) < len(grid)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=60))
def test_raw_tokenizers_and_transformers_agree(
    tiny_model_path: Path, tokenizer: Any, text: str
) -> None:
    import unicodedata

    from tokenizers import Tokenizer

    raw = _raw_tokenizer(tiny_model_path, Tokenizer)
    ids = tokenizer(text)["input_ids"]
    assert raw.encode(text).ids == ids
    assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


_RAW: dict[Path, Any] = {}


def _raw_tokenizer(path: Path, cls: Any) -> Any:
    if path not in _RAW:
        _RAW[path] = cls.from_file(str(path / "tokenizer.json"))
    return _RAW[path]


def test_default_model_path_builds_once_and_races_safely(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLPIPE_CACHE_DIR", str(tmp_path / "cache"))
    results: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(default_model_path(seed=5))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    path = results[0]
    assert path.parent == tmp_path / "cache" and path.name.startswith("tiny-qwen2-")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [path.name]  # no temp leftovers
    before = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model_path(seed=5) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == before
    assert default_model_path(seed=6) != path
    assert _files(path) == _files(build_tiny_model(tmp_path / "direct", seed=5))


def test_default_model_path_honours_xdg_cache_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ROLLPIPE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_model_path().parent == tmp_path / "rollpipe"


def test_the_old_module_path_says_where_it_moved() -> None:
    """``rollpipe.engines.tiny_model`` (where the tiny model lived) fails at import with
    the new path; ``import rollpipe.engines`` loads no training, and the package's own
    names still come from ``rollpipe``."""
    script = """
import sys
import rollpipe.engines
assert not [m for m in sys.modules if m.startswith("rollpipe.training")], sys.modules
try:
    import rollpipe.engines.tiny_model
except ImportError as e:
    assert "rollpipe.training.tiny_model" in str(e), e
else:
    raise AssertionError("no ImportError")
from rollpipe import default_model_path
import rollpipe.training.tiny_model as new
assert default_model_path is new.default_model_path
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
