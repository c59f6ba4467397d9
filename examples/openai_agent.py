"""An ``openai``-client agent trained through the pipeline: it answers the lookup task with
the ``lookup`` tool, played by the shipped lookup warm start.

The agent is ``rollpipe.training.lookup_agent.lookup_agent``: plain ``openai`` code (read
it there; docs/agents.md writes the same agent out), which sends what the lookup ToolEnv
shows the model (its system prompt, its question, the tool's schema), the conversation
the warm start was trained on, so the model's calls are well formed.
``rollpipe train --env lookup-agent`` trains it. Run: ``python examples/openai_agent.py``.
"""

from rollpipe import EpisodeSettings, PipelineConfig, RolloutPipeline, VLLMEngine
from rollpipe.envs import register
from rollpipe.training.lookup_agent import lookup_agent_env
from rollpipe.training.tool_warm_start import LOOKUP_RECIPE, tool_warm_start_model_path


def main(engine=None, batch_size=256):
    register("openai-lookup-agent", lookup_agent_env, overwrite=True)
    path = tool_warm_start_model_path(LOOKUP_RECIPE)  # shipped in the package: nothing to build
    owned = engine is None
    engine = engine or VLLMEngine(path)
    episode = EpisodeSettings(tool_parser="hermes", sampling={"max_tokens": 48})
    config = PipelineConfig(
        envs="openai-lookup-agent", episode=episode, group_size=4, batch_size=batch_size
    )
    with RolloutPipeline(config, engine, path, owns_engine=owned) as pipe:
        batch = pipe.get_batch()
    metrics = batch.meta_info["metrics"]
    for key in ("tool/calls", "tool/malformed", "success_rate", "episode_score/mean"):
        print(f"{key}: {metrics[key]:g}")
    return batch


if __name__ == "__main__":
    main()
