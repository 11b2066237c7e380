"""Gemma 3 (text): the Llama layout with q/k RMSNorm, "sandwich" norms (after attention and after
the MLP as well as before them), a GELU-tanh gated MLP, embeddings scaled by sqrt(hidden), RMSNorm
weights stored as offsets from 1 (the norm multiplies by 1 + w), an attention scale of
query_pre_attn_scalar ** -0.5, and sliding-window attention on the local layers (five of every
six), which also rotate with their own rope theta. Weights load as the Llama family's do; every
norm's weight becomes 1 + w once loaded, so that the backend's RMSNorm ops run unchanged.

The decoder layers run as modules: the backends' fused decoder layer has no place for the extra
norms or the window.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from tachyllm.backends.base import PORTABLE_OPS, AttentionMetadata, Backend, LayerKV, LayerOps
from tachyllm.model_config import ModelConfig
from tachyllm.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from tachyllm.models.llama import Attention, LlamaForCausalLM


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, ops: LayerOps):
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, ops)
        self.self_attn = Attention(cfg, layer_index, ops)
        self.post_attention_layernorm = RMSNorm(hidden, eps, ops)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, ops)
        self.mlp = GatedMLP(hidden, cfg.intermediate_size, ops, activation="gelu_tanh")
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, ops)

    def forward(self, x, residual, positions, rotary, kv_cache, meta):
        """(layer input, running residual or None) -> (layer output, residual), as the Llama layer: the
        next norm adds the output to the residual."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, positions, rotary, kv_cache, meta))
        x, residual = self.pre_feedforward_layernorm.add_and_norm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma3DecoderLayer

    def __init__(self, cfg: ModelConfig, ops: LayerOps = PORTABLE_OPS):
        super().__init__(cfg, ops)
        self.local_rotary: RotaryEmbedding | None = None  # the sliding-window layers'

    def init_rotary(self, max_positions: int) -> None:
        super().init_rotary(max_positions)
        cfg, w = self.config, self.embed_tokens.weight
        theta = cfg.rope_local_theta or cfg.rope_theta
        self.local_rotary = RotaryEmbedding(cfg.head_dim, max_positions, theta, None, w.device, w.dtype, self.ops)

    def fuse_layers(self, backend: Backend) -> None:
        """No fused form: the layers run as modules (see the module docstring)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKV],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # The scale is rounded to the model dtype first, as the reference implementation does.
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(cast("list[Gemma3DecoderLayer]", self.layers), kv_caches):
            rotary = self.rotary if layer.self_attn.window is None else self.local_rotary
            x, residual = layer(x, residual, positions, rotary, kv_cache, meta)
        assert residual is not None, "a model has at least one layer"
        x, _ = self.norm.add_and_norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], unloaded: frozenset[str] = frozenset()) -> None:
        super().load_weights(weights, unloaded)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    # (1 + w) computed in fp32 as the reference does, then stored in the model dtype.
                    module.weight.copy_(1.0 + module.weight.float())
