"""Typed access to the parts of a built causal LM that quantization reads.

The model classes live in the models layer, above this one, so quantization holds a model as an
nn.Module, whose attributes a type checker reads as `Tensor | Module`. These helpers check and name
the types the model classes build those parts as."""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

from tachyllm.model_config import ModelConfig

M = TypeVar("M", bound=nn.Module)


def model_config(model: nn.Module) -> ModelConfig:
    config = model.config
    assert isinstance(config, ModelConfig), "a built model carries its ModelConfig"
    return config


def submodule(model: nn.Module, name: str, kind: type[M]) -> M:
    """The submodule `name` of `model`, built as a `kind`."""
    module = model.get_submodule(name)
    assert isinstance(module, kind), f"{name} is a {type(module).__name__}, not a {kind.__name__}"
    return module


def norm_weight(model: nn.Module) -> torch.Tensor:
    """The final norm's weight: it has the model's dtype and device whatever else was packed."""
    weight = submodule(model, "norm", nn.Module).weight
    assert isinstance(weight, torch.Tensor), "the final norm (RMSNorm) has a weight"
    return weight


def compute_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head over hidden states (the model class's compute_logits)."""
    logits: torch.Tensor = getattr(model, "compute_logits")(hidden)
    return logits


def rotary_positions(model: nn.Module) -> int:
    """How many positions the model's rotary table covers."""
    return int(getattr(model, "rotary").cos.shape[0])
