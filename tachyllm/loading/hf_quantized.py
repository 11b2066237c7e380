"""Pre-quantized Hugging Face checkpoints: `quantization_config` in config.json and the packed tensors
of AutoAWQ (GEMM), GPTQ (AutoGPTQ / GPTQModel, v1 and v2 zero points) and compressed-tensors
(llm-compressor: pack-quantized, int-quantized, naive-quantized).

Every format is read into one neutral form, `PackedLinear`: unsigned codes q, a scale s and an
integer zero point z per (output row, group), w = s * (q - z), and the group of each input column.
The weight stream yields these dequantized (so a model builds as from any checkpoint);
quantization/prequantized.py then runs the codes themselves on the packed kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tachyllm.errors import ModelLoadError

# compressed-tensors formats whose integers this module reads; the others (float-quantized,
# nvfp4-pack-quantized, marlin-24, ...) are refused by name.
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
CT_STRATEGIES = ("tensor", "channel", "group")
GPTQ_FORMATS = ("gptq", "gptq_v2")
BITS = (4, 8)
# Tensors that make up one packed linear, per method (the suffix after the module name).
_AWQ_GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_CT_PACKED_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")
_CT_INT_PARTS = ("weight", "weight_scale", "weight_zero_point", "weight_g_idx")
# compressed-tensors scales of what tachyllm does not quantize (static activation scales, KV-cache
# scales): present in some checkpoints, not read (the engine runs weight-only; --kv-cache-dtype
# calibrates its own KV scales).
_CT_UNUSED = ("input_scale", "input_zero_point", "output_scale", "output_zero_point", "k_scale", "v_scale")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: nibble i of a word holds output column 8c + _AWQ_ORDER[i]


@dataclass(frozen=True)
class QuantFormat:
    """What config.json's quantization_config says, checked."""

    method: str  # awq, gptq or compressed-tensors (vLLM's names)
    layout: str  # awq: gemm; gptq: gptq (stored zeros are z - 1) or gptq_v2; compressed-tensors: its format
    bits: int | None  # awq / gptq: 4 or 8; compressed-tensors: per tensor (None)
    activations: str | None = None  # compressed-tensors: the activation quantization the engine does not do


@dataclass
class PackedLinear:
    """One quantized linear as stored: w[o, j] = scales[o, g] * (codes[o, j] - zeros[o, g]), g = g_idx[j]."""

    codes: torch.Tensor  # int32 [out, in], 0 .. 2**bits - 1
    scales: torch.Tensor  # fp32 [out, groups] (the file's values, converted exactly)
    zeros: torch.Tensor  # int32 [out, groups]
    g_idx: torch.Tensor  # int64 [in]: the group of each input column
    bits: int

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    def dequantize(self) -> torch.Tensor:
        """fp32 [out, in]: exact for fp16 / bf16 scales ((q - z) has at most 9 significant bits), the
        correctly rounded product for fp32 ones."""
        return (self.codes - self.zeros[:, self.g_idx]).float() * self.scales[:, self.g_idx]


def _bad(field: str, value: Any, accepted: str) -> ModelLoadError:
    shown = json_value(value)
    return ModelLoadError(f"quantization_config.{field} = {shown} is not supported (accepted: {accepted})")


def json_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


def parse_quant_format(cfg: dict[str, Any]) -> QuantFormat:
    """config.json's quantization_config -> QuantFormat; an unsupported variant is one error naming the field."""
    method = cfg.get("quant_method")
    if method == "awq":
        return _parse_awq(cfg)
    if method == "gptq":
        return _parse_gptq(cfg)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(cfg)
    raise _bad("quant_method", method, "awq, gptq, compressed-tensors")


def _parse_awq(cfg: dict[str, Any]) -> QuantFormat:
    if cfg.get("bits", 4) != 4:
        raise _bad("bits", cfg.get("bits"), "4 for awq")
    # AutoAWQ writes `version`; GPTQModel's AWQ writes `checkpoint_format` / `format`.
    key = next((k for k in ("version", "checkpoint_format", "format") if k in cfg), "version")
    version = str(cfg.get(key, "gemm")).lower()
    if version != "gemm":
        raise _bad(key, cfg[key], "gemm (AutoAWQ's GEMM packing)")
    if cfg.get("zero_point", True) is not True:
        raise _bad("zero_point", cfg["zero_point"], "true (the GEMM packing stores zero points)")
    return QuantFormat("awq", "gemm", 4)


def _parse_gptq(cfg: dict[str, Any]) -> QuantFormat:
    bits = cfg.get("bits")
    if bits not in BITS:
        raise _bad("bits", bits, "4, 8")
    if cfg.get("is_marlin_format"):
        raise _bad("is_marlin_format", True, "false (Marlin-only checkpoints are not read)")
    key = next((k for k in ("checkpoint_format", "format") if k in cfg), "checkpoint_format")
    layout = str(cfg.get(key, "gptq")).lower()
    if layout not in GPTQ_FORMATS:
        raise _bad(key, cfg[key], ", ".join(GPTQ_FORMATS))
    if str(cfg.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise _bad("pack_dtype", cfg["pack_dtype"], "int32")
    if cfg.get("dynamic"):
        raise _bad("dynamic", "{...}", "none (per-layer overrides are not read)")
    return QuantFormat("gptq", layout, bits)


def _parse_compressed_tensors(cfg: dict[str, Any]) -> QuantFormat:
    layout = cfg.get("format")
    if layout not in CT_FORMATS:
        raise _bad("format", layout, ", ".join(CT_FORMATS))
    sparsity = cfg.get("sparsity_config") or {}
    if sparsity.get("format") not in (None, "dense"):
        raise _bad("sparsity_config.format", sparsity["format"], "dense")
    groups = cfg.get("config_groups") or {}
    if not groups:
        raise ModelLoadError("quantization_config.config_groups is empty: nothing says how the weights are stored")
    activations = set()
    bits = set()
    for name, scheme in groups.items():
        weights = scheme.get("weights") or {}
        where = f"config_groups.{name}.weights"
        if weights.get("type", "int") != "int":
            raise _bad(f"{where}.type", weights.get("type"), "int")
        if weights.get("num_bits") not in BITS:
            raise _bad(f"{where}.num_bits", weights.get("num_bits"), "4, 8")
        if weights.get("strategy", "tensor") not in CT_STRATEGIES:
            raise _bad(f"{where}.strategy", weights.get("strategy"), ", ".join(CT_STRATEGIES))
        if weights.get("dynamic"):
            raise _bad(f"{where}.dynamic", weights["dynamic"], "false")
        bits.add(weights["num_bits"])
        act = scheme.get("input_activations")
        if act:
            activations.add(f"{act.get('type', 'int')}{act.get('num_bits')} {act.get('strategy', 'tensor')}")
    # pack-quantized tensors say their width; int8-stored values need it from the config.
    if layout != "pack-quantized" and len(bits) > 1:
        raise _bad("config_groups.*.weights.num_bits", "mixed", f"one width with format {layout}")
    width = bits.pop() if layout != "pack-quantized" else None
    return QuantFormat("compressed-tensors", layout, width, ", ".join(sorted(activations)) or None)


class PrequantizedWeights:
    """The packed linears of a checkpoint directory: which modules, their tensors, their decoding."""

    def __init__(self, fmt: QuantFormat, tensors: dict[str, Path]):
        self.format = fmt
        self._tensors = tensors
        self._parts: tuple[str, ...]
        marker, self._parts = {
            "awq": (".qweight", _AWQ_GPTQ_PARTS),
            "gptq": (".qweight", _AWQ_GPTQ_PARTS),
            "compressed-tensors": (
                (".weight_packed", _CT_PACKED_PARTS)
                if fmt.layout == "pack-quantized"
                else (".weight_scale", _CT_INT_PARTS)
            ),
        }[fmt.method]
        self.modules = sorted(name.removesuffix(marker) for name in tensors if name.endswith(marker))
        if not self.modules:
            raise ModelLoadError(f"quantization_config says {fmt.method} but no tensor ends in {marker}")

    def stored_names(self) -> set[str]:
        """Checkpoint tensors that belong to the packed linears (read through `read`, not as weights),
        and those not used at all."""
        names = {f"{m}.{p}" for m in self.modules for p in self._parts} & set(self._tensors)
        if self.format.method == "compressed-tensors":
            names |= {n for n in self._tensors if n.rpartition(".")[2] in _CT_UNUSED}
        return names

    def read(self, module: str) -> PackedLinear:
        def get(part: str) -> torch.Tensor | None:
            name = f"{module}.{part}"
            if name not in self._tensors:
                return None
            with safe_open(self._tensors[name], framework="pt") as handle:
                return handle.get_tensor(name)

        try:
            reader = {"awq": _read_awq, "gptq": _read_gptq, "compressed-tensors": _read_compressed}[self.format.method]
            return reader(get, self.format)
        except (KeyError, RuntimeError, ValueError, TypeError) as exc:
            raise ModelLoadError(f"{module}: packed {self.format.method} tensors do not fit together ({exc})") from exc


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32 / bits fields, lowest bits first, spread along `dim` (field i of word c
    becomes index c * per_word + i)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    fields = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., per_word] on the last axis
    if dim == 1:
        return fields.reshape(words.shape[0], words.shape[1] * per_word)
    return fields.permute(0, 2, 1).reshape(words.shape[0] * per_word, words.shape[1])


def _require(tensor: torch.Tensor | None, part: str) -> torch.Tensor:
    if tensor is None:
        raise KeyError(f"missing {part}")
    return tensor


def _contiguous_groups(in_features: int, groups: int) -> torch.Tensor:
    return torch.arange(in_features) // (in_features // groups)


def _read_awq(get: Callable[[str], torch.Tensor | None], fmt: QuantFormat) -> PackedLinear:
    # qweight [in, out/8], qzeros [in/g, out/8], scales [in/g, out]; nibbles in AWQ's interleaved order.
    order = torch.tensor(_AWQ_ORDER)
    inverse = torch.argsort(order)

    def columns(words: torch.Tensor) -> torch.Tensor:
        fields = _unpack(words, 4, dim=1).view(words.shape[0], -1, 8)
        return fields[..., inverse].reshape(words.shape[0], -1)

    codes = columns(_require(get("qweight"), "qweight")).t()
    zeros = columns(_require(get("qzeros"), "qzeros")).t()
    scales = _require(get("scales"), "scales").float().t()
    return _checked(codes, scales, zeros, None, 4)


def _read_gptq(get: Callable[[str], torch.Tensor | None], fmt: QuantFormat) -> PackedLinear:
    # qweight [in*bits/32, out] packed along the input; qzeros [groups, out*bits/32]; scales [groups, out].
    bits = fmt.bits
    assert bits is not None, "a gptq config names its width"
    codes = _unpack(_require(get("qweight"), "qweight"), bits, dim=0).t()
    zeros = _unpack(_require(get("qzeros"), "qzeros"), bits, dim=1).t()
    if fmt.layout == "gptq":
        zeros = zeros + 1  # the v1 format stores z - 1 (AutoGPTQ's convention)
    scales = _require(get("scales"), "scales").float().t()
    return _checked(codes, scales, zeros, get("g_idx"), bits)


def _read_compressed(get: Callable[[str], torch.Tensor | None], fmt: QuantFormat) -> PackedLinear:
    # Signed values q in [-2^(b-1), 2^(b-1)); stored unsigned as q + 2^(b-1) when packed.
    if fmt.layout == "pack-quantized":
        packed = _require(get("weight_packed"), "weight_packed")
        out, k = (int(v) for v in _require(get("weight_shape"), "weight_shape"))
        bits = 32 * packed.shape[1] // k
        if bits not in BITS or packed.shape[1] * (32 // bits) != k:
            raise ValueError(f"weight_packed {tuple(packed.shape)} does not hold 4- or 8-bit values of {k} inputs")
        codes = _unpack(packed, bits, dim=1)[:out]
    else:
        assert fmt.bits is not None, "int-quantized configs name one width"
        bits = fmt.bits
        codes = _require(get("weight"), "weight").to(torch.int32) + (1 << (bits - 1))
        out, k = codes.shape
    offset = 1 << (bits - 1)
    scales = _require(get("weight_scale"), "weight_scale").float()
    scales = scales.reshape(1, 1).expand(out, 1) if scales.numel() == 1 else scales.reshape(out, -1)
    zp = get("weight_zero_point")
    if zp is None:  # symmetric
        zeros = torch.full(scales.shape, offset, dtype=torch.int32)
    elif zp.dtype == torch.int32 and fmt.layout == "pack-quantized":
        zeros = _unpack(zp, bits, dim=0)[:out]  # packed along the output dimension, already offset
    else:
        zeros = zp.to(torch.int32).reshape(scales.shape) + offset
    return _checked(codes.contiguous(), scales.contiguous(), zeros.contiguous(), get("weight_g_idx"), bits)


def _checked(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor | None, bits: int
) -> PackedLinear:
    out, k = codes.shape
    groups = scales.shape[1]
    if scales.shape[0] != out or zeros.shape != scales.shape or k % groups:
        raise ValueError(f"codes {tuple(codes.shape)}, scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)}")
    if g_idx is None or bool((g_idx < 0).all()):  # llm-compressor may save an unset g_idx as -1s
        g_idx = _contiguous_groups(k, groups)
    g_idx = g_idx.long()
    if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ValueError(f"g_idx of shape {tuple(g_idx.shape)} does not index {groups} groups")
    return PackedLinear(codes.to(torch.int32).contiguous(), scales, zeros.to(torch.int32).contiguous(), g_idx, bits)
