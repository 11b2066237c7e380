"""The model families, by the architecture name of their ModelConfig."""

from __future__ import annotations

from tachyllm.model_config import ModelConfig
from tachyllm.models.gemma3 import Gemma3ForCausalLM
from tachyllm.models.llama import LlamaForCausalLM

_FAMILIES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    """The module class that builds a model of this config's architecture."""
    return _FAMILIES[cfg.architecture]
