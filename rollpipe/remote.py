"""A ``RolloutPipeline`` as a Ray actor, driven with ROLL's calls (docs/ray-actor.md).

Threaded actor (``RolloutPipeline`` itself; ``max_concurrency > 1`` so that ``suspend``
runs while ``get_batch`` blocks)::

    scheduler = ray.remote(RolloutPipeline).options(max_concurrency=4).remote(
        config, functools.partial(VLLMEngine, path), path
    )

Async actor (this module's ``AsyncRolloutActor``: each method runs the pipeline's
blocking call in a worker thread, so the actor's event loop never blocks)::

    make_engine = functools.partial(VLLMEngine, path)
    scheduler = ray.remote(AsyncRolloutActor).remote(config, make_engine, path)

Either way: ``ray.get(scheduler.suspend.remote())``, ``ray.get(scheduler.update_weights
.remote(state_dict))``, ``ray.get(scheduler.get_batch.remote(data=DataProto(meta_info=
{"global_step": step}), batch_size=32))``, ``ray.get(scheduler.shutdown.remote())``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollpipe.data.proto import DataProto
from rollpipe.engines.protocol import PauseMode, WeightsLike
from rollpipe.nodes.suspension import DEFAULT_MODE
from rollpipe.pipeline import RolloutPipeline

__all__ = ["AsyncRolloutActor"]


class AsyncRolloutActor:
    """``RolloutPipeline``'s ROLL calls as coroutines, for an async Ray actor.

    Takes ``RolloutPipeline``'s arguments (give the engine as a factory and the tokenizer
    as a path: an engine cannot be pickled). The pipeline is ``self.pipeline``.
    """

    def __init__(self, config: Any, engine: Any, tokenizer: Any, **options: Any) -> None:
        self.pipeline = RolloutPipeline(config, engine, tokenizer, **options)

    async def get_batch(
        self, data: DataProto | int | None = None, batch_size: int | None = None
    ) -> DataProto | None:
        return await asyncio.to_thread(self.pipeline.get_batch, data, batch_size)

    async def suspend(self, mode: PauseMode = DEFAULT_MODE, *, hold: bool = False) -> None:
        await asyncio.to_thread(self.pipeline.suspend, mode, hold=hold)

    async def resume(self) -> None:
        await asyncio.to_thread(self.pipeline.resume)

    async def update_weights(self, weights: WeightsLike, version: int | None = None) -> int:
        return await asyncio.to_thread(self.pipeline.update_weights, weights, version)

    async def version(self) -> int:
        """The engine's policy version (a property on the pipeline)."""
        return self.pipeline.version

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.pipeline.shutdown)
