"""run_episode with real engines (HF for the logic, vLLM end to end) and real FrozenLake.

The env subclasses below are real FrozenLake envs that also record what they were
given or fail on purpose; nothing stands in for an engine or an env.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Any

import pytest
import torch
from waiting import wait_until

from rollpipe._utils.seeding import derive_seed
from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.episode import EpisodeSettings, run_episode
from rollpipe.agent.records import EpisodeSpec, Trajectory
from rollpipe.data.padding import position_ids_from_mask, unpad_rows
from rollpipe.data.rows import step_rows, trajectory_rows
from rollpipe.engines.records import EngineClosedError, SamplingParams
from rollpipe.envs import FrozenLake
from rollpipe.nodes.signals import PipelineSignals

LAKE = "P__\n_H_\n__G"  # a fixed 3x3 map: the tests are about tokens, not maps
ROLL_METRICS = {"action_is_effective", "action_is_valid", "success", "format_penalty"}
SAMPLING = SamplingParams(max_tokens=16, temperature=1.0)


class RecordingLake(FrozenLake):
    """FrozenLake that keeps every action text it was stepped with, and its rewards."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(level=LAKE, **kw)
        self.actions_seen: list[str] = []
        self.rewards: list[float] = []

    def step(self, action_text: str) -> Any:
        self.actions_seen.append(action_text)
        result = super().step(action_text)
        self.rewards.append(result[1])
        return result


class BadMetricsLake(RecordingLake):
    """Reports a metric that is not a number on its second step."""

    def step(self, action_text: str) -> Any:
        obs, reward, terminated, truncated, info = super().step(action_text)
        if len(self.actions_seen) == 2:
            info["metrics"] = {**info["metrics"], "note": "not a number"}
        return obs, reward, terminated, truncated, info


class FailingLake(RecordingLake):
    """Raises on step number ``fail_at`` (0 = on reset)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at

    def reset(self, seed: int) -> Any:
        if self.fail_at == 0:
            raise OSError("reset failed")
        return super().reset(seed)

    def step(self, action_text: str) -> Any:
        if len(self.actions_seen) + 1 == self.fail_at:
            self.actions_seen.append(action_text)
            raise RuntimeError("boom")
        return super().step(action_text)


class AsyncLake:
    """An AsyncTextEnv: FrozenLake behind coroutines (as an env doing I/O would be)."""

    def __init__(self) -> None:
        self.inner = RecordingLake()

    async def reset(self, seed: int) -> Any:
        await asyncio.sleep(0)
        return self.inner.reset(seed)

    async def step(self, action_text: str) -> Any:
        await asyncio.sleep(0)
        return self.inner.step(action_text)

    def close(self) -> None:
        pass


def spec(episode: int = 0, group: int = 0) -> EpisodeSpec:
    return EpisodeSpec(group_id=group, episode_id=episode, seed=123, env_name="frozenlake")


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def check_rows_against_envs(
    trajs: list[Trajectory], envs: list[RecordingLake], tokenizer: Any, chat: ChatFormat
) -> None:
    """The token-exact claims, on real tokenizer and engine output."""
    dp = trajectory_rows(trajs, tokenizer.pad_token_id)
    b = dp.batch
    am = b["attention_mask"]
    assert torch.equal(b["position_ids"], position_ids_from_mask(am))
    assert not (b["response_mask"] & (am == 0)).any()
    first_resp = b["response_mask"].int().argmax(-1)
    cols = torch.arange(am.shape[1])
    assert torch.equal(b["prompt_mask"], cols[None] < first_resp[:, None])
    rows = unpad_rows(b["input_ids"], am)
    resp = unpad_rows(b["response_mask"], am)
    for i, (t, env) in enumerate(zip(trajs, envs, strict=True)):
        assert t.turns[0].prompt_ids == tuple(chat.first_prompt(t.initial_observation))
        assert rows[i].tolist() == [x for u in t.turns for x in (*u.prompt_ids, *u.response_ids)]
        # each response span decodes to exactly the text the env got
        flags = resp[i].int().tolist()
        spans, start = [], None
        for k, f in enumerate([*flags, 0]):
            if f and start is None:
                start = k
            elif not f and start is not None:
                spans.append(rows[i][start:k].tolist())
                start = None
        stepped = [chat.decode(s) for s, u in zip(spans, t.turns, strict=True) if u.stepped]
        assert stepped == env.actions_seen
        assert b["scores"][i].sum().item() == pytest.approx(t.score)
        assert b["scores"][i, am[i].sum() - 1].item() == pytest.approx(t.score)
    # step rows: row t is exactly engine request t (earlier turns' ids, then this turn's)
    steps = step_rows(trajs, tokenizer.pad_token_id)
    srows = unpad_rows(steps.batch["input_ids"], steps.batch["attention_mask"])
    r = 0
    for t in trajs:
        context: list[int] = []
        for u in t.turns:
            context += u.prompt_ids
            assert srows[r].tolist() == [*context, *u.response_ids]
            context += u.response_ids
            r += 1


def test_episodes_run_token_exact(hf_engine: Any, tokenizer: Any) -> None:
    chat = ChatFormat(tokenizer)
    envs = [RecordingLake() for _ in range(3)]
    admitted = 0

    async def admit() -> None:
        nonlocal admitted
        admitted += 1

    async def main() -> list[Trajectory]:
        return await asyncio.gather(
            *(
                run_episode(
                    spec(i),
                    env,
                    hf_engine,
                    chat,
                    EpisodeSettings(sampling=SAMPLING, max_turns=3, max_length=512),
                    env_id=i,
                    admit=admit,
                )
                for i, env in enumerate(envs)
            )
        )

    trajs = run(main())
    assert admitted == sum(len(t.turns) for t in trajs)  # one admit per engine request
    for i, t in enumerate(trajs):
        assert t.env_id == i and t.end_reason in ("max_turns", "terminated", "truncated")
        assert len(t.turns) == 3 or t.end_reason != "max_turns"
        assert t.engine_time_s > 0 and t.env_time_s > 0
        assert t.min_version == t.max_version == hf_engine.version
        assert t.score == pytest.approx(sum(u.reward for u in t.turns))
        for k, u in enumerate(t.turns[1:], 1):  # continuation: eot only if the response lacked it
            ended = t.turns[k - 1].response_ids[-1] == chat.eot_id
            assert (u.prompt_ids[0] == chat.eot_id) != ended
        stepped = [u for u in t.turns if u.stepped]
        if stepped:  # FrozenLake's step metrics, aggregated as ROLL does
            assert set(t.env_metrics) == ROLL_METRICS
            assert t.env_metrics["success"] == float(t.success)  # "last"
            valid = sum(u.action_valid for u in stepped) / len(stepped)  # "mean"
            assert t.env_metrics["action_is_valid"] == pytest.approx(valid)
    check_rows_against_envs(trajs, envs, tokenizer, chat)


def test_same_spec_reproduces_and_group_members_differ(hf_engine: Any, tokenizer: Any) -> None:
    chat = ChatFormat(tokenizer)

    def once(s: EpisodeSpec) -> Trajectory:
        return run(
            run_episode(
                s,
                RecordingLake(),
                hf_engine,
                chat,
                EpisodeSettings(sampling=SAMPLING, max_turns=2, max_length=512),
            )
        )

    a, b, other = once(spec(5)), once(spec(5)), once(spec(6))
    assert [u.response_ids for u in a.turns] == [u.response_ids for u in b.turns]
    assert [u.response_ids for u in a.turns] != [u.response_ids for u in other.turns]
    assert a.initial_observation == other.initial_observation  # same group seed, same start
    assert derive_seed(123, 5, 0) != derive_seed(123, 6, 0)


def test_first_prompt_longer_than_budget_ends_cleanly(hf_engine: Any, tokenizer: Any) -> None:
    chat = ChatFormat(tokenizer)
    t = run(
        run_episode(
            spec(),
            RecordingLake(),
            hf_engine,
            chat,
            EpisodeSettings(sampling=SAMPLING, max_turns=4, max_length=20),
        )
    )
    assert t.end_reason == "max_length" and t.turns == () and t.error is None
    assert t.engine_time_s == 0.0 and t.final_observation.endswith("G")
    assert t.score == 0.0 and t.num_generated_tokens == 0


def test_length_budget_caps_every_turn(hf_engine: Any, tokenizer: Any) -> None:
    chat = ChatFormat(tokenizer)
    first = len(chat.first_prompt(RecordingLake().reset(123)[0]))
    budget = first + 40
    params = SAMPLING.replace(max_tokens=30, ignore_eos=True)
    t = run(
        run_episode(
            spec(),
            RecordingLake(),
            hf_engine,
            chat,
            EpisodeSettings(sampling=params, max_turns=5, max_length=budget, on_length="step"),
        )
    )
    total = sum(len(u.prompt_ids) + len(u.response_ids) for u in t.turns)
    assert total <= budget and t.end_reason == "max_length"
    assert len(t.turns[0].response_ids) == 30
    assert all(u.finish_reason == "length" for u in t.turns)


@pytest.mark.parametrize("on_length", [None, "skip", "step", "end"])
def test_response_cut_at_max_tokens(hf_engine: Any, tokenizer: Any, on_length: str | None) -> None:
    """By default (as ROLL) a cut response is stepped and only the env rewards it, even
    with no format penalty; "skip" and "end" apply the explicit length penalty."""
    chat = ChatFormat(tokenizer)
    env = RecordingLake(format_penalty=0.0)
    params = SAMPLING.replace(max_tokens=4, ignore_eos=True)
    kw: dict[str, Any] = {}
    if on_length is not None:
        kw["on_length"] = on_length
    if on_length in ("skip", "end"):
        kw["length_penalty"] = -0.5
    t = run(
        run_episode(
            spec(),
            env,
            hf_engine,
            chat,
            EpisodeSettings(sampling=params, max_turns=3, max_length=512, **kw),
        )
    )
    assert all(u.length_cut and len(u.response_ids) == 4 for u in t.turns)
    if on_length == "skip":  # not handed to the env, penalized, episode goes on
        assert env.actions_seen == [] and len(t.turns) == 3 and t.end_reason == "max_turns"
        assert [u.reward for u in t.turns] == [-0.5] * 3 and not any(u.stepped for u in t.turns)
        assert all(u.observation == t.initial_observation for u in t.turns)
        assert all(u.prompt_ids[0] == chat.eot_id for u in t.turns[1:])  # turn closed for it
        assert t.env_metrics == {}  # the env was never stepped
    elif on_length == "end":
        assert len(t.turns) == 1 and t.end_reason == "max_length" and t.score == -0.5
        assert env.actions_seen == []
    else:  # "step", the default
        assert env.actions_seen == [u.action_text for u in t.turns]
        assert all(u.stepped for u in t.turns)
        assert [u.reward for u in t.turns] == env.rewards  # the env's rewards, nothing added
        assert t.score == sum(env.rewards) and -0.1 not in env.rewards
        assert set(t.env_metrics) == ROLL_METRICS
    check_rows_against_envs([t], [env], tokenizer, chat)


def test_on_length_arguments_are_checked() -> None:
    # checked once, when the settings are built (run_episode trusts its record)
    kw: dict[str, Any] = {"sampling": SAMPLING, "max_turns": 1, "max_length": 512}
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {"length_penalty": -0.5},
            r"EpisodeSettings.length_penalty=-0.5 applies only to on_length='skip' or 'end'",
        ),
        ({"on_length": "drop"}, "EpisodeSettings.on_length must be one of"),
        (
            {"on_length": "skip", "length_penalty": float("nan")},
            r"EpisodeSettings.length_penalty must be a finite number in \(-inf, inf\), got nan",
        ),
    ]
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            EpisodeSettings(**kw, **extra)


def test_malformed_env_metrics_are_an_env_error(hf_engine: Any, tokenizer: Any) -> None:
    chat = ChatFormat(tokenizer)
    kw: dict[str, Any] = {"sampling": SAMPLING, "max_turns": 3, "max_length": 512}
    env = BadMetricsLake()  # one step cannot end an episode on LAKE: the second always runs
    t = run(run_episode(spec(), env, hf_engine, chat, EpisodeSettings(**kw)))
    assert len(env.actions_seen) == 2 and t.end_reason == "error"
    assert "info['metrics']['note'] must be a number" in str(t.error)
    assert len(t.turns) == 2 and t.turns[1].stepped  # the env did step; its report was bad
    with pytest.raises(ValueError, match=r"\['note'\] must be a number"):
        run(
            run_episode(
                spec(),
                BadMetricsLake(),
                hf_engine,
                chat,
                EpisodeSettings(**kw, raise_env_errors=True),
            )
        )


@pytest.mark.parametrize("fail_at", [0, 2])
def test_env_error_is_recorded(hf_engine: Any, tokenizer: Any, fail_at: int) -> None:
    chat = ChatFormat(tokenizer)
    env = FailingLake(fail_at)
    t = run(
        run_episode(
            spec(),
            env,
            hf_engine,
            chat,
            EpisodeSettings(sampling=SAMPLING, max_turns=4, max_length=512, on_length="step"),
        )
    )
    assert t.end_reason == "error"
    call, turn = ("reset", 0) if fail_at == 0 else ("step", 1)
    raised = "OSError('reset failed')" if fail_at == 0 else "RuntimeError('boom')"
    s = spec()  # the text says what was raised, then where: env, seed, episode and turn
    assert t.error == (
        f"{raised} (in FailingLake.{call}: env {s.env_name!r}, seed {s.seed}, episode "
        f"{s.episode_id}, turn {turn}, env_timeout_s=60.0)"
    )
    assert len(t.turns) == (0 if fail_at == 0 else 2)
    if fail_at == 2:  # the failed step's response is kept, marked as not stepped
        assert t.turns[0].stepped and not t.turns[1].stepped
    with pytest.raises(RuntimeError, match="boom"):
        run(
            run_episode(
                spec(),
                FailingLake(1),
                hf_engine,
                chat,
                EpisodeSettings(
                    sampling=SAMPLING,
                    max_turns=4,
                    max_length=512,
                    on_length="step",
                    raise_env_errors=True,
                ),
            )
        )


def test_engine_error_propagates(tiny_model_path: Any, tokenizer: Any) -> None:
    from rollpipe.engines.hf import HFEngine

    engine = HFEngine(tiny_model_path)
    engine.close()
    with pytest.raises(EngineClosedError):
        run(
            run_episode(
                spec(),
                RecordingLake(),
                engine,
                ChatFormat(tokenizer),
                EpisodeSettings(sampling=SAMPLING, max_turns=2, max_length=512),
            )
        )


def test_async_env_matches_blocking_env(hf_engine: Any, tokenizer: Any) -> None:
    chat = ChatFormat(tokenizer)
    sync_env, async_env = RecordingLake(), AsyncLake()
    kw: dict[str, Any] = {"sampling": SAMPLING, "max_turns": 2, "max_length": 512}
    a = run(run_episode(spec(3), sync_env, hf_engine, chat, EpisodeSettings(**kw)))
    b = run(run_episode(spec(3), async_env, hf_engine, chat, EpisodeSettings(**kw)))
    assert [u.response_ids for u in a.turns] == [u.response_ids for u in b.turns]
    assert sync_env.actions_seen == async_env.inner.actions_seen


def test_window_mode_prompts_are_rebuilt_each_turn(hf_engine: Any, tokenizer: Any) -> None:
    chat = ChatFormat(tokenizer, history_window=1)
    env = RecordingLake()
    t = run(
        run_episode(
            spec(),
            env,
            hf_engine,
            chat,
            EpisodeSettings(sampling=SAMPLING, max_turns=3, max_length=400),
        )
    )
    assert t.history_window == 1
    for k, u in enumerate(t.turns):
        assert u.prompt_ids == tuple(chat.window_prompt(u.observation, t.turns[:k]))
    steps = step_rows([t], tokenizer.pad_token_id)
    rows = unpad_rows(steps.batch["input_ids"], steps.batch["attention_mask"])
    assert [r.tolist() for r in rows] == [[*u.prompt_ids, *u.response_ids] for u in t.turns]
    assert steps.batch["step"].tolist() == list(range(len(t.turns)))
    with pytest.raises(ValueError, match="use step_rows"):
        trajectory_rows([t], tokenizer.pad_token_id)


def test_abort_regenerates_the_same_turn(hf_engine: Any, tokenizer: Any) -> None:
    control = PipelineSignals()
    calls = 0

    start = hf_engine.tokens_generated
    n = 800  # of max_length 1024: far more steps than the abort takes to land

    def suspend_and_resume() -> None:
        wait_until(lambda: hf_engine.tokens_generated > start, 60, "the request's first token")
        control.suspension.suspend()  # admission closes (no engine: it pauses none)
        hf_engine.pause("abort")  # returns once the request ended with "abort"
        hf_engine.resume()
        control.suspension.resume()

    async def admit() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            threading.Thread(target=suspend_and_resume, daemon=True).start()
        await control.admit()

    params = SAMPLING.replace(max_tokens=n, ignore_eos=True)
    t = run(
        run_episode(
            spec(),
            RecordingLake(),
            hf_engine,
            ChatFormat(tokenizer),
            EpisodeSettings(sampling=params, max_turns=1, max_length=1024, on_length="step"),
            admit=admit,
        )
    )
    assert calls == 2  # admitted again before the regeneration
    assert len(t.turns) == 1 and len(t.turns[0].response_ids) == n
    assert 0 < t.aborted_tokens < n  # the partial turn thrown away, counted
    assert t.turns[0].finish_reason == "length"


def test_end_to_end_vllm_frozenlake_rows(vllm_engine: Any, tokenizer: Any) -> None:
    """A handful of FrozenLake episodes on vLLM, turn by turn, give valid rows."""
    chat = ChatFormat(tokenizer)
    envs = [RecordingLake() for _ in range(4)]
    sampling = SamplingParams(max_tokens=24, temperature=1.0)

    async def main() -> list[Trajectory]:
        return await asyncio.gather(
            *(
                run_episode(
                    spec(i, group=i // 2),
                    env,
                    vllm_engine,
                    chat,
                    EpisodeSettings(sampling=sampling, max_turns=3, max_length=600),
                    env_id=i,
                )
                for i, env in enumerate(envs)
            )
        )

    trajs = run(main())
    assert all(t.turns and t.end_reason != "error" for t in trajs)
    check_rows_against_envs(trajs, envs, tokenizer, chat)
    dp = trajectory_rows(trajs, tokenizer.pad_token_id, pad_to_multiple_of=16)
    assert dp.batch["input_ids"].shape[1] % 16 == 0
    lp = dp.batch["infer_logprobs"][dp.batch["response_mask"]]
    assert (lp <= 0).all() and (lp < 0).any()
    assert dp.batch["traj_group_id"].tolist() == [0, 0, 1, 1]
    assert list(dp.non_tensor_batch["uid"]) == ["frozenlake/g0"] * 2 + ["frozenlake/g1"] * 2


def test_prompts_handed_to_the_engine_are_never_changed_afterwards(tokenizer: Any) -> None:
    """An engine may keep the prompt object it was given (a recorder, a cache): the
    episode grows its own context, never the list it handed over."""
    from rollpipe.engines.scripted import ScriptedEngine

    kept: list[tuple[list[int], list[int]]] = []  # (the object given, a copy of it then)
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def policy(prompt: list[int], params: SamplingParams) -> list[int]:
        kept.append((prompt, list(prompt)))
        return [*tokenizer("Up", add_special_tokens=False)["input_ids"], eot]

    settings = EpisodeSettings(max_turns=4, sampling=SamplingParams(max_tokens=8))
    with ScriptedEngine(policy) as engine:
        traj = run(run_episode(spec(), FrozenLake(), engine, ChatFormat(tokenizer), settings))
    assert len(kept) == len(traj.turns) >= 2
    for given, then in kept:
        assert given == then
    assert all(len(a[0]) < len(b[0]) for a, b in itertools.pairwise(kept))
