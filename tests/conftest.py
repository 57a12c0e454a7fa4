"""Shared fixtures: the real default model, loaded once per test session where needed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tiny_models helper


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from kvlab.weights.default_model import default_model_path as path

    return path()


@pytest.fixture(scope="session")
def default_llm(default_model_path):
    from kvlab.llm import LLM

    return LLM(str(default_model_path))
