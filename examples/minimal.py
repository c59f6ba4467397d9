"""A rollout pipeline and one batch, in about 20 lines."""

from transformers import AutoTokenizer

from rollpipe import PipelineConfig, RolloutPipeline, VLLMEngine, default_model_path


def main(engine=None):
    path = default_model_path()  # the tiny local model, built once
    tokenizer = AutoTokenizer.from_pretrained(path)
    owned = engine is None
    engine = engine or VLLMEngine(path)
    config = PipelineConfig(envs="frozenlake", group_size=4, batch_size=8, max_turns=3)
    with RolloutPipeline(config, engine, tokenizer, owns_engine=owned) as pipe:
        batch = pipe.get_batch()
    print(batch)
    print({k: round(v, 3) for k, v in batch.meta_info["metrics"].items()})
    return batch


if __name__ == "__main__":
    main()
