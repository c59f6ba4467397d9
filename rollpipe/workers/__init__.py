"""Episode workers: the episode loop in worker processes (Ray actors), off the driver.

``RunnerSettings.episode_workers = N`` (``PipelineConfig(rollout={"episode_workers": N})``)
runs every episode — env calls, chat rendering, tokenization, tool calls, agents with
their clients and front door — in N worker processes, each with its own loop; the driver
keeps admission, routing, group assembly, collation and checkpoints, and makes every
engine request. See docs/episode-workers.md.
"""

from rollpipe.workers.driver_engine import DriverEngine
from rollpipe.workers.episode_workers import DEFAULT_MAX_RERUNS, EpisodeWorkers, WorkerLostError
from rollpipe.workers.worker import ENV_IDS_PER_WORKER, EpisodeWorker

__all__ = [
    "DEFAULT_MAX_RERUNS",
    "ENV_IDS_PER_WORKER",
    "DriverEngine",
    "EpisodeWorker",
    "EpisodeWorkers",
    "WorkerLostError",
]
