"""The CPU backend: tachyllm's C++ kernels (kernels/csrc).

Attention computes every sequence of the batch, decodes and prefill chunks alike, straight from the
block tables (one (first row, queries, first position) row per sequence), and writes K/V, an int8 /
fp8 cache included (with its per-head scales). Where a decoder layer's parts all have kernels, the
layer runs as one C++ call (decode_layer.cpp: norms, linears, rotary, attention, activation), its
linears picking their kernel by row count as the modules do. The layers' norms, rotary and
activation, the bf16 matrix-vector product and the GGUF-style block products are kernels too. An
encoder's attention (BERT) runs over the step's packed inputs where they lie, unpadded
(encoder_attention.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from tachyllm.backends.base import (
    AttentionMetadata,
    Backend,
    EncoderMetadata,
    FusedLayer,
    LayerKV,
    LayerOps,
    MetadataBuilder,
)
from tachyllm.backends.registry import register_backend
from tachyllm.kernels import native
from tachyllm.kernels.kv_quant import QuantizedKV
from tachyllm.step import StepBatch


@dataclass(kw_only=True, eq=False)
class CpuMetadata(AttentionMetadata):
    # One row per sequence of the batch: int32 [num_seqs, 3] rows of (first batch row, number of
    # queries, position of the first query), and int32 block tables [num_seqs, longest table].
    seq_info: torch.Tensor
    block_tables: torch.Tensor


@dataclass(kw_only=True, eq=False)
class CpuEncoderMetadata(EncoderMetadata):
    seq_starts: torch.Tensor  # int64 [inputs + 1]: each input's first row, then the end of the last


class CpuMetadataBuilder(MetadataBuilder):
    def prepare(self, batch: StepBatch, pad_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor, CpuMetadata]:
        assert pad_to is None, "the cpu backend is not graph_capturable: nothing pads its steps"
        input_ids, positions, slot_mapping = self.token_inputs(batch)
        info, tables, row = [], [], 0
        for s in batch.seqs:
            n = len(s.token_ids)
            info.append((row, n, s.start))
            tables.append(s.block_table)
            row += n
        meta = CpuMetadata(
            backend=self.backend,
            slot_mapping=slot_mapping,
            fused_layers=True,
            seq_info=torch.tensor(info, dtype=torch.int32),
            block_tables=_padded(tables),
        )
        if batch.seqs[0].window_block_table is not None:
            window_tables = [s.window_block_table or [] for s in batch.seqs]  # all have one when the first has
            meta.sliding = CpuMetadata(
                backend=self.backend,
                slot_mapping=self.slot_mapping(batch, window_tables),
                seq_info=meta.seq_info,
                block_tables=_padded(window_tables),
            )
        return input_ids, positions, meta


def _padded(tables: list[list[int]]) -> torch.Tensor:
    """int32 [len(tables), longest] block tables."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def kernel_caches(
    k_cache: torch.Tensor | QuantizedKV, v_cache: torch.Tensor | QuantizedKV
) -> tuple[tuple[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]]:
    """((K cache, K scales), (V cache, V scales)) as the C++ kernels take them; no scales for a plain cache."""
    if isinstance(k_cache, QuantizedKV):
        assert isinstance(v_cache, QuantizedKV), "a layer's K and V are stored alike"
        return k_cache.kernel_args(), v_cache.kernel_args()
    assert isinstance(v_cache, torch.Tensor), "a layer's K and V are stored alike"
    return (k_cache, None), (v_cache, None)


class CpuLayerOps(LayerOps):
    """The kernels where they apply (2-D rows in the weight's dtype), PyTorch otherwise (Qwen3's
    per-head q/k norms, mixed dtypes)."""

    def __init__(self, kernels: ModuleType):
        self._rms_norm = kernels.rms_norm
        self._add_rms_norm = kernels.add_rms_norm
        self._rotary_inplace = kernels.rotary_inplace
        self._silu_mul = kernels.silu_mul

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == weight.dtype:
            out = torch.empty_like(x)
            self._rms_norm(out, x, weight, eps)
            return out
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # In place on both tensors (x is always a fresh layer output).
        if x.dim() == 2 and x.dtype == residual.dtype == weight.dtype:
            self._add_rms_norm(x, residual, weight, eps)
            return x, residual
        return super().add_rms_norm(x, residual, weight, eps)

    def rotary(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if q.dtype == cos.dtype:  # in place
            self._rotary_inplace(q, k, positions, cos, sin)
            return q, k
        return super().rotary(positions, q, k, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() == 2:
            return self._silu_mul(gate_up)
        return super().silu_mul(gate_up)


class _FusedDecodeLayer:
    """A C++ DecodeLayer as the model calls it; `set_lora` hands it the LoRA adapters of its linears
    (lora/manager.py)."""

    def __init__(self, layer, cos: torch.Tensor, sin: torch.Tensor):
        self.layer, self.cos, self.sin = layer, cos, sin
        self.set_lora = layer.set_lora

    def __call__(self, x, residual, positions, kv_cache: LayerKV, meta: CpuMetadata):
        (kc, ks), (vc, vs) = kernel_caches(*kv_cache)
        return self.layer.forward(
            x, residual, positions, self.cos, self.sin, kc, vc, meta.slot_mapping, meta.block_tables, meta.seq_info,
            ks, vs,
        )  # fmt: skip


@register_backend
class CpuBackend(Backend):
    name = "cpu"
    description = "tachyllm's C++ CPU kernels"

    def __init__(self, device: torch.device):
        super().__init__(device)
        kernels = native.native_ops()
        assert kernels is not None, "create_backend checked unavailable_reason"
        self.kernels = kernels
        self.ops = CpuLayerOps(self.kernels)
        self._write_kv = self.kernels.write_kv
        self._paged_attention = self.kernels.paged_attention

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        if device.type != "cpu":
            return f"the C++ kernels run on the CPU only, and the device is {device}"
        if not native.enabled():
            return "TACHY_NATIVE turns the C++ kernels off"
        if native.native_ops() is None:
            return "the C++ kernels could not be built (see the warning above)"
        return None

    def block_kernels(self) -> ModuleType | None:
        # Their portable scalar fallback (no AVX-512 VNNI, no AVX2) is for correctness, and slower than aten.
        return self.kernels if self.kernels.quant_gemv_isa() != "scalar" else None

    def lora_kernels(self) -> ModuleType | None:
        return self.kernels

    def bf16_linear_kernels(self) -> ModuleType | None:
        # Built for AVX512-BF16 or AVX2 + FMA it beats PyTorch's bf16 linears; otherwise it is a
        # scalar loop, far slower than oneDNN (measurements: docs/design_measurements.md#bf16-linears).
        return self.kernels if self.kernels.bf16_linear_vectorized else None

    def fused_decoder_layer(self, layer, rotary) -> FusedLayer | None:
        """A pre-norm decoder layer (input_layernorm, self_attn, post_attention_layernorm, gated
        mlp) as one C++ DecodeLayer call; None when a part of it has no kernel (other linear
        types, q/k norms, dtypes the kernels lack)."""
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        specs = [getattr(linear, "native_spec", lambda: None)() for linear in linears]
        weight = layer.input_layernorm.weight
        same_dtype = weight.dtype == layer.post_attention_layernorm.weight.dtype == rotary.cos.dtype
        if attn.q_norm is not None or None in specs or not same_dtype:
            return None
        fused = self.kernels.DecodeLayer(
            *specs, weight, layer.post_attention_layernorm.weight, layer.input_layernorm.eps,
            attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
        )  # fmt: skip
        return _FusedDecodeLayer(fused, rotary.cos, rotary.sin)

    def metadata_builder(self, kv_caches: list[LayerKV], block_size: int) -> CpuMetadataBuilder:
        return CpuMetadataBuilder(self, kv_caches, block_size)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerKV,
        meta: CpuMetadata,  # type: ignore[override]  # a backend gets the metadata its own builder made
        scale: float,
        layer: int,
        window: int | None = None,
    ) -> torch.Tensor:
        (kc, ks), (vc, vs) = kernel_caches(*kv_cache)
        self._write_kv(k, v, kc, vc, meta.slot_mapping, ks, vs)
        out = torch.empty_like(q)
        self._paged_attention(out, q, kc, vc, meta.block_tables, meta.seq_info, scale, ks, vs, window or 0)
        return out

    def encoder_metadata(self, seq_lens: list[int], rows: int) -> CpuEncoderMetadata:
        starts = torch.zeros(len(seq_lens) + 1, dtype=torch.long)
        torch.cumsum(torch.tensor(seq_lens, dtype=torch.long), 0, out=starts[1:])
        return CpuEncoderMetadata(
            backend=self, slot_mapping=torch.empty(0, dtype=torch.long), seq_lens=seq_lens, seq_starts=starts
        )

    def encoder_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: CpuEncoderMetadata,  # type: ignore[override]  # a backend gets the metadata it made
        scale: float,
    ) -> torch.Tensor:
        """One kernel call over the packed inputs, read where they lie (q, k and v may be views of one
        fused projection), nothing padded or gathered (docs/design_measurements.md#encoder-attention)."""
        out = torch.empty(q.shape, dtype=q.dtype)
        self.kernels.encoder_attention(out, q, k, v, meta.seq_starts, scale)
        return out
