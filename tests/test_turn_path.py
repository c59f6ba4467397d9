"""The turn path stays short: the files a text episode's tokens pass through, counted by
running one.

A FrozenLake episode on the real vLLM engine, then its batch row, run under a profiler
that notes every rollpipe file a call enters on the episode's thread (the engine's own
loop thread is its business: what is counted is rollpipe's path from an env observation
to a batch row). The count is the figure the layout review reads; its target is 20.

Two counts are held. ``MAX_FILES``: rollpipe's own path from the env's observation to the
row (the episode, the conversation, the engine request, the records, the row): 20, down
from 26 on the same basis before the one-turn-path work (29 with the env). The env's own
files (``envs/``: FrozenLake, its base class, its answer parsing) are the env's business
and stand for whatever env a user brings; they are counted apart (``ENV_FILES``), so the
whole count is 23.
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
MAX_FILES = 20
ENV_FILES = {"envs/frozenlake.py", "envs/base.py", "envs/parsing.py"}
"""FrozenLake's own files: the env under test, not rollpipe's path."""


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
    env_files = {f for f in files if f.startswith("envs/")}
    assert env_files == ENV_FILES, f"the env's files: {sorted(env_files)}"
    path = [f for f in files if f not in env_files]
    assert len(path) <= MAX_FILES, f"{len(path)} files on a text episode's path: {path}"
