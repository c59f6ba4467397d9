"""rollpipe: rollout-data pipelines for LLM RL on torchdata."""
