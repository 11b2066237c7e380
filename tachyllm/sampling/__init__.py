"""Token sampling and lossless verification of speculative draft tokens."""
