"""Small private helpers shared across rollpipe: attrs validators, seed derivation."""
