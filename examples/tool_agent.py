"""A tool-calling agent that works on the first run: the lookup ToolEnv played by the
shipped lookup warm start (it calls ``lookup``, reads the digit, answers; in about 6
episodes of 10 it answers without looking, which ``rollpipe train --env lookup`` unlearns).

Prints the batch's tool metrics and its best episode as text.
Run: ``python examples/tool_agent.py``.
"""

from transformers import AutoTokenizer

from rollpipe import EpisodeSettings, PipelineConfig, RolloutPipeline, VLLMEngine
from rollpipe.data.readable import show_row
from rollpipe.training.tool_warm_start import LOOKUP_RECIPE, tool_warm_start_model_path


def main(engine=None, batch_size=256):
    path = tool_warm_start_model_path(LOOKUP_RECIPE)  # shipped in the package: nothing to build
    tokenizer = AutoTokenizer.from_pretrained(path)
    owned = engine is None
    engine = engine or VLLMEngine(path)
    config = PipelineConfig(
        envs="lookup",  # the answer is in a drawer only the lookup tool opens
        episode=EpisodeSettings(tool_parser="hermes", max_turns=4, sampling={"max_tokens": 48}),
        group_size=4,
        batch_size=batch_size,
    )
    with RolloutPipeline(config, engine, tokenizer, owns_engine=owned) as pipe:
        batch = pipe.get_batch()
    metrics = batch.meta_info["metrics"]
    for key in ("tool/calls", "tool/malformed", "success_rate", "turns/mean"):
        print(f"{key}: {metrics[key]:g}")
    shown = [show_row(batch, i, tokenizer) for i in range(len(batch))]
    won = [text for i, text in enumerate(shown) if batch.batch["episode_scores"][i] > 0]
    called = [text for text in won if "<tool_call>" in text]
    print((called or won or shown)[0])  # a won episode that called; the model's text [[marked]]
    return batch


if __name__ == "__main__":
    main()
