"""On-disk cache of loaded GGUF checkpoints, so a second start skips parsing and dequantizing.

Parsing a GGUF file's metadata (GGUFReader) and dequantizing its tensors take seconds; the result
is a ModelConfig, a Tokenizer and float32 weights, which are stored here as one safetensors file:
the weights as tensors (read back memory-mapped) and the config and tokenizer (tokenizers JSON,
special tokens, chat template) as JSON in the file's metadata.

- Location: $TACHY_CACHE_DIR, else $XDG_CACHE_HOME/tachyllm, else ~/.cache/tachyllm.
  TACHY_CACHE_DIR=off (or 0, false, no, none) disables the cache.
- Key: the GGUF file's resolved path, size and mtime_ns, CACHE_FORMAT_VERSION and a hash of the
  loader's source (so a fix in the GGUF loader or tokenizer rebuild never serves stale results).
  A changed file gets a new entry; the entry for the old version of the same path is removed.
- Writing happens during the first pass over the weights (the model load), tensor by tensor into
  a temporary file in the cache directory that is renamed into place once complete, so no reader
  ever sees a partial entry and no extra copy of the weights is held in memory.
  A pass that leaves tensors out (`--quantization gguf` reads the matrices it runs packed from the
  file's own blocks) writes nothing: most of the entry's bytes would be dequantized copies of those.
- Anything wrong with an entry (unreadable, truncated, wrong key or layout) makes it a miss: it is
  deleted and rebuilt. Failing to write (read-only or full disk) only logs a warning.

A float32 entry takes 4 bytes per parameter (~540 MB for SmolLM2-135M). The same directory holds
gguf's load-time activation checks (activation_checks/, quantization/activation_bits.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from tachyllm.loading.tokenizer import Tokenizer
from tachyllm.loading.weights import Select, WeightSource, read_part, select_part
from tachyllm.model_config import ModelConfig

logger = logging.getLogger("tachyllm")

# Bump when the entry layout or the meaning of its contents changes.
CACHE_FORMAT_VERSION = 1
ENV_VAR = "TACHY_CACHE_DIR"
_OFF = {"off", "0", "false", "no", "none", "disable", "disabled"}
# Loader sources whose content decides what a GGUF file loads as.
_LOADER_SOURCES = ("gguf.py", "tokenizer.py", "cache.py")
_ENTRY_SUFFIX = ".safetensors"
_TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 3600  # a temporary file this old belongs to a writer that died
_ALIGN = 8  # safetensors pads its header so that tensor data starts 8-byte aligned


def cache_dir() -> Path | None:
    """Where entries live, or None when the cache is disabled."""
    value = os.environ.get(ENV_VAR, "").strip()
    if value.lower() in _OFF:
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base) if base else Path.home() / ".cache") / "tachyllm"


@dataclass(frozen=True)
class CacheEntry:
    """The cache file a GGUF source maps to, and the key stored inside it."""

    path: Path
    key: str

    @classmethod
    def for_source(cls, source: str) -> CacheEntry | None:
        directory = cache_dir()
        if directory is None:
            return None
        real = os.path.realpath(source)
        stat = os.stat(real)
        key = json.dumps(
            {
                "format": CACHE_FORMAT_VERSION,
                "loader": _loader_fingerprint(),
                "path": real,
                "size": stat.st_size,
                "mtime_ns": stat.st_mtime_ns,
            },
            sort_keys=True,
        )
        stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(real).stem)[:80]
        # The path hash groups every version of one file (for pruning); the key hash picks one.
        name = f"{stem}-{short_digest(real)}-{short_digest(key)}{_ENTRY_SUFFIX}"
        return cls(directory / name, key)

    @property
    def family_prefix(self) -> str:
        """File-name prefix shared by the entries of every version of the same source path."""
        return self.path.name.rsplit("-", 1)[0] + "-"


@dataclass
class CachedCheckpoint:
    config: ModelConfig
    tokenizer: Tokenizer
    weights: WeightSource


def load(entry: CacheEntry) -> CachedCheckpoint | None:
    """The cached checkpoint, or None on a miss; a damaged or mismatching entry is deleted."""
    if not entry.path.is_file():
        return None
    try:
        return _read(entry)
    except Exception as exc:  # noqa: BLE001 -- whatever is wrong with an entry, rebuilding fixes it
        logger.warning("checkpoint cache: ignoring unusable entry %s (%s); rebuilding it", entry.path, _one_line(exc))
        _unlink(entry.path)
        return None


def caching_weights(
    entry: CacheEntry,
    weights: WeightSource,
    shapes: list[tuple[str, tuple[int, ...]]],
    config: ModelConfig,
    tokenizer: Tokenizer,
) -> WeightSource:
    """Wraps `weights` so that its first complete pass also writes the entry.

    `shapes` lists every (name, shape) the pass yields (all float32). Later passes read the entry
    back when it was written, else dequantize again.
    """
    state = {"started": False, "written": False}

    def read(
        select: Select | None = None, leave_out: frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if state["written"]:
            cached = load(entry)
            if cached is not None:
                yield from cached.weights(select, leave_out)
                return
            state["written"] = False  # the entry vanished or broke since; the GGUF file still works
        if state["started"] or leave_out:  # a pass that leaves tensors out cannot write the whole entry
            yield from weights(select, leave_out)
            return
        state["started"] = True
        writer = _Writer.open(entry, shapes, _metadata(entry, config, tokenizer, [n for n, _ in shapes]))
        try:
            for name, tensor in weights():
                if writer is not None and not writer.add(name, tensor):
                    writer.abort()
                    writer = None
                yield name, select_part(select, name, tensor)  # the entry holds whole tensors
            if writer is not None:
                state["written"] = writer.commit()
                writer = None
        finally:
            if writer is not None:  # the pass stopped early (an error, or the consumer gave up)
                writer.abort()
                state["started"] = False  # a later complete pass may still write the entry

    return read


# -- reading ---------------------------------------------------------------------------------------


def _read(entry: CacheEntry) -> CachedCheckpoint:
    from safetensors import safe_open

    handle = safe_open(str(entry.path), framework="pt")  # validates the header against the file size
    meta = handle.metadata() or {}
    if meta.get("tachyllm.key") != entry.key:
        raise ValueError("the entry's key does not match its file name")
    names = json.loads(meta["tachyllm.tensors"])
    if sorted(names) != sorted(handle.keys()):
        raise ValueError("the tensor list does not match the stored tensors")
    config = _config_from_json(meta["tachyllm.config"])
    tokenizer = Tokenizer.from_state(json.loads(meta["tachyllm.tokenizer"]))

    def weights(
        select: Select | None = None, leave_out: frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        # Memory-mapped, copy-on-write: reading costs no copy, writing never reaches the file.
        for name in names:
            if name not in leave_out:
                yield name, read_part(handle, name, select)

    return CachedCheckpoint(config, tokenizer, weights)


def _config_to_json(config: ModelConfig) -> str:
    data = asdict(config)
    data["checkpoint_dtype"] = str(config.checkpoint_dtype).removeprefix("torch.")
    return json.dumps(data)


def _config_from_json(text: str) -> ModelConfig:
    data = json.loads(text)
    expected = {f.name for f in fields(ModelConfig)}
    if set(data) != expected:
        raise ValueError(f"stored config fields differ from ModelConfig's ({sorted(set(data) ^ expected)})")
    dtype = getattr(torch, data["checkpoint_dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"bad checkpoint_dtype {data['checkpoint_dtype']!r}")
    data["checkpoint_dtype"] = dtype
    return ModelConfig(**data)


def _metadata(entry: CacheEntry, config: ModelConfig, tokenizer: Tokenizer, names: list[str]) -> dict[str, str]:
    return {
        "format": "pt",
        "tachyllm.key": entry.key,
        "tachyllm.config": _config_to_json(config),
        "tachyllm.tokenizer": json.dumps(tokenizer.to_state()),
        "tachyllm.tensors": json.dumps(names),
    }


# -- writing ---------------------------------------------------------------------------------------


class _Writer:
    """Streams float32 tensors into a safetensors file whose header is laid out in advance."""

    def __init__(
        self, entry: CacheEntry, file, tmp: Path, offsets: dict[str, tuple[int, int, tuple[int, ...]]], data_start: int
    ):
        self.entry, self.file, self.tmp = entry, file, tmp
        self.offsets, self.data_start = offsets, data_start
        self.pending = set(offsets)
        self.started = time.perf_counter()

    @classmethod
    def open(
        cls, entry: CacheEntry, shapes: list[tuple[str, tuple[int, ...]]], metadata: dict[str, str]
    ) -> _Writer | None:
        if sys.byteorder != "little":  # safetensors stores little-endian data
            return None
        header: dict[str, Any] = {"__metadata__": metadata}
        offsets, position = {}, 0
        for name, shape in shapes:
            size = 4 * _numel(shape)
            header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [position, position + size]}
            offsets[name] = (position, size, tuple(shape))
            position += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-(8 + len(blob)) % _ALIGN)
        tmp = None
        try:
            entry.path.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale_tmp(entry.path.parent)
            fd, tmp = tempfile.mkstemp(dir=entry.path.parent, prefix=_TMP_PREFIX, suffix=_ENTRY_SUFFIX)
            file = os.fdopen(fd, "wb")
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache directory's entries
            file.write(struct.pack("<Q", len(blob)))
            file.write(blob)
        except OSError as exc:
            logger.warning(
                "checkpoint cache: cannot write to %s (%s); set %s=off to silence", entry.path.parent, exc, ENV_VAR
            )
            if tmp is not None:
                _unlink(Path(tmp))
            return None
        return cls(entry, file, Path(tmp), offsets, 8 + len(blob))

    def add(self, name: str, tensor: torch.Tensor) -> bool:
        """Writes one tensor; False when it does not fit the planned layout or the write failed."""
        planned = self.offsets.get(name)
        if (
            planned is None
            or name not in self.pending
            or tensor.dtype != torch.float32
            or tuple(tensor.shape) != planned[2]
        ):
            logger.debug("checkpoint cache: %s does not match the planned layout; not caching", name)
            return False
        try:
            self.file.seek(self.data_start + planned[0])
            data = tensor.detach().contiguous().numpy()
            self.file.write(memoryview(data).cast("B"))  # type: ignore[arg-type]  # numpy types __buffer__ from 3.12
        except (OSError, RuntimeError, ValueError) as exc:  # e.g. a full disk
            logger.warning("checkpoint cache: writing %s failed (%s)", self.tmp, exc)
            return False
        self.pending.discard(name)
        return True

    def commit(self) -> bool:
        if self.pending:
            logger.debug("checkpoint cache: %d planned tensors never came; not caching", len(self.pending))
            self.abort()
            return False
        try:
            self.file.flush()
            os.fsync(self.file.fileno())  # the data must be on disk before the name is
            self.file.close()
            os.replace(self.tmp, self.entry.path)
        except OSError as exc:
            logger.warning("checkpoint cache: cannot finish %s (%s)", self.entry.path, exc)
            self.abort()
            return False
        size = self.data_start + sum(size for _, size, _ in self.offsets.values())
        logger.info(
            "checkpoint cache: wrote %s (%.0f MiB, %.1f s); later starts load it instead of parsing the GGUF",
            self.entry.path, size / 2**20, time.perf_counter() - self.started,
        )  # fmt: skip
        # Entries for earlier versions of the same file can never be hit again.
        for other in self.entry.path.parent.glob(self.entry.family_prefix + "*" + _ENTRY_SUFFIX):
            if other != self.entry.path:
                _unlink(other)
        return True

    def abort(self) -> None:
        try:
            self.file.close()
        except OSError:
            pass
        _unlink(self.tmp)


# -- helpers ---------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _loader_fingerprint() -> str:
    digest = hashlib.sha256()
    try:
        import tokenizers

        digest.update(tokenizers.__version__.encode())
        here = Path(__file__).parent
        for name in _LOADER_SOURCES:
            digest.update((here / name).read_bytes())
    except OSError:  # sources not on disk (zip import): fall back to the package version
        from tachyllm.version import __version__

        digest.update(__version__.encode())
    return digest.hexdigest()[:16]


def short_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _remove_stale_tmp(directory: Path) -> None:
    now = time.time()
    for tmp in directory.glob(_TMP_PREFIX + "*"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_S:
                tmp.unlink()
        except OSError:
            pass


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _one_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
