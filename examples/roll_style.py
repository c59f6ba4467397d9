"""The GRPO loop written as a ROLL user writes it: suspend, model update, get_batch.

ROLL's agentic pipeline suspends its RolloutScheduler (abort in-flight requests), updates
the inference weights, then asks for ``get_batch(data, batch_size)``, which resumes
rollout; ``shutdown()`` ends it. rollpipe's ``RolloutPipeline`` takes the same calls, and
is on-policy by default as ROLL is (``async_generation_ratio=0``).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollpipe import DataProto, PipelineConfig, RolloutPipeline, VLLMEngine, default_model_path
from rollpipe.grpo import group_advantages, policy_loss, token_logprobs


def main(steps: int = 5, batch_size: int = 8, engine=None) -> list[float]:
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    actor = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    optimizer = torch.optim.AdamW(actor.parameters(), lr=3e-4)
    owned = engine is None
    engine = engine or VLLMEngine(path)
    scheduler = RolloutPipeline(
        PipelineConfig(
            envs="frozenlake",
            group_size=4,
            batch_size=batch_size,
            max_turns=2,
            sampling={"max_tokens": 24},
        ),
        engine,
        tokenizer,
        owns_engine=owned,
    )
    rewards = []
    try:
        for global_step in range(steps):
            scheduler.suspend()  # abort in-flight requests; admit nothing new
            scheduler.update_weights(actor)  # model_update: actor -> inference engine
            data = DataProto(meta_info={"global_step": global_step})
            batch = scheduler.get_batch(data, batch_size)  # resumes; blocks until filled
            advantages = group_advantages(
                batch.batch["scores"].sum(-1), batch.batch["traj_group_id"]
            )
            loss = policy_loss(token_logprobs(actor, batch), batch, advantages)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            rewards.append(batch.meta_info["metrics"]["episode_score/mean"])
            print(
                f"global_step {global_step}: score {rewards[-1]:+.3f}, "
                f"policy version {scheduler.version}"
            )
    finally:
        scheduler.shutdown()
    return rewards


if __name__ == "__main__":
    main()
