"""A multi-turn verifiers env for the adapter's tests: guess a number from 1 to 8, the
env answering "higher" / "lower" as the user through ``interaction().turn(...)``."""

import verifiers.v1 as vf

__all__ = ["GuessEnv", "GuessTaskset"]

MAX_GUESSES = 4


class GuessData(vf.TaskData):
    secret: int


class GuessTask(vf.Task[GuessData]):
    pass


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        won = 0.0
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            for _ in range(MAX_GUESSES):
                if segment.terminated:
                    break
                words = (segment.last_reply or "").split()
                guess = int(words[-1]) if words and words[-1].isdigit() else None
                if guess == task.data.secret:
                    won = 1.0
                    break
                hint = "higher" if guess is None or guess < task.data.secret else "lower"
                segment = await interaction.turn(hint)
        interaction.trace.record_reward("won", won, 1.0)


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self) -> list[GuessTask]:
        prompt = "Guess my number from 1 to 8. Answer with the number."
        return [GuessTask(GuessData(prompt=prompt, secret=s)) for s in range(1, 9)]
