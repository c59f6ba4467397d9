"""Adapters that run environments of other ecosystems as rollpipe text envs.

One module per ecosystem: :mod:`~rollpipe.envs.adapters.gem` (``gem-llm``),
:mod:`~rollpipe.envs.adapters.reasoning_gym`, :mod:`~rollpipe.envs.adapters.textarena`
and :mod:`~rollpipe.envs.adapters.openenv` (``openenv-core``). Each speaks the
``TextEnv`` / ``AsyncTextEnv`` protocol and is named in a config by import path, e.g.
``"rollpipe.envs.adapters.gem:GemEnv"``. The ecosystem's package is imported when an
adapter is built, never when rollpipe is imported: install it with the extra of the same
name (``pip install 'rollpipe[gem]'``). ``docs/environments.md`` ("Ecosystems") maps
each one's observation, action, reward, done and metrics.
"""
