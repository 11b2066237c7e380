"""load_checkpoint(path) -> Checkpoint: config, tokenizer and a lazy weight stream from a GGUF file or
a Hugging Face directory, with every failure reported as one ModelLoadError line naming the path.
A GGUF file's parsed and dequantized contents are cached on disk (cache.py; TACHY_CACHE_DIR)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from gguf import GGUFReader, ReaderTensor

from tachyllm.errors import ModelLoadError, TachyError
from tachyllm.loading import cache
from tachyllm.loading.default_model import default_model_path
from tachyllm.loading.gguf import load_gguf, raw_tensors
from tachyllm.loading.hf import load_hf
from tachyllm.loading.hf_quantized import PrequantizedWeights
from tachyllm.loading.tokenizer import Tokenizer
from tachyllm.loading.weights import Select, WeightSource
from tachyllm.model_config import ModelConfig

__all__ = ["Checkpoint", "Tokenizer", "default_model_path", "load_checkpoint", "load_tokenizer"]

logger = logging.getLogger("tachyllm")

_GGUF_MAGIC = b"GGUF"


@dataclass
class Checkpoint:
    config: ModelConfig
    tokenizer: Tokenizer
    # Each call starts a fresh pass; tensors are read (and dequantized) one at a time, with
    # canonical HF names and nn.Linear [out, in] shapes. lm_head.weight is absent when tied.
    # weights(select): only each tensor's selected part (loading/weights.py).
    weights: WeightSource
    source: str
    format: Literal["gguf", "hf"]
    # A pre-quantized HF checkpoint's packed linears (its weights() yields them dequantized).
    prequantized: PrequantizedWeights | None = None
    # A GGUF file's tensors as stored, (HF name, tensor), when loading parsed the file (not on a cache
    # hit): the layers kept on the file's blocks read them without parsing its metadata again.
    stored_tensors: list[tuple[str, ReaderTensor]] | None = field(default=None, repr=False, compare=False)


def load_checkpoint(path: str | None) -> Checkpoint:
    """Open a model: None = the embedded default, a .gguf file, or a directory with config.json."""
    source = default_model_path() if path is None else str(path)
    location = Path(source)
    if not location.exists():
        raise ModelLoadError(f"model path does not exist: {source}")
    try:
        if location.is_dir():
            return _load_hf(location, source)
        if location.suffix.lower() == ".gguf" or _has_gguf_magic(location):
            return _load_gguf(source)
    except TachyError as exc:  # our own message (ConfigError included) already names the problem
        raise ModelLoadError(f"cannot load {source}: {exc}") from exc
    except Exception as exc:
        # Parsers fail with struct/Key/Value errors on damaged files; callers get one readable line.
        raise ModelLoadError(f"cannot load {source}: corrupt or unreadable ({_one_line(exc)})") from exc
    raise ModelLoadError(f"cannot load {source}: not a GGUF file or a Hugging Face model directory")


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer alone (--tokenizer): a Hugging Face directory's tokenizer.json, or a GGUF file's vocabulary."""
    location = Path(path)
    if not location.exists():
        raise ModelLoadError(f"tokenizer path does not exist: {path}")
    try:
        if location.is_dir():
            return Tokenizer.from_hf_dir(location)
        if location.suffix.lower() == ".gguf" or _has_gguf_magic(location):
            return Tokenizer.from_gguf(GGUFReader(path))
    except TachyError as exc:
        raise ModelLoadError(f"cannot load the tokenizer {path}: {exc}") from exc
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer {path}: corrupt or unreadable ({_one_line(exc)})") from exc
    raise ModelLoadError(f"cannot load the tokenizer {path}: not a GGUF file or a Hugging Face tokenizer directory")


def _load_gguf(source: str) -> Checkpoint:
    # A hit skips GGUF parsing and dequantization (seconds); see tachyllm/loading/cache.py.
    try:
        entry = cache.CacheEntry.for_source(source)
    except OSError:
        entry = None
    cached = cache.load(entry) if entry is not None else None
    if entry is not None and cached is not None:
        logger.info("checkpoint cache: loaded %s from %s", source, entry.path)
        return Checkpoint(cached.config, cached.tokenizer, _guarded(cached.weights, source), source, "gguf")
    reader, config, weights = load_gguf(source)
    tokenizer = Tokenizer.from_gguf(reader)
    # Only the tensor table is kept: the reader's parsed vocabulary is freed with it.
    stored = list(raw_tensors(reader))
    if entry is not None:
        shapes = [(name, tuple(int(d) for d in reversed(t.shape.tolist()))) for name, t in stored]
        weights = cache.caching_weights(entry, weights, shapes, config, tokenizer)
    return Checkpoint(config, tokenizer, _guarded(weights, source), source, "gguf", stored_tensors=stored)


def _load_hf(directory: Path, source: str) -> Checkpoint:
    config, weights, packed = load_hf(directory)
    return Checkpoint(config, Tokenizer.from_hf_dir(directory), _guarded(weights, source), source, "hf", packed)


def _guarded(weights: WeightSource, source: str) -> WeightSource:
    """Reading happens later, while the model is built; a damaged tensor must still say which file."""

    def read(
        select: Select | None = None, leave_out: frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            yield from weights(select, leave_out)
        except Exception as exc:
            raise ModelLoadError(f"cannot read weights from {source}: {_one_line(exc)}") from exc

    return read


def _one_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _has_gguf_magic(location: Path) -> bool:
    with location.open("rb") as handle:
        return handle.read(4) == _GGUF_MAGIC
