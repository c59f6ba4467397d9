"""A policy that plays: expert data, the supervised warm start, held-out evaluation."""
