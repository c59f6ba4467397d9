"""Small builders of trajectory records for tests about assembly, batching and metrics.

The records are real ``rollpipe.agent.records`` objects; only their token content is
made up, because those tests are about what happens to records, not how they were
generated (tests of generation use the real engines).
"""

from __future__ import annotations

from rollpipe.agent.records import EpisodeSpec, Trajectory, Turn


def make_trajectory(
    group_id: int,
    episode_id: int,
    score: float = 1.0,
    *,
    end_reason: str = "terminated",
    version: int = 0,
    response_len: int = 3,
    prompt_len: int = 4,
) -> Trajectory:
    turn = Turn(
        prompt_ids=list(range(10, 10 + prompt_len)),
        response_ids=list(range(50, 50 + response_len)),
        logprobs=[-0.5] * response_len,
        versions=[version] * response_len,
        reward=score,
        finish_reason="stop",
        action_valid=True,
        action_text="<answer>Left</answer>",
        observation="obs",
    )
    return Trajectory(
        spec=EpisodeSpec(group_id=group_id, episode_id=episode_id, seed=group_id),
        env_id=0,
        turns=(turn,),
        score=score,
        success=score > 0,
        end_reason=end_reason,
        error="boom" if end_reason == "error" else None,
    )
