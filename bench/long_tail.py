"""Benchmark 2: uneven episodes, rollpipe's continuous rollout against lockstep turns.

Workload (identical in both arms, fixed by seeds):

* env ``bench_longtail`` (registered here): the episode lasts ``turns_for(seed)`` turns,
  heavy-tailed between 1 and ``max_turns`` (half the groups end after one turn, a few
  run to the end); the observation text is the same every turn.
* response lengths: every request's length is drawn from its sampling seed (which
  ``run_episode`` derives from episode seed, episode id and turn): 80 % short (4..16
  tokens), 20 % long (64..128 tokens). ``LengthBySeed`` wraps the engine and sets
  ``max_tokens`` (with ``ignore_eos``) per request; both arms use the same wrapper.
  ``--quick`` halves every length (2..8 and 32..64 tokens).

Both arms run ``n = 4 * c`` episodes with at most ``c`` in flight (the engine's and the
env pool's capacity):

* **rollpipe** — ``RolloutPipeline.get_batch(-1)`` with ``concurrency = c`` and
  ``on_length="step"`` (the env steps on every response): every episode runs its own
  turns as fast as it can, and a finished episode's slot is refilled at once.
* **lockstep** (RAGEN style, written here) — waves of ``c`` episodes; within a wave,
  turn ``t`` of all live episodes is one batched generate call, then every env steps,
  episodes that ended drop out, then turn ``t + 1``; the next wave starts when the
  whole wave is done. Prompts come from the same ``ChatFormat``, rows from
  ``trajectory_rows``.

Figure: ``long_tail_speedup`` = rollpipe trajectories/s / lockstep trajectories/s
(median of per-repeat ratios). Both arms must generate the same number of tokens.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from bench.common import (
    BenchContext,
    Figures,
    generate_each,
    median,
    reset_prefix_cache,
    rounded,
    timed,
)
from rollpipe._utils.seeding import derive_seed
from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.records import EpisodeSpec, Trajectory, Turn
from rollpipe.data.rows import trajectory_rows
from rollpipe.engines.protocol import Engine
from rollpipe.engines.records import Generation, SamplingParams
from rollpipe.envs import register
from rollpipe.nodes.episode_source import EpisodeSource
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

ENV = "bench_longtail"
TURN_WEIGHTS = (40, 20, 12, 8, 6, 5, 5, 4)  # P(episode lasts 1, 2, ..., 8 turns)
SHORT, LONG, P_LONG = (4, 16), (64, 128), 0.2  # --quick halves the lengths


def turns_for(seed: int, max_turns: int = len(TURN_WEIGHTS)) -> int:
    """Heavy-tailed episode length (turns) for an env seed."""
    rng = random.Random(derive_seed(seed, 7))
    return min(max_turns, rng.choices(range(1, len(TURN_WEIGHTS) + 1), TURN_WEIGHTS)[0])


def length_for(sampling_seed: int | None, scale: float = 1.0) -> int:
    """Heavy-tailed response length for one request, from its sampling seed."""
    rng = random.Random(derive_seed(sampling_seed or 0, 11))
    low, high = LONG if rng.random() < P_LONG else SHORT
    return max(1, round(scale * rng.randint(low, high)))


class LongTailEnv:
    """Accepts any action; ends after ``turns_for(seed)`` steps. Reward 1 at the end."""

    def __init__(self, max_turns: int = len(TURN_WEIGHTS)) -> None:
        self.max_turns = max_turns
        self._left = 0

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self._left = turns_for(seed, self.max_turns)
        return "Say anything. The episode decides when it ends.", _info()

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self._left -= 1
        done = self._left <= 0
        return "Go on.", float(done), done, False, _info(success=done)

    def close(self) -> None:
        pass


def _info(success: bool = False) -> dict[str, Any]:
    return {"action_valid": True, "action": None, "success": success}


register(ENV, LongTailEnv, overwrite=True)


class LengthBySeed:
    """Engine wrapper: each request generates exactly ``length_for(params.seed)`` tokens
    (capped by its ``max_tokens``, the token budget; no stop tokens). Everything else,
    but ``close``, is delegated to the wrapped engine."""

    def __init__(self, engine: Engine, scale: float = 1.0) -> None:
        self.inner = engine
        self.scale = scale

    def __getattr__(self, name: str) -> Any:  # version, is_paused, pause, runtime...
        return getattr(self.inner, name)

    def _params(self, params: SamplingParams) -> SamplingParams:
        n = min(length_for(params.seed, self.scale), params.max_tokens)
        return params.replace(max_tokens=n, ignore_eos=True, stop_token_ids=())

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        return await self.inner.generate(prompt_ids, self._params(params))

    def generate_batch(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Generation]:
        return generate_each(self.inner, prompts, [self._params(params)] * len(prompts))

    def generate_each(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
    ) -> list[Generation]:
        """One batched call with per-request params (the lockstep barrier)."""
        return generate_each(self.inner, prompts, [self._params(p) for p in params])

    def close(self) -> None:  # the wrapped engine belongs to the caller
        pass

    def __enter__(self) -> LengthBySeed:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _specs(n: int, seed: int) -> list[EpisodeSpec]:
    return list(EpisodeSource(n // 4, 4, seed, ENV))


def lockstep(
    engine: LengthBySeed,
    chat: ChatFormat,
    specs: Sequence[EpisodeSpec],
    sampling: SamplingParams,
    max_turns: int,
    max_length: int,
    pad_token_id: int,
) -> list[Trajectory]:
    """RAGEN-style rollout: turn t of every live episode is one batched generate call."""
    envs = [LongTailEnv(max_turns) for _ in specs]
    obs = [env.reset(s.seed)[0] for env, s in zip(envs, specs, strict=True)]
    turns: list[list[Turn]] = [[] for _ in specs]
    context: list[list[int]] = [[] for _ in specs]
    ended = ["max_turns"] * len(specs)
    live = list(range(len(specs)))
    for t in range(max_turns):
        if not live:
            break
        prompts, params, added = [], [], []
        for i in live:
            ids = chat.turn_prompt(obs[i], turns[i])
            prompt = [*context[i], *ids]
            added.append(ids)
            prompts.append(prompt)
            params.append(
                sampling.replace(
                    max_tokens=min(sampling.max_tokens, max_length - len(prompt)),
                    seed=derive_seed(specs[i].seed, specs[i].episode_id, t),
                )
            )
        gens = engine.generate_each(prompts, params)  # the lockstep barrier
        still = []
        for i, ids, prompt, gen in zip(live, added, prompts, gens, strict=True):
            text = chat.decode(gen.token_ids)
            ob, reward, term, trunc, info = envs[i].step(text)
            valid = bool(info["action_valid"])
            turns[i].append(
                Turn(
                    prompt_ids=ids,
                    response_ids=gen.token_ids,
                    logprobs=gen.logprobs,
                    versions=gen.versions,
                    reward=reward,
                    finish_reason=gen.finish_reason,
                    action_valid=valid,
                    action_text=text,
                    observation=obs[i],
                )
            )
            context[i] = [*prompt, *gen.token_ids]
            obs[i] = ob
            if term or trunc:
                ended[i] = "terminated" if term else "truncated"
            else:
                still.append(i)
        live = still
    trajs = [
        Trajectory(
            spec=s,
            env_id=i,
            turns=tuple(turns[i]),
            score=sum(u.reward for u in turns[i]),
            success=ended[i] == "terminated",
            end_reason=ended[i],  # type: ignore[arg-type]
        )
        for i, s in enumerate(specs)
    ]
    return trajs


def lockstep_waves(
    engine: LengthBySeed,
    chat: ChatFormat,
    specs: Sequence[EpisodeSpec],
    wave: int,
    sampling: SamplingParams,
    max_turns: int,
    max_length: int,
    pad_token_id: int,
) -> list[Trajectory]:
    """``lockstep`` over consecutive waves of ``wave`` episodes, then one collation."""
    trajs: list[Trajectory] = []
    for start in range(0, len(specs), wave):
        part = specs[start : start + wave]
        trajs += lockstep(engine, chat, part, sampling, max_turns, max_length, pad_token_id)
    trajectory_rows(trajs, pad_token_id)  # the same collation work as the pipeline
    return trajs


def rollpipe_arm(
    ctx: BenchContext, engine: LengthBySeed, config: PipelineConfig
) -> tuple[float, int]:
    """(seconds, generated tokens) of rollpipe's continuous rollout."""
    reset_prefix_cache(ctx.engine)
    with RolloutPipeline(config, engine, ctx.tokenizer) as pipe:
        seconds, batch = timed(lambda: pipe.get_batch(-1))
    if batch is None or len(batch) != config.batch_size:
        raise RuntimeError(f"long tail: pipeline returned {batch!r}")
    return seconds, int(batch.batch["response_mask"].sum())


def lockstep_arm(
    ctx: BenchContext, engine: LengthBySeed, config: PipelineConfig
) -> tuple[float, int]:
    """(seconds, generated tokens) of the lockstep baseline on the same specs."""
    chat = ChatFormat(ctx.tokenizer, system_prompt=config.system_prompt)
    specs = _specs(config.batch_size, config.seed)
    reset_prefix_cache(ctx.engine)
    seconds, trajs = timed(
        lambda: lockstep_waves(
            engine,
            chat,
            specs,
            config.concurrency,
            config.sampling,
            config.max_turns,
            config.max_length,
            ctx.tokenizer.pad_token_id,
        )
    )
    return seconds, sum(t.num_generated_tokens for t in trajs)


def run(ctx: BenchContext) -> Figures:
    c = ctx.size(smoke=8, quick=32, full=64)
    n = 4 * c
    engine = LengthBySeed(ctx.engine, scale=0.5 if ctx.quick else 1.0)
    ratios, fast_tps, slow_tps = [], [], []
    equal = True
    for rep in range(ctx.repeats_for(5)):
        config = PipelineConfig(
            envs=ENV,
            group_size=4,
            batch_size=n,
            num_groups=n // 4,
            seed=rep,
            max_turns=len(TURN_WEIGHTS),
            max_length=int(getattr(ctx.engine, "max_model_len", 2048)),
            concurrency=c,
            sampling=SamplingParams(max_tokens=LONG[1], temperature=1.0),
            on_length="step",
        )
        fast_s, fast_tokens = rollpipe_arm(ctx, engine, config)
        slow_s, slow_tokens = lockstep_arm(ctx, engine, config)
        equal = equal and slow_tokens == fast_tokens
        fast_tps.append(n / fast_s)
        slow_tps.append(n / slow_s)
        ratios.append(fast_tps[-1] / slow_tps[-1])
        ctx.log(
            f"  long tail rep {rep}: rollpipe {fast_s:.2f}s ({fast_tokens} tok), lockstep "
            f"{slow_s:.2f}s ({slow_tokens} tok), speedup {ratios[-1]:.2f}"
        )
    return {
        "long_tail_speedup": rounded(median(ratios)),
        "long_tail_rollpipe_trajectories_per_s": rounded(median(fast_tps)),
        "long_tail_lockstep_trajectories_per_s": rounded(median(slow_tps)),
        "long_tail_episodes": n,
        "long_tail_concurrency": c,
        "long_tail_same_tokens": equal,
    }
