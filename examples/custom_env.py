"""A user-defined text environment, registered and run through the pipeline.

``GuessNumber``: the agent guesses a hidden number from 1 to 9 and hears "higher" or
"lower". Any object with ``reset(seed)`` and ``step(text)`` returning the usual tuple is
an environment; ``register`` makes it available by name to configs and the CLI.
"""

from __future__ import annotations

import random

from transformers import AutoTokenizer

from rollpipe import PipelineConfig, RolloutPipeline, VLLMEngine, default_model_path
from rollpipe.envs import parse_answer, register


class GuessNumber:
    """Guess a number in 1..9; reward 1 when found. Answers go in <answer>N</answer>."""

    def __init__(self, max_steps: int = 4) -> None:
        self.max_steps = max_steps

    def reset(self, seed: int):
        self.target = random.Random(seed).randint(1, 9)  # seeded: same seed, same game
        self.steps = 0
        return "Guess my number from 1 to 9. Answer like <answer>5</answer>.", self._info(
            None, True
        )

    def step(self, action_text: str):
        self.steps += 1
        answer = parse_answer(action_text)
        guess = int(answer) if answer is not None and answer.strip().isdigit() else None
        truncated = self.steps >= self.max_steps
        if guess is None or not 1 <= guess <= 9:
            return "Answer with a digit 1-9.", -0.1, False, truncated, self._info(None, False)
        if guess == self.target:
            return "Correct!", 1.0, True, False, self._info(guess, True, success=True)
        hint = "higher" if guess < self.target else "lower"
        return f"{guess} is wrong, go {hint}.", 0.0, False, truncated, self._info(guess, True)

    def close(self) -> None:
        pass

    @staticmethod
    def _info(action, valid, success=False):
        return {
            "action": action,
            "action_valid": valid,
            "success": success,
            "format_penalty_applied": not valid,
        }


register("guess_number", GuessNumber, overwrite=True)


def main(engine=None):
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    owned = engine is None
    engine = engine or VLLMEngine(path)
    config = PipelineConfig(
        envs=[{"name": "guess_number", "config": {"max_steps": 3}}],
        group_size=2,
        batch_size=4,
        max_turns=3,
        sampling={"max_tokens": 16},
    )
    with RolloutPipeline(config, engine, tokenizer, owns_engine=owned) as pipe:
        batch = pipe.get_batch()
    print(batch.non_tensor_batch["tags"], batch.batch["episode_scores"])
    return batch


if __name__ == "__main__":
    main()
