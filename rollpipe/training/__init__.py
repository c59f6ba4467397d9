"""Training on rollpipe's batches, kept out of the rollout core's path.

The tiny local model the tests, examples and CLI run on (``tiny_model``, with
``tiny_tools`` and ``_tiny_corpus``), the demo GRPO trainer (``grpo_loop``, behind
``rollpipe train``), the expert policy and the supervised warm start that make the tiny
model play (``expert``, ``sft``, ``warm_start``), held-out evaluation (``evaluate``), and
classic on-policy PPO pieces (``ppo_buffer``: the seed's ``RolloutBuffer``, ``gae``,
``vector_collector``). Nothing in the rollout core imports this package (a layout test
checks it); the CLI, ``rollpipe.RolloutBuffer`` and ``rollpipe.build_tiny_model`` do.
"""
