"""Structured outputs: JSON schemas, regular expressions, choices and grammars enforced while
decoding.

    compiler   Structure -> llguidance grammar -> validated template (cached by its text,
               compiled on a worker thread so a slow one never stalls a step)
    vocab      the model's vocabulary as llguidance sees it (built once, on first use)
    outputs    the engine's seam: one matcher per constrained sequence; each step a bitmask
               row per sampled sequence, then the sampled token, then the forced tokens
    gate       a thinking model's reasoning block: free, its end forced at a budget; the
               structure starts after it

llguidance (the grammar engine vLLM and llama.cpp also use) does the grammar work: it compiles
a schema in about a millisecond on a 262k vocabulary, fills a token mask in tens of
microseconds, and refuses schema keywords it cannot enforce instead of ignoring them.
"""

from kvlab.structured.compiler import GrammarCompiler, Template
from kvlab.structured.outputs import StructuredOutputs

__all__ = ["GrammarCompiler", "StructuredOutputs", "Template"]
