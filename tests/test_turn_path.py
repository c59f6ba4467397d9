"""The turn path stays short: the files a text episode's tokens pass through, counted by
running one.

A FrozenLake episode on the real vLLM engine, then its batch row, run under a profiler
that notes every rollpipe file a call enters on the episode's thread (the engine's own
loop thread is its business: what is counted is rollpipe's path from an env observation
to a batch row). The count is the figure the layout review reads; ``MAX_FILES`` holds it
where the one-turn-path redesign left it (29: the review's target is 20, not reached;
docs/changes.md lists the files), so the path cannot grow unnoticed.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.episode import EpisodeSettings, run_episode
from rollpipe.agent.records import EpisodeSpec
from rollpipe.data.rows import trajectory_rows
from rollpipe.engines.records import SamplingParams
from rollpipe.envs import FrozenLake

PACKAGE = str(Path(__file__).resolve().parents[1] / "rollpipe")
MAX_FILES = 29


def files_on_the_path(engine: Any, tokenizer: Any) -> list[str]:
    """The rollpipe files entered, in first-entry order, while one text episode runs on
    ``engine`` and becomes a batch row."""
    chat = ChatFormat(tokenizer)
    settings = EpisodeSettings(sampling=SamplingParams(max_tokens=16), max_turns=3)
    seen: dict[str, None] = {}

    def note(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(PACKAGE):
                seen.setdefault(name[len(PACKAGE) + 1 :], None)

    async def episode_to_row() -> Any:
        spec = EpisodeSpec(0, 0, 3, "frozenlake")
        sys.setprofile(note)
        try:
            traj = await run_episode(spec, FrozenLake(), engine, chat, settings)
            return trajectory_rows([traj], tokenizer.pad_token_id)
        finally:
            sys.setprofile(None)

    batch = asyncio.run(episode_to_row())
    assert batch.batch["input_ids"].shape[0] == 1  # the episode did become a row
    return list(seen)


def test_a_text_episode_path_does_not_grow(vllm_engine: Any, tokenizer: Any) -> None:
    files = files_on_the_path(vllm_engine, tokenizer)
    assert "agent/conversation.py" in files and "envs/frozenlake.py" in files  # it sees them
    assert len(files) <= MAX_FILES, f"{len(files)} files on a text episode's path: {files}"
