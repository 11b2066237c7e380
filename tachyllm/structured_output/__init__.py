"""Structured outputs: llguidance grammars that mask each constrained sequence's logits step by step
(docs/structured_outputs.md). `compiler.GrammarCompiler` turns a request's StructuredOutputsParams into
a compiled grammar (cached); each sequence runs its own `grammar.Grammar` over it."""
