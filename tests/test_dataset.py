"""Prompt datasets: each group is one row, in an order the seed fixes, with epochs, a
resumable position, validation passes, and the row handed to the env's reset."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe import PipelineConfig, RolloutPipeline
from rollpipe.envs.task import PromptTask, exact_match, extract_answer
from rollpipe.nodes.dataset import DatasetSettings
from rollpipe.nodes.episode_source import EpisodeSource

ROWS = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(10)]


def source(dataset: DatasetSettings, group_size: int = 3, num_groups=None, seed: int = 5):
    return EpisodeSource(num_groups, group_size, seed, "task", dataset=dataset)


def indices(specs) -> list[int]:
    return [s.row_index for s in specs]


def test_two_ordered_epochs_yield_each_row_twice_per_member_in_order():
    specs = list(source(DatasetSettings(rows=ROWS, shuffle=False, epochs=2)))
    group_size = 3
    assert len(specs) == 2 * len(ROWS) * group_size
    assert Counter(indices(specs)) == {i: 2 * group_size for i in range(len(ROWS))}
    firsts = indices(specs)[::group_size]
    assert firsts == [*range(10), *range(10)]
    for spec in specs:  # the row travels with the spec, as data
        assert spec.row == ROWS[spec.row_index]
        assert len({s.row_index for s in specs if s.group_id == spec.group_id}) == 1


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), epochs=st.integers(1, 4))
def test_shuffled_epochs_are_permutations_reproducible_from_the_seed(seed, epochs):
    def order(s):
        specs = list(source(DatasetSettings(rows=ROWS, epochs=epochs), 1, seed=s))
        return indices(specs)

    first = order(seed)
    assert first == order(seed)
    for e in range(epochs):
        assert sorted(first[10 * e : 10 * (e + 1)]) == list(range(10))


def test_epochs_differ_and_seeds_differ():
    """Fixed seeds (10! orders: equal ones here would be a bug, not bad luck)."""

    def order(seed):
        return indices(source(DatasetSettings(rows=ROWS, epochs=3), 1, seed=seed))

    epochs = [tuple(order(11)[10 * e : 10 * (e + 1)]) for e in range(3)]
    assert len(set(epochs)) == 3
    assert order(11) != order(12)


@settings(max_examples=40, deadline=None)
@given(
    cut=st.integers(0, 60),
    shuffle=st.booleans(),
    group_size=st.integers(1, 3),
    streamed=st.booleans(),
)
def test_a_checkpoint_anywhere_resumes_with_no_row_lost_or_repeated(
    cut, shuffle, group_size, streamed
):
    rows = ReIterable(ROWS) if streamed else ROWS
    dataset = DatasetSettings(rows=rows, shuffle=shuffle and not streamed, epochs=2)
    whole = list(source(dataset, group_size))
    first = source(dataset, group_size)
    before = [next(first) for _ in range(min(cut, len(whole)))]
    state = json.loads(json.dumps(first.state_dict()))  # plain data
    resumed = source(dataset, group_size)
    resumed.reset(state)
    after = list(resumed)
    assert before + after == whole


def test_a_validation_pass_is_the_same_every_time():
    def one_pass():
        return [(s.group_id, s.row_index) for s in source(DatasetSettings.validation(ROWS), 2)]

    passes = [one_pass() for _ in range(3)]
    assert passes[0] == passes[1] == passes[2]
    assert [i for _, i in passes[0][::2]] == list(range(10))


def test_num_groups_stops_before_the_epochs_end():
    specs = list(source(DatasetSettings(rows=ROWS, shuffle=False, epochs=None), 2, 4))
    assert indices(specs)[::2] == [0, 1, 2, 3]
    endless = source(DatasetSettings(rows=ROWS, shuffle=False, epochs=None), 1)
    assert indices(next(endless) for _ in range(25)) == [i % 10 for i in range(25)]


class ReIterable:
    """Rows without len() or indexing (a streamed dataset), iterable more than once."""

    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def test_a_stream_runs_in_order_with_epochs_and_a_one_shot_iterator_once():
    specs = list(source(DatasetSettings(rows=ReIterable(ROWS), shuffle=False, epochs=2), 1))
    assert indices(specs) == [*range(10), *range(10)]
    once = list(source(DatasetSettings(rows=iter(ROWS), shuffle=False, epochs=3), 1))
    assert indices(once) == list(range(10))
    with pytest.raises(ValueError, match=r"shuffle=True needs rows with len\(\) and indexing"):
        DatasetSettings(rows=ReIterable(ROWS))


def test_rows_load_from_files_and_import_paths(tmp_path):
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    assert list(DatasetSettings(rows=str(jsonl)).rows) == ROWS
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    assert list(DatasetSettings(rows=str(tmp_path / "rows.json")).rows) == ROWS
    assert list(DatasetSettings(rows="tests.test_dataset:ROWS").rows) == ROWS
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 1}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl' line 2"):
        DatasetSettings(rows=str(bad))
    with pytest.raises(ValueError, match="the dataset has no rows"):
        DatasetSettings(rows=[])
    with pytest.raises(ValueError, match=r"no file '.*missing.jsonl'"):
        DatasetSettings(rows=str(tmp_path / "missing.jsonl"))


def test_a_datasets_dataset_is_rows():
    import datasets  # the datasets extra (in dev)

    table = datasets.Dataset.from_list(ROWS)
    specs = list(source(DatasetSettings(rows=table, shuffle=False), 1))
    assert [s.row for s in specs] == ROWS


def test_an_env_that_takes_no_row_fails_when_the_config_is_built():
    with pytest.raises(ValueError, match=r"FrozenLake.reset takes no 'row'"):
        PipelineConfig(envs="frozenlake", dataset=ROWS)


def test_prompt_task_scores_a_scripted_answer():
    task = PromptTask(attempts=2)
    prompt, _ = task.reset(0, row=ROWS[3])
    assert prompt == "What is 3 + 3?"
    obs, reward, done, _, info = task.step("I think 5")
    assert (reward, done, info["action_valid"]) == (0.0, False, False)
    assert obs == task.feedback
    obs, reward, done, _, info = task.step("so \\boxed{6}")
    assert (reward, done, info["success"]) == (1.0, True, True)
    assert extract_answer("<answer> 1,000 </answer>") == "1,000"
    assert exact_match("\\boxed{1,000.}", "1000") == 1.0
    with pytest.raises(ValueError, match="needs a dataset row"):
        task.reset(0)


def test_prompt_task_with_math_verify():
    task = PromptTask(score="math_verify")
    task.reset(0, row={"prompt": "half of 1?", "answer": "1/2"})
    assert task.step("The answer is $\\frac{1}{2}$")[1] == 1.0
    task.reset(0, row={"prompt": "half of 1?", "answer": "1/2"})
    assert task.step("The answer is $\\frac{1}{3}$")[1] == 0.0


def test_a_dataset_pipeline_hands_each_group_its_row(vllm_engine, tokenizer):
    """Real engine, real env: each row's prompt is in its rows' input ids, every row of the
    one pass arrives once per member (the ``row_index`` column says which), and each
    episode's score is the scorer's verdict on what the model said."""
    group_size = 2
    cfg = PipelineConfig(
        envs=[{"name": "task", "config": {"template": "Q: {prompt}"}}],
        dataset=DatasetSettings(rows=ROWS, shuffle=False, epochs=1),
        group_size=group_size,
        batch_size=4,
        max_turns=1,
        max_length=256,
        sampling={"max_tokens": 8},
        system_prompt="Answer in \\boxed{}.",
    )
    seen: Counter[int] = Counter()
    with RolloutPipeline(cfg, vllm_engine, tokenizer) as pipe:
        for batch in pipe:
            ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
            responses = batch.batch["response_mask"]
            for r, index in enumerate(batch.non_tensor_batch["row_index"]):
                seen[index] += 1
                real = ids[r][mask[r].bool()]
                text = tokenizer.decode(real)
                assert f"Q: {ROWS[index]['prompt']}" in text
                said = tokenizer.decode(ids[r][responses[r].bool()], skip_special_tokens=True)
                score = float(batch.batch["episode_scores"][r])
                assert score == exact_match(said, ROWS[index]["answer"])
    assert seen == {i: group_size for i in range(len(ROWS))}


def test_a_pipeline_resumed_mid_epoch_sees_every_row_once(vllm_engine, tokenizer):
    """Checkpoint after the first batch, restore in a new pipeline: the rows of the two
    runs together are the epoch, each row once per member, none lost or repeated."""
    import io

    import torch

    def plain_round_trip(state):  # what a checkpoint file gives back
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=True)

    cfg = PipelineConfig(
        envs="task",
        dataset=DatasetSettings(rows=ROWS, epochs=1),
        group_size=2,
        batch_size=4,
        max_turns=1,
        max_length=256,
        sampling={"max_tokens": 4},
    )

    def seen(batches):
        return [int(i) for b in batches for i in b.non_tensor_batch["row_index"]]

    with RolloutPipeline(cfg, vllm_engine, tokenizer) as pipe:
        whole = seen(pipe)
    with RolloutPipeline(cfg, vllm_engine, tokenizer) as pipe:
        first = seen([pipe.get_batch()])
        state = plain_round_trip(pipe.state_dict())
    with RolloutPipeline(cfg, vllm_engine, tokenizer) as restored:
        restored.load_state_dict(state)
        rest = seen(restored)
    assert Counter(first + rest) == Counter(whole) == {i: 2 for i in range(len(ROWS))}
    assert first == whole[: len(first)]


def test_an_env_brings_its_own_system_prompt(tokenizer):
    """PromptTask's instructions replace the pipeline's game prompt in its episodes; an env
    that declares none keeps the pipeline's; the copies are kept, one per prompt."""
    from rollpipe.agent.chat import DEFAULT_SYSTEM_PROMPT, ChatFormat
    from rollpipe.envs.frozenlake import FrozenLake
    from rollpipe.envs.task import DEFAULT_TASK_PROMPT

    chat = ChatFormat(tokenizer)
    task = PromptTask()
    own = chat.for_env(task)
    assert own.system_prompt == DEFAULT_TASK_PROMPT and chat.for_env(task) is own
    assert chat.for_env(FrozenLake()) is chat
    text = tokenizer.decode(own.turn_prompt("What is 1 + 1?", []))
    assert DEFAULT_TASK_PROMPT in text and DEFAULT_SYSTEM_PROMPT not in text
    assert chat.for_env(PromptTask(system_prompt=None)).system_messages() == []
    task.system_prompt = 3  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"PromptTask.system_prompt must be a str or None"):
        chat.for_env(task)
