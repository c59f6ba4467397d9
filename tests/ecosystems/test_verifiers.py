"""verifiers 0.4 envs through ``VerifiersEnv`` and the front door: a real batch on vLLM for
a single-turn, a multi-turn and a tool env, and scripted players that earn the env's own
reward in each (the tool player's call runs the taskset's MCP tool). ``nox -s verifiers``.

The test tasksets (``vf_add``, ``vf_guess``, ``vf_tools`` + ``vf_calculator``) are modules
on the path, as verifiers loads tasksets by id; the tool server runs as ``python -m
vf_calculator``, so this folder goes on ``PYTHONPATH`` too. docs/environments.md's minimal
taskset runs as written (its ``<!-- doctest: verifiers-... -->`` blocks).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest

pytest.importorskip("verifiers.v1", reason="verifiers is not installed: nox -s verifiers")

from playing import first_prompts, real_batch

from rollpipe.agent.episode import EpisodeSettings
from rollpipe.engines.scripted import ScriptedEngine
from rollpipe.envs import make
from rollpipe.envs.registry import EnvRegistryError
from rollpipe.pipeline import PipelineConfig, RolloutPipeline
from rollpipe.training.tiny_model import default_model_path

VF = "rollpipe.envs.adapters.verifiers:VerifiersEnv"
HERE = str(Path(__file__).parent)
DOC = Path(__file__).resolve().parents[2] / "docs" / "environments.md"

Player = Callable[[str], str]
"""The scripted model: the decoded prompt -> the reply's text."""


@pytest.fixture(autouse=True)
def _tool_servers_import_from_here(monkeypatch: pytest.MonkeyPatch) -> None:
    paths = [HERE, *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))


def test_single_turn_real_batch(vllm_engine, tokenizer) -> None:
    batch = real_batch(vllm_engine, tokenizer, VF, {"taskset": "vf_add"})
    assert all(re.search(r"What is \d+ \+ \d+\?", p) for p in first_prompts(batch, tokenizer))
    metrics = batch.meta_info["metrics"]
    assert metrics["env/eco/turns/max"] == 1.0  # the chat program stops at the first reply
    assert "env/eco/reward/exact_sum" in metrics and "env/eco/metric/reply_words" in metrics


def test_multi_turn_real_batch(vllm_engine, tokenizer) -> None:
    batch = real_batch(vllm_engine, tokenizer, VF, {"taskset": "vf_guess"})
    assert all("Guess my number" in p for p in first_prompts(batch, tokenizer))
    metrics = batch.meta_info["metrics"]
    assert "env/eco/reward/won" in metrics
    assert metrics["env/eco/turns/max"] >= 2  # a wrong guess gets the env's hint, a new turn


def test_tool_env_real_batch(vllm_engine, tokenizer) -> None:
    batch = real_batch(
        vllm_engine,
        tokenizer,
        VF,
        {"taskset": "vf_tools"},
        episode=EpisodeSettings(tool_parser="hermes", max_length=2048, sampling={"max_tokens": 24}),
    )
    # the tool server started and the harness ran against it: no episode errored
    assert all("Use the tool: what is" in p for p in first_prompts(batch, tokenizer))
    assert "env/eco/reward/exact_sum" in batch.meta_info["metrics"]


class Scripted:
    """One ``ScriptedEngine`` for the module whose player each test sets, with the
    tokenizer its pipeline renders with."""

    def __init__(self) -> None:
        self.tokenizer: Any = None
        self.player: Player = lambda prompt: ""
        self.engine = ScriptedEngine(self.policy)

    def policy(self, prompt: Sequence[int], params: Any) -> list[int]:
        text = self.player(self.tokenizer.decode(list(prompt)))
        eot = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        return [*self.tokenizer.encode(text, add_special_tokens=False), eot]

    def batch(self, tokenizer: Any, player: Player, taskset: str, **settings: Any) -> Any:
        """One batch of 4 rows (2 groups of 2) of ``taskset`` played by ``player``."""
        self.tokenizer, self.player = tokenizer, player
        config = PipelineConfig(
            envs=[{"name": VF, "config": {"taskset": taskset}, "tag": "vf"}],
            group_size=2,
            batch_size=4,
            seed=3,
            **settings,
        )
        with RolloutPipeline(config, self.engine, tokenizer) as pipe:
            batch = pipe.get_batch()
        assert batch.meta_info["metrics"]["dropped/errored"] == 0, batch.meta_info["metrics"]
        return batch


@pytest.fixture(scope="module")
def scripted() -> Iterator[Scripted]:
    s = Scripted()
    with s.engine:
        yield s


def rows(batch: Any, tokenizer: Any) -> list[str]:
    """Each row's tokens (prompt, responses, env messages), decoded."""
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"].bool()
    return [str(tokenizer.decode(ids[i][mask[i]].tolist())) for i in range(len(batch))]


def adder(prompt: str) -> str:
    a, b = re.search(r"What is (\d+) \+ (\d+)\?", prompt).groups()  # type: ignore[union-attr]
    return f"It is {int(a) + int(b)}"


def test_a_right_answer_earns_the_rubric_reward(scripted, tokenizer) -> None:
    batch = scripted.batch(tokenizer, adder, "vf_add")
    assert batch.meta_info["metrics"]["env/vf/reward/exact_sum"] == 1.0
    assert batch.batch["episode_scores"].tolist() == [1.0] * 4


def test_a_wrong_answer_earns_nothing(scripted, tokenizer) -> None:
    batch = scripted.batch(tokenizer, lambda _: "It is -1", "vf_add")
    assert batch.meta_info["metrics"]["env/vf/reward/exact_sum"] == 0.0
    assert batch.batch["episode_scores"].tolist() == [0.0] * 4


def tool_user(prompt: str) -> str:
    """Calls ``calc_add`` for the question, then answers with what the tool returned."""
    results = re.findall(r"<tool_response>\s*(.*?)\s*</tool_response>", prompt, re.S)
    if results:
        return f"The answer is {results[-1]}"
    a = int(re.search(r"what is (\d+) \+ 7\?", prompt).group(1))  # type: ignore[union-attr]
    call = {"name": "calc_add", "arguments": {"a": a, "b": 7}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def test_a_tool_call_runs_the_toolsets_tool(scripted, monkeypatch, tmp_path) -> None:
    from transformers import AutoTokenizer

    monkeypatch.setenv("VF_CALCULATOR_STARTS", str(starts := tmp_path / "starts"))
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_path(tools=True)))
    batch = scripted.batch(tokenizer, tool_user, "vf_tools", tool_parser="hermes", concurrency=2)
    # one tool server an env instance (2 at a time), kept across its episodes, stopped
    # when the pipeline closed its envs
    servers = [int(pid) for pid in starts.read_text().split()]
    assert 1 <= len(servers) <= 2
    assert not any(psutil.pid_exists(pid) for pid in servers)
    metrics = batch.meta_info["metrics"]
    assert metrics["tool/calls"] == 4 and metrics["tool/malformed"] == 0
    for row in rows(batch, tokenizer):  # the MCP tool's result, sent back as a tool message
        a = int(re.search(r"what is (\d+) \+ 7\?", row).group(1))  # type: ignore[union-attr]
        assert f"<tool_response>\n{a + 7}\n</tool_response>" in row
    assert metrics["env/vf/reward/exact_sum"] == 1.0
    assert batch.batch["episode_scores"].tolist() == [1.0] * 4


def bisector(prompt: str) -> str:
    """Guesses 1..8 by halving on the env's "higher" / "lower" hints."""
    low, high = 1, 8
    for guess, hint in re.findall(r"(\d+)<\|im_end\|>\n<\|im_start\|>user\n(\w+)", prompt):
        if hint == "higher":
            low = int(guess) + 1
        elif hint == "lower":
            high = int(guess) - 1
    return str((low + high) // 2)


def test_a_bisecting_player_wins_the_multi_turn_env(scripted, tokenizer) -> None:
    batch = scripted.batch(tokenizer, bisector, "vf_guess")
    metrics = batch.meta_info["metrics"]
    assert metrics["env/vf/reward/won"] == 1.0
    assert batch.batch["episode_scores"].tolist() == [1.0] * 4
    assert metrics["env/vf/turns/max"] >= 2  # a hint was needed at least once
    hints = re.findall(
        r"<\|im_start\|>user\n(higher|lower)<\|im_end\|>", "".join(rows(batch, tokenizer))
    )
    assert hints  # the env's replies reached the rows as user messages


def test_a_bad_taskset_fails_when_built() -> None:
    with pytest.raises((EnvRegistryError, ModuleNotFoundError, ValueError)):
        make(VF, taskset="no_such_taskset_here")
    with pytest.raises(ValueError, match="num_tasks"):
        make(VF, taskset="vf_add", num_tasks=0)


def doc_block(name: str) -> str:
    """The fenced block after ``<!-- doctest: name -->`` in docs/environments.md."""
    match = re.search(rf"<!-- doctest: {name} -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert match, f"docs/environments.md lost its <!-- doctest: {name} --> block"
    return match.group(1)


@pytest.fixture
def taskset_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable]:
    """``write(name, code)``: ``code`` as the importable module ``name``, as a user's
    taskset file is (forgotten again after the test)."""
    names: list[str] = []

    def write(name: str, code: str) -> None:
        (tmp_path / f"{name}.py").write_text(code)
        importlib.invalidate_caches()
        names.append(name)

    monkeypatch.syspath_prepend(str(tmp_path))
    yield write
    for name in names:
        sys.modules.pop(name, None)


@pytest.fixture
def my_sums(taskset_file: Callable) -> None:
    taskset_file("my_sums", doc_block("verifiers-taskset"))


def test_the_docs_taskset_runs_as_written_on_the_engine(my_sums, vllm_engine, tokenizer, capsys):
    namespace: dict[str, Any] = {"engine": vllm_engine, "tokenizer": tokenizer}
    exec(compile(doc_block("verifiers-run"), str(DOC), "exec"), namespace)
    batch = namespace["batch"]
    metrics = batch.meta_info["metrics"]
    assert len(batch) == 4 and metrics["dropped/errored"] == 0, metrics
    assert all(re.search(r"What is \d \+ 2\?", p) for p in first_prompts(batch, tokenizer))
    printed = capsys.readouterr().out.split()[-1]
    assert float(printed) == metrics["env/sums/reward/correct"]


def test_the_docs_taskset_pays_a_right_answer(my_sums, scripted, tokenizer) -> None:
    def answer(prompt: str) -> str:
        n = int(re.search(r"What is (\d) \+ 2\?", prompt).group(1))  # type: ignore[union-attr]
        return f"It is {n + 2}"

    batch = scripted.batch(tokenizer, answer, "my_sums")
    assert batch.meta_info["metrics"]["env/vf/reward/correct"] == 1.0
    assert batch.batch["episode_scores"].tolist() == [1.0] * 4


def test_a_plain_def_reward_is_refused_naming_the_fix(taskset_file) -> None:
    code = doc_block("verifiers-taskset").replace("async def correct", "def correct")
    assert "    def correct(" in code
    taskset_file("sync_sums", code)
    with pytest.raises(TypeError, match=r"SumsTask\.correct is a @vf\.reward .*plain `def`"):
        make(VF, taskset="sync_sums")
    with pytest.raises(ValueError, match=r"async def correct\("):  # when the config is built
        PipelineConfig(envs=[{"name": VF, "config": {"taskset": "sync_sums"}}])
