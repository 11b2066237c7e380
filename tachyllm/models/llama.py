"""The Llama family of decoder-only transformers: Llama 2/3, SmolLM, TinyLlama, Mistral,
Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm). Differences are config flags."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tachyllm.config import ModelConfig
from tachyllm.errors import ModelLoadError
from tachyllm.kernels.native import cpu_ops
from tachyllm.kernels.paged_attention import AttentionMetadata, kernel_caches, paged_attention
from tachyllm.models.layers import GatedMLP, RMSNorm, RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, positions, rotary: RotaryEmbedding, kv_cache: tuple[torch.Tensor, torch.Tensor], meta):
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.layer_index)
        return self.o_proj(o.view(n, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self._fused: object | None = None  # the C++ DecodeLayer, built at its first use
        self._fusable = True

    def fused(self, rotary: RotaryEmbedding):
        """This layer as one C++ call (kernels/csrc/decode_layer.cpp) for steps whose attention runs
        in the C++ kernel, or None when a part of it has no kernel (other linear types, q/k norms,
        dtypes the kernels lack)."""
        if self._fused is None and self._fusable:
            attn, mlp = self.self_attn, self.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            specs = [getattr(linear, "native_spec", lambda: None)() for linear in linears]
            weight = self.input_layernorm.weight
            ops = cpu_ops(weight.device)
            same_dtype = weight.dtype == self.post_attention_layernorm.weight.dtype == rotary.cos.dtype
            self._fusable = ops is not None and attn.q_norm is None and None not in specs and same_dtype
            if self._fusable:
                self._fused = ops.DecodeLayer(
                    *specs, weight, self.post_attention_layernorm.weight, self.input_layernorm.eps,
                    attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
                )  # fmt: skip
        return self._fused

    def forward(self, x, residual, positions, rotary, kv_cache, meta, fuse: bool = False):
        if fuse and (layer := self.fused(rotary)) is not None:
            (kc, ks), (vc, vs) = kernel_caches(*kv_cache)
            return layer.forward(
                x, residual, positions, rotary.cos, rotary.sin, kc, vc, meta.slot_mapping, meta.block_tables, meta.seq_info, ks, vs
            )  # fmt: skip
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(x, positions, rotary, kv_cache, meta)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # An explicit (uninitialised) weight skips the random init: the checkpoint overwrites it, and
        # the init alone costs ~1 s at start-up (it imports torch._dynamo on the meta device).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary: RotaryEmbedding | None = None

    def init_rotary(self, max_positions: int) -> None:
        cfg, w = self.config, self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, w.device, w.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        # A step whose attention runs in the C++ kernel runs each layer as one C++ call (its linears
        # pick their kernel by row count as the modules do).
        fuse = meta.seq_info is not None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, self.rotary, kv_cache, meta, fuse)
        x, _ = self.norm.add_and_norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # -- loading -----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors (canonical HF names) into the fused parameters."""
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
                raise ModelLoadError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)
            filled[name] += tensor.numel()
        missing = [n for n, p in params.items() if filled[n] != p.numel()]
        if missing:
            raise ModelLoadError(f"checkpoint lacks weights for: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
