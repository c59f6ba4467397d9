"""The agent side of an episode: its records, chat formatting and the episode coroutine."""
