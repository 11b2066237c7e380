"""Evaluation tools: `tachy eval quality` (quantized configuration vs unquantized reference)."""
