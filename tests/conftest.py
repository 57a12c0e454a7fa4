"""Shared fixtures: the real default model, loaded once per test session where needed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tiny_models helper
# Triton kernels (kvlab.gpu) run on CPU tensors through Triton's interpreter where no CUDA
# device is present; triton reads the setting as a kernel is defined, so it is set before
# any test module imports kvlab
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from kvlab.weights.default_model import default_model_path as path

    return path()


@pytest.fixture(scope="session")
def default_llm(default_model_path):
    from kvlab.llm import LLM

    return LLM(str(default_model_path))
