"""TRL's real GRPOTrainer trains on rollpipe's multi-turn FrozenLake rollouts through
``rollpipe.integrations.trl``: the engine follows the trainer's optimizer steps (version
= ``global_step``, and weights, the last ones included), what TRL got is the pipeline's
rows, and docs/trl.md's loop runs with at most 5 lines of glue. Skips only without
``trl``."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

from trl import GRPOConfig, GRPOTrainer

from rollpipe import PipelineConfig, RolloutPipeline
from rollpipe.corrections import versions_behind
from rollpipe.engines.hf import HFEngine
from rollpipe.integrations.trl import (
    FinalWeights,
    TRLRollout,
    episode_reward,
    grpo_trainer_kwargs,
    pipeline_rollout,
    placeholder_dataset,
)
from rollpipe.integrations.trl_rows import trl_fields
from rollpipe.training.warm_start import warm_start_model_path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
GROUP = 2
WEIGHT = "model.layers.0.self_attn.q_proj.weight"
DOC = Path(__file__).resolve().parents[1] / "docs" / "trl.md"


def config(**kw: Any) -> PipelineConfig:
    return PipelineConfig(
        envs="frozenlake",
        group_size=GROUP,
        batch_size=4,
        max_turns=2,
        sampling={"max_tokens": 24, "temperature": 1.0},
        **kw,
    )


def args(tmp_path: Path, **kw: Any) -> GRPOConfig:
    settings: dict[str, Any] = {
        "output_dir": str(tmp_path),
        "num_generations": GROUP,
        "per_device_train_batch_size": 4,
        "max_steps": 3,
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "report_to": "none",
        "use_cpu": True,
        "save_strategy": "no",
        "temperature": 1.0,
        "max_completion_length": 256,
        "seed": 0,
    }
    settings.update(kw)
    return GRPOConfig(**settings)


class Recorder:
    """Wraps the rollout: keeps what TRL got and the engine's state at each call."""

    def __init__(self, rollout: TRLRollout, engine: HFEngine) -> None:
        self.rollout, self.engine = rollout, engine
        self.calls: list[dict[str, Any]] = []
        self.changes: list[bool] = []  # per call after the first: the weights moved
        self.previous = torch.empty(0)

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        out = self.rollout(prompts, trainer)
        trained = trained_weight(trainer)
        if self.calls:
            self.changes.append(not torch.equal(self.previous, trained))
        self.previous = trained.clone()
        self.calls.append(
            {
                "step": trainer.state.global_step,
                "version": self.engine.version,
                "equal": self.engine_equals(trainer),
                "out": out,
                "batch": self.rollout.last_batch,
            }
        )
        return out

    def engine_equals(self, trainer: Any) -> bool:
        return torch.equal(self.engine.model.state_dict()[WEIGHT], trained_weight(trainer))


def trained_weight(trainer: Any) -> torch.Tensor:
    return trainer.accelerator.unwrap_model(trainer.model).state_dict()[WEIGHT]


def token_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """An arbitrary score of the tokens: it differs within a group whenever the rows do
    (FrozenLake's score often does not), so steps move the weights and a missed sync
    would show."""
    return [sum(ids) % 101 / 101 for ids in completion_ids]


def trainer_for(rollout: Any, tmp_path: Path, **grpo: Any) -> GRPOTrainer:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(warm_start_model_path())
    grpo_args = args(tmp_path, **grpo)
    return GRPOTrainer(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        reward_funcs=[episode_reward, token_reward],
        args=grpo_args,
        train_dataset=placeholder_dataset(grpo_args),
        processing_class=AutoTokenizer.from_pretrained(path),
        rollout_func=rollout,
    )


def train(tmp_path: Path, **grpo: Any) -> tuple[Recorder, GRPOTrainer]:
    """Train with ``pipeline_rollout(pipe)`` (no call after ``train()``); the recorder's
    ``final_equal``: the engine held the trainer's weights when ``train()`` returned."""
    path = warm_start_model_path()
    with HFEngine(path) as engine, RolloutPipeline(config(), engine, path) as pipe:
        recorder = Recorder(pipeline_rollout(pipe), engine)
        trainer = trainer_for(recorder, tmp_path, **grpo)
        trainer.train()
        recorder.final_equal = recorder.engine_equals(trainer)
        assert engine.version == trainer.state.global_step
    return recorder, trainer


def test_grpo_trainer_trains_on_rollpipe_rollouts(tmp_path: Path) -> None:
    recorder, trainer = train(tmp_path)
    assert [c["step"] for c in recorder.calls] == [0, 1, 2]
    assert [c["version"] for c in recorder.calls] == [0, 1, 2]  # version = global_step
    assert recorder.rollout.syncs == [(0, 0), (1, 1), (2, 2), (3, 3)]  # (3, 3): on_train_end
    assert all(c["equal"] for c in recorder.calls)  # the engine held the trainer's weights
    assert recorder.final_equal  # ... and the final ones, with no call after train()
    assert recorder.changes == [True, True]  # ... and they moved: the steps trained
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert any("rollpipe/success_rate" in h for h in trainer.state.log_history)
    for call in recorder.calls:
        batch, out = call["batch"], call["out"]
        versions = batch.batch["policy_versions"][batch.batch["response_mask"]]
        assert set(versions.tolist()) == {call["version"]}
        assert not versions_behind(batch, current_version=call["step"]).any()  # on-policy
        assert out == {**trl_fields(batch), "rollpipe_metrics": out["rollpipe_metrics"]}
        for i in range(len(out["prompt_ids"])):
            real = batch.batch["attention_mask"][i].bool()
            ids = batch.batch["input_ids"][i][real].tolist()
            assert out["prompt_ids"][i] + out["completion_ids"][i] == ids
            mask = batch.batch["response_mask"][i][real].int().tolist()
            assert [0] * len(out["prompt_ids"][i]) + out["env_mask"][i] == mask
            assert (
                0 in out["env_mask"][i] or batch.non_tensor_batch["end_reasons"][i] != "max_turns"
            )
        assert len(set(batch.batch["traj_group_id"][:GROUP].tolist())) == 1
    # multi-turn: env tokens between the model's turns are masked out of TRL's loss
    assert any(0 in mask for c in recorder.calls for mask in c["out"]["env_mask"])


def test_sync_only_when_the_optimizer_stepped(tmp_path: Path) -> None:
    """Gradient accumulation 2, one generation per micro-step: the weights change (and are
    loaded) every second call only."""
    recorder, _ = train(
        tmp_path,
        gradient_accumulation_steps=2,
        steps_per_generation=1,
        per_device_train_batch_size=2,
        max_steps=2,
    )
    assert [c["step"] for c in recorder.calls] == [0, 0, 1, 1]
    assert [c["version"] for c in recorder.calls] == [0, 0, 1, 1]
    assert recorder.rollout.syncs == [(0, 0), (1, 1), (2, 2)]
    assert all(c["equal"] for c in recorder.calls) and recorder.final_equal


def test_num_iterations_reuse_one_generation(tmp_path: Path) -> None:
    """num_iterations=2: one generation per two optimizer steps; the version is the
    global_step, so it jumps by two."""
    recorder, _ = train(tmp_path, num_iterations=2, max_steps=4)
    assert [c["step"] for c in recorder.calls] == [0, 2]
    assert [c["version"] for c in recorder.calls] == [0, 2]
    assert recorder.rollout.syncs == [(0, 0), (2, 2), (4, 4)]
    assert all(c["equal"] for c in recorder.calls) and recorder.final_equal


def test_group_size_must_equal_num_generations(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = warm_start_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    grpo_args = args(tmp_path, num_generations=4, per_device_train_batch_size=4)
    with HFEngine(path) as engine, RolloutPipeline(config(), engine, tokenizer) as pipe:
        rollout = pipeline_rollout(pipe)
        trainer = GRPOTrainer(
            str(path),
            reward_funcs=episode_reward,
            args=grpo_args,
            train_dataset=placeholder_dataset(grpo_args),
            processing_class=tokenizer,
            rollout_func=rollout,
        )
        with pytest.raises(ValueError, match="num_generations=4 but the pipeline's group_size=2"):
            trainer.train()
        assert rollout.syncs == [] and engine.interruptions == 0  # nothing loaded first
    built: list[Any] = []  # grpo_trainer_kwargs checks args before it builds anything
    with pytest.raises(ValueError, match="num_generations=4 but the pipeline's group_size=2"):
        grpo_trainer_kwargs(path, config(), grpo_args, engine=lambda: built.append(1))
    assert built == []


def test_a_used_engine_is_refused(tmp_path: Path) -> None:
    """The engine's version must be the trainer's global_step: an engine already past it
    fails at the first load, naming both, before any rollout."""
    path = warm_start_model_path()
    with HFEngine(path) as engine, RolloutPipeline(config(), engine, path) as pipe:
        engine.update_weights(engine.model, version=5)
        rollout = pipeline_rollout(pipe)
        trainer = trainer_for(rollout, tmp_path)
        with pytest.raises(RuntimeError, match="at version 5, past the trainer's global_step 0"):
            trainer.train()
        assert rollout.syncs == [] and rollout.last_batch is None


def test_on_vllm_grpo_trainer_kwargs_keep_version_and_final_weights(tmp_path: Path) -> None:
    """``grpo_trainer_kwargs`` on the real vLLM engine, 3 steps, no call after ``train()``:
    every load (recorded at the engine) is version ``trainer.state.global_step``, the last
    at ``on_train_end``, and then the engine's greedy tokens and log-probabilities are the
    trained model's (the step before last's differed: the final step moved the weights)."""
    from transformers import AutoModelForCausalLM

    from rollpipe.engines.vllm import VLLMEngine

    path = warm_start_model_path()
    grpo_args = args(tmp_path)
    loads: list[tuple[int, int, torch.Tensor]] = []  # (global_step, version, a weight)
    holder: dict[str, Any] = {}

    def vllm_engine() -> VLLMEngine:
        engine = VLLMEngine(path, kv_cache_space_gib=1, max_model_len=2048, seed=0)
        update = engine.update_weights

        def recorded(weights: Any, version: int | None = None) -> int:
            loaded = update(weights, version=version)
            trainer = holder["trainer"]
            loads.append((trainer.state.global_step, loaded, trained_weight(trainer).clone()))
            return loaded

        engine.update_weights = recorded  # type: ignore[method-assign]
        return engine

    kwargs = grpo_trainer_kwargs(
        path,
        config(),
        grpo_args,
        engine=vllm_engine,
        reward_funcs=[episode_reward, token_reward],
        keep_open=True,
    )
    with kwargs["rollout_func"] as rollout:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        trainer = holder["trainer"] = GRPOTrainer(model, args=grpo_args, **kwargs)
        trainer.train()
        assert [(step, version) for step, version, _ in loads] == [(0, 0), (1, 1), (2, 2), (3, 3)]
        assert not torch.equal(loads[-2][2], loads[-1][2])  # the last step trained
        engine = rollout.pipeline.engine
        assert engine.version == trainer.state.global_step == 3
        rows = rollout.last_batch.batch["input_ids"]
        prompts = [rows[0][:40].tolist(), rows[GROUP][:60].tolist(), rows[1][:20].tolist()]
        trained = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        trained.load_state_dict(trainer.accelerator.unwrap_model(trainer.model).state_dict())
        assert_engine_is_model(engine, trained, prompts)
    assert rollout.pipeline._closed  # the with block closed what keep_open kept


def assert_engine_is_model(engine: Any, model: Any, prompts: list[list[int]]) -> None:
    """The engine's greedy tokens are the model's, and their log-probabilities the model's
    forward log-probabilities. ``model`` is a plain copy of the trainer's: accelerate runs
    the trainer's own forward under bf16 autocast (TRL's ``bf16=True``), 0.09 off."""
    from rollpipe.engines.records import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    model = model.eval()
    model.generation_config.eos_token_id = None  # greedy to max_new_tokens
    for prompt, got in zip(prompts, engine.generate_batch(prompts, params), strict=True):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            want = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
            logits = model(torch.tensor([prompt + list(got.token_ids)])).logits[0]
        assert list(got.token_ids) == want[0, len(prompt) :].tolist()
        picked = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), -1)
        logprobs = picked.gather(-1, torch.tensor(got.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(got.logprobs), logprobs, atol=2e-3, rtol=0)


def doc_loop() -> str:
    match = re.search(r"<!-- doctest: trl-loop -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert match, "docs/trl.md lost its <!-- doctest: trl-loop --> block"
    return match.group(1)


def test_the_docs_loop_runs_and_leaves_the_final_weights(tmp_path: Path) -> None:
    """docs/trl.md's loop, as written, with the warm-start policy, vLLM and 2 steps: the
    engine ends at version global_step with the final weights loaded, and closed."""
    code = (
        doc_loop()
        .replace('"/path/to/model"', repr(str(warm_start_model_path())))
        .replace('GRPOConfig("out"', f"GRPOConfig({str(tmp_path)!r}")
        .replace("max_steps=100", "max_steps=2, use_cpu=True")  # CPU-only here
    )
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/trl.md", "exec"), namespace)
    trainer = namespace["trainer"]
    [final] = [c for c in trainer.callback_handler.callbacks if isinstance(c, FinalWeights)]
    assert trainer.state.global_step == 2
    assert final.rollout.syncs == [(0, 0), (1, 1), (2, 2)]
    assert final.rollout.pipeline._closed and final.rollout.pipeline.engine.closed


# The glue of the docs' loop: what a TRL user writes for rollpipe beyond TRL's own loop.
TRL_OWN_ARGUMENTS = {"args", "processing_class", "peft_config"}  # GRPOTrainer's, not glue


def _call_name(node: ast.AST) -> str:
    """``f`` for ``f(...)`` / ``x.f(...)``; "" for anything else."""
    if not isinstance(node, ast.Call):
        return ""
    func = node.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def _not_glue(stmt: ast.stmt) -> bool:
    """TRL's own lines and the user's setup: TRL's (or transformers') import; an
    assignment of the model's path (a string), a ``from_pretrained`` (model, tokenizer),
    ``GRPOConfig(...)`` or the env's ``PipelineConfig(...)``; ``x.train()``."""
    if isinstance(stmt, ast.ImportFrom):
        return (stmt.module or "").split(".")[0] in {"trl", "transformers"}
    if isinstance(stmt, ast.Import):
        return all(a.name.split(".")[0] in {"trl", "transformers"} for a in stmt.names)
    if isinstance(stmt, ast.Assign):
        value = stmt.value
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            return True
        return _call_name(value) in {"GRPOConfig", "PipelineConfig", "from_pretrained"}
    if isinstance(stmt, ast.Expr):
        return _call_name(stmt.value) == "train" and not stmt.value.args  # type: ignore[attr-defined]
    return False


def _trainer_call(stmt: ast.stmt) -> ast.Call | None:
    """The ``GRPOTrainer(...)`` call in ``stmt``, if any."""
    calls = [n for n in ast.walk(stmt) if _call_name(n) == "GRPOTrainer"]
    return calls[0] if calls else None  # type: ignore[return-value]


def _lines(node: ast.AST) -> set[int]:
    return set(range(node.lineno, node.end_lineno + 1))  # type: ignore[attr-defined]


def _trainer_glue(stmt: ast.stmt, call: ast.Call) -> set[int]:
    """The glue of a statement holding ``GRPOTrainer(...)``: its arguments but the model
    (the first positional one) and ``TRL_OWN_ARGUMENTS``; and the statement around the
    call (its first and last lines) unless it is ``trainer = GRPOTrainer(...)`` or
    ``GRPOTrainer(...).train()``."""
    own = call.args[:1] + [k for k in call.keywords if k.arg in TRL_OWN_ARGUMENTS]
    glue: set[int] = set()
    for arg in [a for a in [*call.args, *call.keywords] if a not in own]:
        glue |= _lines(arg)
    plain_assign = isinstance(stmt, ast.Assign) and stmt.value is call
    plain_train = (
        isinstance(stmt, ast.Expr)
        and _call_name(stmt.value) == "train"
        and stmt.value.func.value is call  # type: ignore[attr-defined]
    )
    if not (plain_assign or plain_train):  # e.g. foo(GRPOTrainer(...)): its first and last
        glue |= {stmt.lineno, stmt.end_lineno or stmt.lineno}
    return glue


def glue_lines(code: str) -> list[str]:
    """The glue of ``code``: every non-blank, non-comment line that is not in a
    ``_not_glue`` statement nor TRL's part of the ``GRPOTrainer(...)`` statement
    (``_trainer_glue``). A ``with`` line is glue; its body is judged statement by
    statement."""
    glue: set[int] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for stmt in statements:
            if isinstance(stmt, ast.With):
                glue.update(range(stmt.lineno, stmt.body[0].lineno))
                visit(stmt.body)
            elif (call := _trainer_call(stmt)) is not None:
                glue.update(_trainer_glue(stmt, call))
            elif not _not_glue(stmt):
                glue.update(_lines(stmt))

    visit(ast.parse(code).body)
    lines = code.splitlines()
    kept = [lines[n - 1].strip() for n in sorted(glue)]
    return [line for line in kept if line and not line.startswith("#")]


def test_the_docs_loop_has_at_most_5_lines_of_glue() -> None:
    glue = glue_lines(doc_loop())
    assert glue == [
        "from rollpipe import PipelineConfig, grpo_trainer_kwargs",
        "**grpo_trainer_kwargs(path, config, args),",
    ]
    assert len(glue) <= 5
    stated = re.search(r"is \*\*(\d+) lines\*\*", DOC.read_text())
    assert stated and int(stated.group(1)) == len(glue), "docs/trl.md states the count"


def test_glue_counts_the_old_loop_as_8_lines() -> None:
    """The definition above on the loop users wrote before ``grpo_trainer_kwargs`` (issue
    34): two imports, the ``with``, the rollout, three trainer arguments, the sync."""
    old = """
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from rollpipe import PipelineConfig, RolloutPipeline, VLLMEngine
from rollpipe.integrations.trl import episode_reward, pipeline_rollout, placeholder_dataset

path = "/path/to/model"  # the model
tokenizer = AutoTokenizer.from_pretrained(path)
args = GRPOConfig("out", num_generations=4, per_device_train_batch_size=8, max_steps=100)
config = PipelineConfig(envs="frozenlake", group_size=4)
with VLLMEngine(path) as engine, RolloutPipeline(config, engine, tokenizer) as pipe:
    rollout = pipeline_rollout(pipe)
    trainer = GRPOTrainer(
        AutoModelForCausalLM.from_pretrained(path),
        reward_funcs=episode_reward,
        args=args,
        train_dataset=placeholder_dataset(args),
        processing_class=tokenizer,
        rollout_func=rollout,
    )
    trainer.train()
    rollout.sync(trainer)
"""
    assert len(glue_lines(old)) == 8, glue_lines(old)


def fake_trainer(**kw: Any) -> Any:
    """What TRLRollout reads of a GRPOTrainer, for the checks that fail before any work."""
    from types import SimpleNamespace

    fields = {"num_generations": GROUP, "temperature": 1.0, "tools": [], "training": True}
    fields.update(kw)
    model = SimpleNamespace(training=fields.pop("training"))
    return SimpleNamespace(model=model, state=SimpleNamespace(global_step=0), **fields)


@pytest.mark.parametrize(
    ("trainer", "n", "match"),
    [
        (fake_trainer(temperature=0.7), 4, "GRPOConfig.temperature=0.7 but the pipeline samples"),
        (fake_trainer(tools=[len]), 4, "TRL would run its own tool loop"),
        (fake_trainer(training=False), 4, "eval_strategy='no'"),
        (fake_trainer(), 3, "3 completions on this process, not a multiple of group_size=2"),
    ],
)
def test_checks_name_what_to_change(trainer: Any, n: int, match: str) -> None:
    from rollpipe.engines.scripted import ScriptedEngine

    path = warm_start_model_path()
    with ScriptedEngine(lambda prompt, params: [0]) as engine:
        rollout = pipeline_rollout(config(), engine, path)
        try:
            with pytest.raises((ValueError, NotImplementedError), match=match):
                rollout([""] * n, trainer)
            assert engine.version == 0
        finally:
            rollout.close()


def test_rows_must_be_trajectory_rows() -> None:
    from rollpipe.engines.scripted import ScriptedEngine

    path = warm_start_model_path()
    eot = [1]
    with (
        ScriptedEngine(lambda prompt, params: eot) as engine,
        RolloutPipeline(config(collate={"level": "step"}, history_window=2), engine, path) as pipe,
    ):
        batch = pipe.get_batch()
        with pytest.raises(ValueError, match="level='trajectory'"):
            trl_fields(batch)
    with pytest.raises(ValueError, match="give a pipeline alone"):
        pipeline_rollout(pipe, engine)
