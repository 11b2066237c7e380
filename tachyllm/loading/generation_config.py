"""The default sampling values a model's creator recommends, from its Hugging Face generation_config.json
(vLLM's --generation-config): requests that leave a field unset get these instead of tachyllm's own."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tachyllm.errors import ConfigError
from tachyllm.sampling_params import SamplingParams

FILE_NAME = "generation_config.json"
# generation_config.json keys vLLM reads, with the SamplingParams field each sets.
KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
INTEGER_KEYS = ("top_k", "max_new_tokens")


def generation_config_file(setting: str, model: str | None) -> Path | None:
    """Where --generation-config SETTING reads from for MODEL: "auto" is the model directory's file (a
    GGUF file or the embedded model has none), "vllm" reads nothing, anything else is a folder that
    must hold one."""
    if setting == "vllm":
        return None
    if setting == "auto":
        if model is None or not Path(model).is_dir():
            return None
        path = Path(model) / FILE_NAME
        return path if path.is_file() else None
    folder = Path(setting)
    if not folder.is_dir():
        raise ConfigError(f"--generation-config {setting!r} is not auto, vllm or a folder")
    path = folder / FILE_NAME
    if not path.is_file():
        raise ConfigError(f"--generation-config {setting!r}: the folder holds no {FILE_NAME}")
    return path


def default_sampling_values(setting: str, model: str | None) -> dict[str, Any]:
    """SamplingParams fields and values from the generation config SETTING selects ({} when none).
    Values that are not numbers of the right kind are refused here, at start, rather than failing
    every request later."""
    path = generation_config_file(setting, model)
    if path is None:
        return {}
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    values: dict[str, Any] = {}
    for key, field in KEYS.items():
        value = document.get(key)
        if value is None:
            continue
        integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ConfigError(f"{path}: {key} must be a number, got {value!r}")
        if key in INTEGER_KEYS and not integral:
            raise ConfigError(f"{path}: {key} must be an integer, got {value!r}")
        values[field] = int(value) if key in INTEGER_KEYS else float(value)
    if values.get("top_k") == 0:  # Hugging Face's "no top-k"; tachyllm's (and vLLM's) is -1
        values["top_k"] = -1
    try:
        SamplingParams(**values)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None
    return values
