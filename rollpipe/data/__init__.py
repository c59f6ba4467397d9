"""Batches: DataProto, padding kernels, token-exact rows, batch metrics, readable views."""
