"""Learning from a prompt dataset (RLVR): the sums dataset's fixed held-out split, the
sloppy teacher's transcripts as the pipeline's own rows, the shipped warm start, and a
few GRPO steps of ``rollpipe train --env sums`` on the real vLLM engine."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest

from rollpipe.training.sum_task import (
    HELD_OUT,
    SUM_ENV_CONFIG,
    held_out_rows,
    sum_row,
    teacher_episodes,
    train_rows,
)
from rollpipe.training.sum_warm_start import SUM_SHIPPED_DIR, sum_warm_start_model_path
from rollpipe.training.train_tasks import train_task


@pytest.fixture(scope="module")
def warm_start() -> Any:
    return sum_warm_start_model_path()


def _problem(row: dict[str, Any]) -> tuple[int, int]:
    a, b = row["prompt"].removeprefix("What is ").removesuffix("?").split(" + ")
    return int(a), int(b)


def test_the_held_out_split_is_fixed_and_never_trained_on() -> None:
    train, held = train_rows(), held_out_rows()
    assert len(train) == 75 and len(held) == 25
    assert {_problem(r) for r in held} == HELD_OUT
    assert not {_problem(r) for r in train} & HELD_OUT
    assert sorted(map(_problem, train + held)) == [(a, b) for a in range(10) for b in range(10)]
    assert (3, 5) in HELD_OUT and (3, 4) not in HELD_OUT  # the split does not move
    assert sum_row(3, 4) == {"prompt": "What is 3 + 4?", "answer": 7}
    task = train_task("sums")
    assert task.dataset is not None and task.held_out is not None
    assert task.dataset() == train and task.held_out() == held


def test_the_sloppy_teacher_is_right_3_times_in_10(warm_start: Any) -> None:
    """Played through the pipeline (PromptTask, no system message): one answer per
    episode, the loss on exactly its tokens; right 30% of the time, else one too many."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(warm_start)
    episodes = list(teacher_episodes(tokenizer, 10, seed=3))
    assert len(episodes) == 750
    assert sum(e.success for e in episodes) == 225  # exactly 3 in 10 on every problem
    offsets: Counter[int] = Counter()
    for episode in episodes:
        ((start, end),) = episode.responses
        text = tokenizer.decode(episode.ids, skip_special_tokens=False)
        prompt = tokenizer.decode(episode.ids[:start], skip_special_tokens=False)
        a, b = map(int, prompt.split("What is ")[1].split("?")[0].split(" + "))
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {a} + {b}?"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        assert prompt == rendered, "the rows are the ids the pipeline sends"
        answer = int(text.split("<answer>")[1].split("</answer>")[0])
        offsets[answer - (a + b)] += 1
        assert text.endswith("</answer><|im_end|>")
        taught = {int(p) + 1 for p in (episode.targets >= 0).nonzero()[0]}
        assert taught == set(range(start, end))
    assert offsets == {0: 225, 1: 525}


def test_the_sums_warm_start_ships(warm_start: Any) -> None:
    assert warm_start == SUM_SHIPPED_DIR
    assert (SUM_SHIPPED_DIR / "model.safetensors").stat().st_size < 2**20


def test_grpo_steps_on_the_prompt_dataset(warm_start: Any, tmp_path: Any) -> None:
    """``rollpipe train --env sums``'s loop for 3 steps at a large learning rate: finite
    losses, a new policy version each step, the trainer's log-probs still match the
    engine's after each update (the new weights reached the engine), and the held-out
    evaluation plays exactly the held-out rows. Then one batch: every row a training
    problem, its prompt exactly the row's rendered prompt, its score the verifier's."""
    from transformers import AutoTokenizer

    from rollpipe.engines.vllm import VLLMEngine
    from rollpipe.envs.task import exact_match
    from rollpipe.pipeline import PipelineConfig, RolloutPipeline
    from rollpipe.training.grpo_loop import train_grpo

    tokenizer = AutoTokenizer.from_pretrained(warm_start)
    with VLLMEngine(warm_start, kv_cache_space_gib=0.5, max_model_len=1024, seed=0) as engine:
        result = train_grpo(
            steps=3, batch_size=32, group_size=8, lr=1e-3, warmup=1, env="sums",
            eval_episodes=25, engine=engine,
        )  # fmt: skip
        history = result["history"]
        assert [h["version"] for h in history] == [1, 2, 3]
        assert all(math.isfinite(h["loss"]) for h in history)
        assert history[0]["updates"] >= 1, history  # the warm start has reward variance
        # a large step moves the policy; unsynced engine weights would show a big gap
        assert all(h["logprob_gap"] < 0.02 for h in history), history
        assert [e["episodes"] for e in result["evals"]] == [25, 25]

        config = PipelineConfig(
            envs=train_task("sums").env,
            dataset={"rows": train_rows(), "epochs": None},
            group_size=4,
            batch_size=32,
            max_turns=1,
            sampling={"max_tokens": 8, "temperature": 1.0},
        )
        with RolloutPipeline(config, engine, tokenizer) as pipe:
            batch = pipe.get_batch()
    assert batch is not None and len(batch) == 32
    td = batch.batch
    rows = train_rows()
    for i, index in enumerate(batch.non_tensor_batch["row_index"]):
        row = rows[int(index)]
        assert _problem(row) not in HELD_OUT
        keep = td["attention_mask"][i].bool()
        ids, response = td["input_ids"][i][keep], td["response_mask"][i][keep].bool()
        prompt = tokenizer.decode(ids[~response], skip_special_tokens=False)
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        assert prompt == rendered
        answer = tokenizer.decode(ids[response], skip_special_tokens=False)
        assert float(td["episode_scores"][i]) == exact_match(answer, row["answer"])
    assert SUM_ENV_CONFIG["system_prompt"] is None


def test_the_datasets_first_run_block_wins_some() -> None:
    """docs/datasets.md's first run on the sums warm start, as written: one batch of the
    training rows, about a third of the episodes won (the teacher's 3 in 10)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "datasets.md").read_text()
    match = re.search(r"<!-- doctest: sums-first-run -->\n```python\n(.*?)```", text, re.S)
    assert match, "docs/datasets.md lost its <!-- doctest: sums-first-run --> block"
    namespace: dict[str, Any] = {}
    exec(compile(match.group(1), "docs/datasets.md", "exec"), namespace)
    batch = namespace["batch"]
    assert len(batch) == 128
    assert 0.1 <= batch.meta_info["metrics"]["success_rate"] <= 0.6, batch.meta_info["metrics"]
