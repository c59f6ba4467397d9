"""Classic on-policy RL: a preallocated rollout buffer, GAE and a vector-env collector."""
