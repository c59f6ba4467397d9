"""The GRPO loop written as a ROLL user writes it: get_batch, suspend, update, resume.

ROLL's agentic pipeline asks its RolloutScheduler for ``get_batch(data, batch_size)``,
suspends rollout while the actor trains and the weights are broadcast, then resumes.
rollpipe's ``RolloutPipeline`` has the same verbs.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollpipe import PipelineConfig, RolloutPipeline, VLLMEngine, default_model_path
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
            batch = scheduler.get_batch(batch_size)  # blocks until the batch is filled
            batch.meta_info["global_step"] = global_step
            scheduler.suspend()  # rollout stops admitting work; in-flight requests freeze
            advantages = group_advantages(
                batch.batch["scores"].sum(-1), batch.batch["traj_group_id"]
            )
            loss = policy_loss(token_logprobs(actor, batch), batch, advantages)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.update_weights(actor)  # model_update: actor -> inference engine
            scheduler.resume()
            rewards.append(batch.meta_info["metrics"]["episode_score/mean"])
            print(
                f"global_step {global_step}: score {rewards[-1]:+.3f}, "
                f"policy version {scheduler.version}"
            )
    finally:
        scheduler.close()
    return rewards


if __name__ == "__main__":
    main()
