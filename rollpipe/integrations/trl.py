"""TRL's ``GRPOTrainer`` trained on rollpipe's rollouts: a ``rollout_func`` from a pipeline::

    args = GRPOConfig("out", num_generations=4, per_device_train_batch_size=8, max_steps=4)
    config = PipelineConfig(envs="frozenlake", group_size=4)
    GRPOTrainer(path, args=args, **grpo_trainer_kwargs(path, config, args)).train()

``grpo_trainer_kwargs`` builds an engine and a pipeline for ``path`` and hands the trainer
its ``rollout_func`` (a ``TRLRollout``), ``reward_funcs`` and ``train_dataset``. Each call
TRL makes (once per generation batch) first brings the engine's weights to the trainer's
when an optimizer step happened since the last load (``suspend -> update_weights ->
resume``, as version ``trainer.state.global_step``), then asks the pipeline for
``len(prompts)`` trajectories, whole groups of ``num_generations``, and returns their rows
(``trl_rows.trl_fields``). When training ends, a ``TrainerCallback`` that the rollout adds
to the trainer loads the final weights (TRL's last optimizer step comes after its last
``rollout_func`` call) and closes what ``grpo_trainer_kwargs`` built. TRL's prompts are
placeholders: rollpipe's envs make the prompts. See ``docs/trl.md``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

from transformers import TrainerCallback

from rollpipe.config import PipelineConfig
from rollpipe.data.proto import DataProto
from rollpipe.engines.protocol import Engine, PauseMode
from rollpipe.integrations.trl_rows import trl_fields
from rollpipe.pipeline import RolloutPipeline

__all__ = [
    "FinalWeights",
    "TRLRollout",
    "episode_reward",
    "grpo_trainer_kwargs",
    "pipeline_rollout",
    "placeholder_dataset",
]

METRICS_FIELD = "rollpipe_metrics"


class TRLRollout:
    """``GRPOTrainer(rollout_func=...)`` drawing from ``pipeline`` (see the module doc).

    Args:
        pipeline: the ``RolloutPipeline``; its ``group_size`` must equal TRL's
            ``num_generations`` and its sampling temperature TRL's ``temperature``.
        sync_weights: load the trainer's weights into the engine after each optimizer
            step and when training ends (False only if you sync yourself).
        suspend_mode: the pipeline's pause mode while loading (``"abort"``, ROLL's).
        close_on_train_end: close the pipeline (and the engine it owns) when training
            ends, after the last load.

    ``syncs`` lists ``(global_step, engine version)`` per weight load (equal pairs);
    ``last_batch`` is the ``DataProto`` TRL got last.
    """

    def __init__(
        self,
        pipeline: RolloutPipeline,
        *,
        sync_weights: bool = True,
        suspend_mode: PauseMode = "abort",
        close_on_train_end: bool = False,
    ) -> None:
        if not isinstance(pipeline, RolloutPipeline):
            raise TypeError(
                f"TRLRollout: pipeline must be a RolloutPipeline, got {type(pipeline).__name__}; "
                "or call pipeline_rollout(config, engine, tokenizer)"
            )
        self.pipeline, self.sync_weights, self.suspend_mode = pipeline, sync_weights, suspend_mode
        self.close_on_train_end = close_on_train_end
        self.callback = FinalWeights(self)
        self.syncs: list[tuple[int, int]] = []
        self.last_batch: DataProto | None = None
        self._synced_step: int | None = None
        self._trainer: Any = None

    # -- TRL's call ---------------------------------------------------------------------
    def __call__(self, prompts: Sequence[Any], trainer: Any) -> dict[str, Any]:
        """TRL's ``rollout_func(prompts, trainer)``: ``prompt_ids``, ``completion_ids``,
        ``logprobs``, ``env_mask`` and extra fields, one entry per prompt."""
        self._check_trainer(trainer, len(prompts))
        self._attach(trainer)
        step = int(trainer.state.global_step)
        if self.sync_weights:
            self.sync(trainer)
        data = DataProto(meta_info={"global_step": step})
        batch = self.pipeline.get_batch(data, len(prompts))
        if batch is None:
            raise RuntimeError(
                f"TRLRollout: {self.pipeline.name}'s episode source ended at global_step "
                f"{step}; set num_groups=None (endless) or fewer max_steps"
            )
        self._check_versions(batch)
        self.last_batch = batch
        fields: dict[str, Any] = dict(trl_fields(batch))
        fields[METRICS_FIELD] = dict(batch.meta_info.get("metrics", {}))  # one dict, all rows
        return fields

    def _attach(self, trainer: Any) -> None:
        """Add ``self.callback`` to the trainer once, for the load when training ends."""
        self._trainer = trainer
        if self.callback not in trainer.callback_handler.callbacks:
            trainer.add_callback(self.callback)

    # -- weights ------------------------------------------------------------------------
    def sync(self, trainer: Any) -> int:
        """Load the trainer's weights as version ``trainer.state.global_step`` if it
        stepped since the last load; returns the engine's version. The rollout calls it at
        each call and when training ends: you need not."""
        step = int(trainer.state.global_step)
        if step != self._synced_step:
            self._load(trainer, step)
        return self.pipeline.version

    def _load(self, trainer: Any, step: int) -> None:
        model = trainer.accelerator.unwrap_model(trainer.model)
        if hasattr(model, "peft_config"):
            raise NotImplementedError(
                "TRLRollout: the trainer's model is a PEFT model, whose state dict is not the "
                "engine's; merge the adapter into a full model first, or pass "
                "sync_weights=False and load merged weights yourself"
            )
        current = self.pipeline.version
        if step < current:
            raise RuntimeError(
                f"TRLRollout: the engine is at version {current}, past the trainer's "
                f"global_step {step}; its version is the global_step of the weights it holds, "
                "so give the trainer a fresh engine (version 0), and let this rollout "
                "function be the only one to update its weights"
            )
        with self.pipeline.suspended(self.suspend_mode):
            loaded = self.pipeline.update_weights(model, version=step)
        if loaded != step or self.pipeline.version != step:
            raise RuntimeError(
                f"TRLRollout: asked for version {step}, the engine reports "
                f"{self.pipeline.version} (update returned {loaded})"
            )
        self._synced_step = step
        self.syncs.append((step, step))

    def _check_versions(self, batch: DataProto) -> None:
        """On-policy pipelines (``async_generation_ratio=0``): every generated token is of
        the weights just loaded."""
        if not self.sync_weights or self.pipeline.config.async_generation_ratio != 0:
            return
        rows = batch.batch
        if rows is None:
            return
        versions = rows["policy_versions"][rows["response_mask"].bool()]
        wrong = sorted({int(v) for v in versions.unique()} - {self.pipeline.version})
        if wrong:
            raise RuntimeError(
                f"TRLRollout: rows hold tokens of version(s) {wrong}, the engine holds "
                f"{self.pipeline.version}; the batch is not the trainer's policy"
            )

    # -- the end ------------------------------------------------------------------------
    def train_ended(self) -> None:
        """The trainer's last weights into the engine; then close if asked to."""
        try:
            if self.sync_weights and self._trainer is not None:
                self.sync(self._trainer)
        finally:
            if self.close_on_train_end:
                self.close()

    def close(self) -> None:
        """Close the pipeline (and the engine it owns). Idempotent."""
        self.pipeline.close()

    def __enter__(self) -> TRLRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- checks -------------------------------------------------------------------------
    def _check_trainer(self, trainer: Any, n_prompts: int) -> None:
        if not trainer.model.training:
            raise NotImplementedError(
                "TRLRollout: TRL asked for evaluation rollouts; this rollout function serves "
                "training only: set GRPOConfig(eval_strategy='no') and evaluate with rollpipe"
            )
        check_settings(self.pipeline.config, trainer.num_generations, trainer.temperature)
        group = self.pipeline.config.source.group_size
        if n_prompts % group:
            raise ValueError(
                f"TRLRollout: TRL asked for {n_prompts} completions on this process, not a "
                f"multiple of group_size={group}; make per_device_train_batch_size * "
                "steps_per_generation a multiple of num_generations"
            )
        if getattr(trainer, "tools", None):
            raise ValueError(
                "TRLRollout: the trainer has tools or an environment_factory, so TRL would run "
                "its own tool loop on rollpipe's completions (and ignore env_mask); give the "
                "env to the pipeline instead (rollpipe.integrations.trl_env.TRLEnv)"
            )


class FinalWeights(TrainerCallback):  # type: ignore[misc]
    """``on_train_end``: the engine gets the trainer's final weights (TRL's last optimizer
    step comes after its last ``rollout_func`` call), then the rollout closes if it was
    built to. ``TRLRollout`` adds it to the trainer at its first call."""

    def __init__(self, rollout: TRLRollout) -> None:
        self.rollout = rollout

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.rollout.train_ended()


def check_settings(config: PipelineConfig, num_generations: int, temperature: float) -> None:
    """TRL's ``num_generations`` and ``temperature`` must be the pipeline's group size and
    sampling temperature; fails naming both."""
    group = config.source.group_size
    if num_generations != group:
        raise ValueError(
            f"TRLRollout: GRPOConfig.num_generations={num_generations} but the "
            f"pipeline's group_size={group}; TRL normalizes rewards over num_generations "
            "consecutive rows, which must be one rollpipe group: make them equal"
        )
    sampling = config.episode.sampling.temperature
    if float(temperature) != float(sampling):
        raise ValueError(
            f"TRLRollout: GRPOConfig.temperature={temperature} but the pipeline "
            f"samples at {sampling} (EpisodeSettings.sampling); TRL scores tokens at "
            "its temperature, so make them equal"
        )


def grpo_trainer_kwargs(
    path: str | os.PathLike[str],
    config: PipelineConfig,
    args: Any,
    *,
    engine: Engine | Callable[[], Engine] | None = None,
    reward_funcs: Any = None,
    keep_open: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """``GRPOTrainer``'s ``rollout_func``, ``reward_funcs`` and ``train_dataset`` for
    ``GRPOTrainer(path, args=args, **grpo_trainer_kwargs(path, config, args))``.

    Args:
        path: the model's (and tokenizer's) local path, the one the trainer loads.
        config: the pipeline's settings (envs, ``group_size`` = ``args.num_generations``).
        args: the trainer's ``GRPOConfig``, checked against ``config`` here.
        engine: the engine, or a zero-argument factory; default ``VLLMEngine(path)``.
            Built here (a factory or the default), it is closed with the pipeline.
        reward_funcs: TRL's reward functions; default ``episode_reward`` (the env's).
        keep_open: keep the pipeline and its engine open after ``train()``, which
            otherwise closes them (then close with ``kwargs["rollout_func"].close()``).
        options: for ``TRLRollout`` (``sync_weights``, ``suspend_mode``).

    The engine holds the trainer's final weights when ``train()`` returns, as version
    ``trainer.state.global_step``.

    Examples:
        >>> from types import SimpleNamespace
        >>> from rollpipe import ScriptedEngine
        >>> args = SimpleNamespace(num_generations=2, temperature=1.0, generation_batch_size=8,
        ...                        gradient_accumulation_steps=1)  # a GRPOConfig's fields
        >>> kwargs = grpo_trainer_kwargs(model_path, PipelineConfig(group_size=2), args,
        ...                              engine=lambda: ScriptedEngine(lambda *_: []))
        >>> sorted(kwargs), len(kwargs["train_dataset"]), kwargs["reward_funcs"]([1.0, 0.0])
        (['reward_funcs', 'rollout_func', 'train_dataset'], 4, [1.0, 0.0])
        >>> kwargs["rollout_func"].close()  # train() does it; the engine built here closes too
    """
    check_settings(config, args.num_generations, args.temperature)
    dataset = placeholder_dataset(args)
    if engine is None:
        from rollpipe.engines.vllm import VLLMEngine

        engine = functools.partial(VLLMEngine, os.fspath(path))
    pipeline = RolloutPipeline(config, engine, path)
    rollout = TRLRollout(pipeline, close_on_train_end=not keep_open, **options)
    return {
        "rollout_func": rollout,
        "reward_funcs": episode_reward if reward_funcs is None else reward_funcs,
        "train_dataset": dataset,
    }


def pipeline_rollout(
    pipeline_or_config: RolloutPipeline | PipelineConfig,
    engine: Engine | Callable[[], Engine] | None = None,
    tokenizer: Any = None,
    **options: Any,
) -> TRLRollout:
    """A ``TRLRollout`` from a pipeline, or from ``config, engine, tokenizer`` (the
    pipeline is built here; close it with ``rollout.close()``). ``options`` go
    to ``TRLRollout``.

    Examples:
        TRL calls it with its prompts (placeholders) and the trainer; it returns TRL's fields:

        >>> from types import SimpleNamespace as NS
        >>> from rollpipe import ScriptedEngine
        >>> callbacks = []
        >>> trainer = NS(model=NS(training=True), num_generations=2, temperature=1.0, tools=None,
        ...              state=NS(global_step=0), callback_handler=NS(callbacks=callbacks),
        ...              add_callback=callbacks.append)
        >>> engine = lambda: ScriptedEngine(lambda *_: tokenizer.encode("<answer>Up</answer>"))
        >>> with pipeline_rollout(PipelineConfig(group_size=2), engine, tokenizer,
        ...                       sync_weights=False) as rollout:
        ...     fields = rollout([""] * 4, trainer)
        >>> sorted(fields)  # TRL's four, then extra fields for its reward functions
        ['completion_ids', 'end_reason', 'env_mask', 'episode_score', 'logprobs', 'prompt_ids',
         'rollpipe_metrics', 'traj_uid', 'uid']
        >>> len(fields["prompt_ids"]), sorted(set(fields["env_mask"][0])), len(callbacks)
        (4, [0, 1], 1)
    """
    if isinstance(pipeline_or_config, RolloutPipeline):
        if engine is not None or tokenizer is not None:
            raise ValueError(
                "pipeline_rollout: give a pipeline alone, or a config with engine and tokenizer"
            )
        return TRLRollout(pipeline_or_config, **options)
    if not isinstance(pipeline_or_config, PipelineConfig) or engine is None or tokenizer is None:
        raise ValueError(
            f"pipeline_rollout: got {type(pipeline_or_config).__name__} with engine={engine!r}, "
            "tokenizer given: "
            f"{tokenizer is not None}; give a RolloutPipeline, or a PipelineConfig, an engine "
            "and a tokenizer"
        )
    return TRLRollout(RolloutPipeline(pipeline_or_config, engine, tokenizer), **options)


def episode_reward(
    episode_score: Sequence[float],
    log_metric: Callable[[str, float], None] | None = None,
    rollpipe_metrics: Sequence[dict[str, float]] | None = None,
    **kwargs: Any,
) -> list[float]:
    """A TRL reward function: each row's rollpipe episode score (the sum of its env's
    rewards). It also logs the batch's rollpipe metrics as ``rollpipe/<name>``."""
    if log_metric is not None and rollpipe_metrics:
        for name, value in rollpipe_metrics[0].items():
            log_metric(f"rollpipe/{name}", float(value))
    return [float(s) for s in episode_score]


def placeholder_dataset(args: Any) -> Any:
    """The ``train_dataset`` TRL needs: empty prompts, rollpipe's envs make the real ones.

    ``gradient_accumulation_steps`` generation batches' worth of rows, so that an epoch
    of them is whole optimizer steps (a shorter epoch ends an accumulation early). Set
    ``max_steps`` in ``args``: the placeholders repeat."""
    from datasets import Dataset

    per_batch = int(args.generation_batch_size) // int(args.num_generations)
    rows = max(1, per_batch * int(args.gradient_accumulation_steps))
    return Dataset.from_dict({"prompt": [""] * rows})
