"""Speculative decoding: proposers (n-gram prompt lookup, a draft model), lossless verification
inside the continuous batch (rejection.py), and the adaptive switch that decides when it pays."""
