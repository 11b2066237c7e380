"""An adapter's files, whichever format: a PEFT directory (peft.py) or llama.cpp's GGUF LoRA file
(gguf_adapter.py)."""

from __future__ import annotations

from pathlib import Path

from tachyllm.lora.gguf_adapter import load_gguf_adapter
from tachyllm.lora.peft import LoRAAdapter, load_peft_adapter
from tachyllm.model_config import ModelConfig


def load_adapter(path: str, cfg: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """Reads and checks the adapter at `path`: a file is read as a GGUF LoRA file, anything else as a
    PEFT directory (whose errors say what is missing)."""
    if Path(path).is_file():
        return load_gguf_adapter(path, cfg, max_lora_rank)
    return load_peft_adapter(path, cfg, max_lora_rank)
