"""Text <-> token ids: GGUF and Hugging Face tokenizers, streaming detokenization, chat prompts.

Public API (docs/CONTRACTS.md, section tokenizer):
    Tokenizer, load_gguf_tokenizer(metadata), load_hf_tokenizer(model_dir),
    IncrementalDetokenizer(tokenizer, skip_special_tokens=True), TokenTexts(tokenizer) (the
    tokens' own texts, for streaming many requests), FimTokens (Tokenizer.fim)
"""

from kvlab.tokenizer.detok import IncrementalDetokenizer, TokenTexts
from kvlab.tokenizer.fim import FimTokens
from kvlab.tokenizer.from_gguf import load_gguf_tokenizer
from kvlab.tokenizer.from_hf import load_hf_tokenizer
from kvlab.tokenizer.tokenizer import Tokenizer

__all__ = ["FimTokens", "IncrementalDetokenizer", "TokenTexts", "Tokenizer",
           "load_gguf_tokenizer", "load_hf_tokenizer"]
