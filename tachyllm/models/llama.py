"""The Llama family of decoder-only transformers: Llama 2/3, SmolLM, TinyLlama, Mistral,
Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm). Differences are config flags."""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from tachyllm import tracing
from tachyllm.backends.base import PORTABLE_OPS, AttentionMetadata, Backend, FusedLayer, LayerKV, LayerOps
from tachyllm.errors import ModelLoadError
from tachyllm.model_config import ModelConfig
from tachyllm.models.layers import GatedMLP, RMSNorm, RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, ops: LayerOps):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.window = cfg.layer_window(layer_index)  # sliding-window attention (Gemma 3's local layers)

    def forward(self, x, positions, rotary: RotaryEmbedding, kv_cache: LayerKV, meta: AttentionMetadata):
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        if self.window is not None and meta.sliding is not None:
            meta = meta.sliding  # the sliding-window layers' own block tables
        with tracing.span("attention"):
            o = meta.backend.attention(q, k, v, kv_cache, meta, self.scale, self.layer_index, self.window)
        return self.o_proj(o.view(n, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, ops: LayerOps):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, layer_index, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, ops)
        # This layer as one call of the backend (Backend.fused_decoder_layer), for the steps whose
        # metadata asks for it; set by LlamaForCausalLM.fuse_layers.
        self.fused: FusedLayer | None = None

    def forward(self, x, residual, positions, rotary, kv_cache, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(x, positions, rotary, kv_cache, meta)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    layer_class: type[nn.Module] = DecoderLayer  # a subclass of the family may build other layers
    # The vocabulary rows the LM head computes, in its output order; None: all of them (keep_head_rows).
    head_token_ids: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig, ops: LayerOps = PORTABLE_OPS):
        super().__init__()
        self.config = cfg
        self.ops = ops  # the backend's elementwise ops, which every layer is built with
        # An explicit (uninitialised) weight skips the random init: the checkpoint overwrites it, and
        # the init alone costs ~1 s at start-up (it imports torch._dynamo on the meta device).
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(self.layer_class(cfg, i, ops) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary: RotaryEmbedding | None = None

    def init_rotary(self, max_positions: int) -> None:
        cfg, w = self.config, self.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, w.device, w.dtype, self.ops
        )

    def decoder_layers(self) -> list[DecoderLayer]:
        """self.layers as the decoder layers they are (nn.ModuleList's items are typed as any Module)."""
        return cast("list[DecoderLayer]", self.layers)

    def fuse_layers(self, backend: Backend) -> None:
        """Gives each decoder layer the backend's fused form of it, where it has one. Called once the
        layers are final (weights loaded, quantized and packed; rotary table made)."""
        for layer in self.decoder_layers():
            layer.fused = backend.fused_decoder_layer(layer, self.rotary)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKV],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        fuse = meta.fused_layers
        for layer, kv_cache in zip(self.decoder_layers(), kv_caches):
            if fuse and layer.fused is not None:
                x, residual = layer.fused(x, residual, positions, kv_cache, meta)
            else:
                x, residual = layer(x, residual, positions, self.rotary, kv_cache, meta)
        assert residual is not None, "a model has at least one layer"
        x, _ = self.norm.add_and_norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def keep_head_rows(self, token_ids: torch.Tensor) -> None:
        """Gives the model an LM head of its own over these vocabulary rows only, so that logits come
        back for token_ids in their order (a draft's shortlist: the head is a large share of a small
        model's step). Called after load_weights, before quantization, which then sees the short head."""
        full = self.lm_head.weight
        head = nn.Linear(self.config.hidden_size, len(token_ids), bias=False, device=full.device, dtype=full.dtype)
        head.weight.data.copy_(full.data[token_ids.to(full.device)])
        self.lm_head = head
        self.head_token_ids = token_ids.to(full.device)

    # -- loading -----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], unloaded: frozenset[str] = frozenset()) -> None:
        """Copies checkpoint tensors (canonical HF names) into the fused parameters. `unloaded`: parameters
        the caller leaves out of `weights` on purpose (their modules are replaced before use)."""
        cfg = self.config
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        # checkpoint suffix -> (our suffix, row offset in the fused tensor)
        fused = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0),
            "self_attn.k_proj": ("self_attn.qkv_proj", q),
            "self_attn.v_proj": ("self_attn.qkv_proj", q + kv),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0),
            "mlp.up_proj": ("mlp.gate_up_proj", inter),
        }
        if cfg.tie_word_embeddings:
            # Materialising the model from the meta device (to_empty) unties shared parameters.
            self.lm_head.weight = self.embed_tokens.weight
        params = dict(self.named_parameters())
        filled: dict[str, int] = {name: 0 for name in params}
        for name, tensor in weights:
            if name.startswith("model."):
                name = name[len("model.") :]
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints still store a copy of the embedding
            shard_offset = None
            for src, (dst, off) in fused.items():
                if f".{src}." in name:
                    name, shard_offset = name.replace(src, dst), off
                    break
            param = params.get(name)
            if param is None:
                if "rotary_emb" in name:
                    continue
                raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the model")
            target = param.data if shard_offset is None else param.data[shard_offset : shard_offset + tensor.shape[0]]
            if target.shape != tensor.shape:
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            filled[name] += tensor.numel()
        missing = [n for n, p in params.items() if filled[n] != p.numel() and n not in unloaded]
        if missing:
            raise ModelLoadError(
                f"checkpoint lacks weights for: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
            )
