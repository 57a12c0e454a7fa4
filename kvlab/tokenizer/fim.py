"""Fill-in-the-middle tokens: which ids mark the prefix, the suffix and the middle of a code
model's infill prompt (and, where the model has them, the pad, repository and file-separator
ids of repository-level prompts).

A GGUF names them in `tokenizer.ggml.fim_{pre,suf,mid,pad,rep,sep}_token_id` (older files:
`tokenizer.ggml.{prefix,suffix,middle}_token_id`). A file without those keys, and every
Hugging Face tokenizer, is recognised by its tokens' text, with the same table llama.cpp's
vocabulary loader uses, so a model completes code here exactly where it does there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# role -> the token texts that play it, in the families that use them
FIM_TOKEN_TEXTS: dict[str, tuple[str, ...]] = {
    "prefix": ("<|fim_prefix|>",  # Qwen2.5-Coder
               "<fim-prefix>",
               "<fim_prefix>",  # StarCoder, Granite
               "<｜fim▁begin｜>",  # DeepSeek-Coder
               "<PRE>", "▁<PRE>",  # CodeLlama
               "<|code_prefix|>"),  # GLM-4.5
    "suffix": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>",
               "<SUF>", "▁<SUF>", "<|code_suffix|>"),
    "middle": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>",
               "<MID>", "▁<MID>", "<|code_middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "repo": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "file_sep": ("<|file_sep|>",),
}

# role -> its GGUF keys, the current one first
GGUF_KEYS: dict[str, tuple[str, ...]] = {
    "prefix": ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
    "suffix": ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
    "middle": ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"),
    "pad": ("tokenizer.ggml.fim_pad_token_id",),
    "repo": ("tokenizer.ggml.fim_rep_token_id",),
    "file_sep": ("tokenizer.ggml.fim_sep_token_id",),
}


@dataclass(frozen=True)
class FimTokens:
    """The ids of a model's fill-in-the-middle markers."""

    prefix: int
    suffix: int
    middle: int
    pad: int | None = None
    repo: int | None = None
    file_sep: int | None = None

    @property
    def end_ids(self) -> tuple[int, ...]:
        """Markers that end a generated middle (llama.cpp counts them end-of-generation):
        a model that writes one has finished the hole and started a new part."""
        return tuple(i for i in (self.pad, self.repo, self.file_sep) if i is not None)


def find_fim_tokens(token_to_id: Mapping[str, int], vocab_size: int,
                    metadata: Mapping[str, Any] | None = None) -> FimTokens | None:
    """The model's FIM tokens, from GGUF keys where given, else by their text; None unless
    the prefix, suffix and middle markers are all found."""
    found = {role: _from_keys(metadata or {}, keys, vocab_size)
             for role, keys in GGUF_KEYS.items()}
    for role, texts in FIM_TOKEN_TEXTS.items():
        if found[role] is None:
            found[role] = next((token_to_id[t] for t in texts if t in token_to_id), None)
    if found["prefix"] is None or found["suffix"] is None or found["middle"] is None:
        return None
    return FimTokens(**found)


def _from_keys(metadata: Mapping[str, Any], keys: tuple[str, ...],
               vocab_size: int) -> int | None:
    for key in keys:
        value = metadata.get(key)
        if isinstance(value, int) and 0 <= value < vocab_size:
            return value
    return None
