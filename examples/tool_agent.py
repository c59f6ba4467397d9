"""A tool-calling agent that works on the first run: the calculator ToolEnv played by the
shipped tools warm start (it calls ``calculate``, reads the result, answers).

Prints the batch's tool metrics and its best episode as text.
Run: ``python examples/tool_agent.py``.
"""

from transformers import AutoTokenizer

from rollpipe import EpisodeSettings, PipelineConfig, RolloutPipeline, VLLMEngine
from rollpipe.data.readable import show_row
from rollpipe.training.tool_warm_start import tool_warm_start_model_path


def main(engine=None, batch_size=256):
    path = tool_warm_start_model_path()  # shipped in the package: nothing to build
    tokenizer = AutoTokenizer.from_pretrained(path)
    owned = engine is None
    engine = engine or VLLMEngine(path)
    config = PipelineConfig(
        envs=[{"name": "calculator", "config": {"digits": 1}}],  # the digits it learned
        episode=EpisodeSettings(tool_parser="hermes", max_turns=4, sampling={"max_tokens": 48}),
        group_size=4,
        batch_size=batch_size,
    )
    with RolloutPipeline(config, engine, tokenizer, owns_engine=owned) as pipe:
        batch = pipe.get_batch()
    metrics = batch.meta_info["metrics"]
    for key in ("tool/calls", "tool/malformed", "success_rate", "turns/mean"):
        print(f"{key}: {metrics[key]:g}")
    best = int(batch.batch["episode_scores"].argmax())
    print(show_row(batch, best, tokenizer))  # what the model wrote is [[marked]]
    return batch


if __name__ == "__main__":
    main()
