"""Small private helpers shared across rollpipe: argument checks, seed derivation, freeze."""
