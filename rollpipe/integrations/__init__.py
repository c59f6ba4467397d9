"""Bridges from rollpipe to other trainers' own code (each needs its extra installed).

* :mod:`rollpipe.integrations.trl`: a ``rollout_func`` for TRL's ``GRPOTrainer`` drawn
  from a ``RolloutPipeline``, keeping the engine's weights equal to the trainer's.
* :mod:`rollpipe.integrations.trl_env`: a class written for TRL's
  ``environment_factory`` as a rollpipe tool env.

See ``docs/trl.md``.
"""
