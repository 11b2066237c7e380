"""A sentence-transformers folder's pooling: modules.json names the modules applied after the transformer
(a Pooling module, whose 1_Pooling/config.json says mean / CLS / last-token pooling, and a Normalize
module), sentence_bert_config.json its input limit. Read into ModelConfig's pooling fields."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tachyllm.errors import ModelLoadError

# 1_Pooling/config.json's flags -> tachyllm's pooling types; max pooling and the weighted modes are not served.
_POOLING_MODES = {
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_lasttoken": "LAST",
}
_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


@dataclass(frozen=True)
class SentenceTransformersPooling:
    pooling_type: str | None = None  # None: the folder has no Pooling module
    normalize: bool | None = None  # None: not a sentence-transformers folder (no modules.json)
    max_seq_length: int | None = None


def read_pooling(directory: Path) -> SentenceTransformersPooling:
    """The folder's pooling, or an empty one when it has no modules.json."""
    modules_file = directory / "modules.json"
    if not modules_file.is_file():
        return SentenceTransformersPooling()
    modules = _json(modules_file)
    if not isinstance(modules, list):
        raise ModelLoadError("modules.json must be a list of modules")
    pooling_type, normalize = None, False
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith(".Pooling"):
            pooling_type = _pooling_type(_json(directory / module.get("path", "1_Pooling") / "config.json"))
        elif kind.endswith(".Normalize"):
            normalize = True
    limits = directory / "sentence_bert_config.json"
    max_seq_length = _json(limits).get("max_seq_length") if limits.is_file() else None
    return SentenceTransformersPooling(pooling_type, normalize, max_seq_length)


def _pooling_type(config: dict[str, Any]) -> str:
    unsupported = [flag for flag in _UNSUPPORTED_MODES if config.get(flag)]
    chosen = [kind for flag, kind in _POOLING_MODES.items() if config.get(flag)]
    if unsupported or len(chosen) != 1:
        raise ModelLoadError(
            "1_Pooling/config.json: exactly one of mean, CLS or last-token pooling is supported, got "
            + (", ".join(unsupported + [f for f in _POOLING_MODES if config.get(f)]) or "none")
        )
    return chosen[0]


def _json(path: Path) -> Any:
    if not path.is_file():
        raise ModelLoadError(f"sentence-transformers file missing: {path.parent.name}/{path.name}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path.parent.name}/{path.name} is not valid JSON: {exc}") from None
