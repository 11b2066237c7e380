"""Writers of pre-quantized Hugging Face checkpoints in their exact on-disk formats, for tests and
benchmarks: AutoAWQ GEMM, GPTQ (v1 "z - 1" zeros and v2), compressed-tensors pack-quantized and
int-quantized. Written here from the formats' published descriptions, independently of the reader
(tachyllm/loading/hf_quantized.py), with plain round-to-nearest quantization.

Every writer takes the integer codes q (0 .. 2^b - 1), scales s and integer zero points z with
w = s * (q - z), so that the reference weight is known exactly.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Linears that read the same input share an act-order permutation (GPTQ computes it from that input).
SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


@dataclass
class Quantized:
    q: torch.Tensor  # int64 [out, in]
    s: torch.Tensor  # fp16 / bf16 / fp32 [out, groups], as stored
    z: torch.Tensor  # int64 [out, groups]
    g_idx: torch.Tensor  # int64 [in]

    def dequantize(self) -> torch.Tensor:
        return (self.q - self.z[:, self.g_idx]).double() * self.s.double()[:, self.g_idx]


def rtn(
    w: torch.Tensor,
    bits: int,
    group: int,
    sym: bool,
    g_idx: torch.Tensor | None = None,
    scale_dtype: torch.dtype = torch.float16,
) -> Quantized:
    """Round-to-nearest with scales in `scale_dtype`; groups are the columns sharing a g_idx value."""
    out, k = w.shape
    g_idx = torch.arange(k) // group if g_idx is None else g_idx
    groups = int(g_idx.max()) + 1
    qmax = 2**bits - 1
    s = torch.empty(out, groups, dtype=scale_dtype)
    z = torch.empty(out, groups, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g].float()
        if sym:
            s[:, g] = (cols.abs().amax(1) / (2 ** (bits - 1) - 1)).clamp(min=1e-4)
            z[:, g] = 2 ** (bits - 1)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s[:, g] = ((hi - lo) / qmax).clamp(min=1e-4)
            # GPTQ v1 cannot store z = 0 (it stores z - 1): keep z >= 1 so every writer round-trips.
            z[:, g] = torch.round(-lo / s[:, g].float()).clamp(1, qmax).long()
    q = torch.round(w.float() / s.float()[:, g_idx]) + z[:, g_idx]
    return Quantized(q.clamp(0, qmax).long(), s, z, g_idx)


def _pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[n, m] -> [n * bits / 32, m] int32: row r of the result holds rows r*f .. r*f+f-1 at bits i*b."""
    f = 32 // bits
    v = values.long().view(-1, f, values.shape[1])
    word = sum(v[:, i] << (bits * i) for i in range(f))
    return (word - ((word >> 31) << 32)).to(torch.int32)  # the same 32 bits, as a signed int32


def _pack_cols(values: torch.Tensor, bits: int) -> torch.Tensor:
    return _pack_rows(values.t().contiguous(), bits).t().contiguous()


def awq_tensors(qz: Quantized) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM: qweight [in, out/8] and qzeros [in/g, out/8], output columns interleaved
    (nibble i of word c holds column 8c + AWQ_ORDER[i]); scales fp16 [in/g, out]."""

    def interleave(m: torch.Tensor) -> torch.Tensor:  # [rows, out] -> packed [rows, out/8]
        rows, out = m.shape
        ordered = m.view(rows, out // 8, 8)[..., AWQ_ORDER].reshape(rows, out)
        return _pack_cols(ordered, 4)

    return {
        "qweight": interleave(qz.q.t().contiguous()),
        "qzeros": interleave(qz.z.t().contiguous()),
        "scales": qz.s.t().contiguous(),
    }


def gptq_tensors(qz: Quantized, bits: int, v1: bool) -> dict[str, torch.Tensor]:
    """GPTQ: qweight [in*b/32, out] packed along the input, qzeros [groups, out*b/32] along the
    output (v1 stores z - 1), scales [groups, out], g_idx [in]."""
    return {
        "qweight": _pack_rows(qz.q.t().contiguous(), bits),
        "qzeros": _pack_cols(qz.z.t().contiguous() - (1 if v1 else 0), bits),
        "scales": qz.s.t().contiguous(),
        "g_idx": qz.g_idx.to(torch.int32),
    }


def ct_packed_tensors(qz: Quantized, bits: int, sym: bool, act_order: bool) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized: signed values q - 2^(b-1) stored + 2^(b-1), packed along the
    input (weight_packed [out, in*b/32]); asymmetric zero points packed along the output dimension."""
    out, k = qz.q.shape
    tensors = {
        "weight_packed": _pack_cols(qz.q, bits),
        "weight_scale": qz.s,
        "weight_shape": torch.tensor([out, k], dtype=torch.int64),
    }
    if not sym:
        tensors["weight_zero_point"] = _pack_rows(qz.z, bits)
    if act_order:
        tensors["weight_g_idx"] = qz.g_idx.to(torch.int32)
    return tensors


def ct_int_tensors(qz: Quantized, bits: int, sym: bool) -> dict[str, torch.Tensor]:
    """compressed-tensors int-quantized / naive-quantized: the signed values q - 2^(b-1) as an int8
    `weight`, and (asymmetric) signed int8 zero points, unpacked."""
    offset = 2 ** (bits - 1)
    tensors = {"weight": (qz.q - offset).to(torch.int8), "weight_scale": qz.s}
    if not sym:
        tensors["weight_zero_point"] = (qz.z - offset).to(torch.int8)
    return tensors


@dataclass
class Scheme:
    method: str  # awq, gptq, gptq_v2, ct_packed, ct_int (int-quantized W8A8), ct_naive (naive-quantized)
    bits: int = 4
    group: int = 32  # -1: one group per row (channel)
    sym: bool = False
    act_order: bool = False
    scale_dtype: torch.dtype = torch.float16  # llm-compressor stores the model's dtype (often bf16)

    def quantization_config(self) -> dict:
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group, "zero_point": True, "version": "gemm"}
        if self.method.startswith("gptq"):
            return {
                "quant_method": "gptq", "bits": self.bits, "group_size": self.group, "sym": self.sym,
                "desc_act": self.act_order, "checkpoint_format": "gptq_v2" if self.method == "gptq_v2" else "gptq",
            }  # fmt: skip
        weights = {
            "num_bits": self.bits, "type": "int", "symmetric": self.sym, "dynamic": False,
            "strategy": "channel" if self.group == -1 else "group",
            "group_size": None if self.group == -1 else self.group,
            "actorder": "group" if self.act_order else None,
        }  # fmt: skip
        act = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"}
        return {
            "quant_method": "compressed-tensors",
            "format": {"ct_packed": "pack-quantized", "ct_int": "int-quantized"}.get(self.method, "naive-quantized"),
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"], "weights": weights,
                    "input_activations": act if self.method == "ct_int" else None,
                }
            },
            "ignore": ["lm_head"],
            "quantization_status": "compressed",
        }  # fmt: skip

    def tensors(self, qz: Quantized) -> dict[str, torch.Tensor]:
        if self.method == "awq":
            return awq_tensors(qz)
        if self.method.startswith("gptq"):
            return gptq_tensors(qz, self.bits, v1=self.method == "gptq")
        if self.method == "ct_packed":
            return ct_packed_tensors(qz, self.bits, self.sym, self.act_order)
        return ct_int_tensors(qz, self.bits, self.sym)


def write_prequantized(source: Path, target: Path, reference: Path | None, scheme: Scheme, seed: int = 0) -> dict:
    """Quantizes every decoder linear of the HF checkpoint in `source` into `target` in `scheme`'s
    format; `reference` (optional) gets the same model with those weights dequantized, as a plain fp32
    checkpoint. Returns the reference weights (float64) by checkpoint name."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for file in sorted(source.glob("*.safetensors")):
        state.update(load_file(file))
    packed, dense, refs = {}, {}, {}
    perms: dict[tuple[str, str], torch.Tensor] = {}
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        kind = module.rsplit(".", 1)[-1]
        if kind not in LINEARS or not name.endswith(".weight"):
            dense[name] = tensor.float()
            continue
        k = tensor.shape[1]
        group = k if scheme.group == -1 else scheme.group
        g_idx = None
        if scheme.act_order:
            layer = module.rsplit(".", 2)[0]
            key = (layer, SHARED_INPUT.get(kind, kind))
            if key not in perms:
                perms[key] = torch.randperm(k, generator=gen)
            g_idx = perms[key] // group  # column j's group: its rank in the activation order
        qz = rtn(tensor.float(), scheme.bits, group, scheme.sym, g_idx, scheme.scale_dtype)
        refs[name] = qz.dequantize()
        dense[name] = refs[name].float()
        packed.update({f"{module}.{part}": t for part, t in scheme.tensors(qz).items()})
    keep = {n: t for n, t in dense.items() if n not in refs}
    target.mkdir(parents=True, exist_ok=True)
    save_file({**keep, **packed}, target / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    _copy_side_files(source, target, {**config, "quantization_config": scheme.quantization_config()})
    if reference is not None:
        reference.mkdir(parents=True, exist_ok=True)
        save_file(dense, reference / "model.safetensors")
        _copy_side_files(source, reference, {**config, "torch_dtype": "float32"})
    return refs


def _copy_side_files(source: Path, target: Path, config: dict) -> None:
    for file in source.iterdir():
        if file.suffix == ".json" and file.name != "config.json":
            shutil.copy(file, target / file.name)
    (target / "config.json").write_text(json.dumps(config, indent=2))
