"""GGUF files (llama.cpp's format): metadata -> ModelConfig, tensors -> dequantized HF-named weights."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderTensor
from gguf.quants import dequantize

from tachyllm.errors import ModelLoadError
from tachyllm.loading.weights import Select, WeightSource, select_part
from tachyllm.model_config import ModelConfig

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")  # Mistral GGUFs say "llama"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3's sandwich norms: its ffn_norm is the norm before the MLP, and two more follow attention and MLP.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# llama.cpp's Gemma 3 layout, which its converter and llama.cpp fix rather than store: every 6th layer
# is global (the rest see a sliding window) and the local layers' rope theta is 10,000.
_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_LOCAL_ROPE_THETA = 10_000.0
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")
# Llama 3.1-style rope scaling is stored as per-frequency divisors, not as metadata; it is turned
# back into a rope_scaling dict (see _llama3_rope_scaling) and is not a model weight.
_ROPE_FREQS = "rope_freqs.weight"
DEQUANTIZE_ROWS = 2048


def gguf_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as a Python object (str, int, float, bool or list), or `default`."""
    field = reader.fields.get(key)
    if field is None:
        return default
    if field.types == [GGUFValueType.FLOAT32]:
        # Shortest decimal that round-trips through float32: 1e-05, not 9.999999747378752e-06.
        return float(str(np.float32(field.contents())))
    return field.contents()


def load_gguf(path: str) -> tuple[GGUFReader, ModelConfig, Callable[[], Iterator[tuple[str, torch.Tensor]]]]:
    """Reader (the tokenizer is Tokenizer.from_gguf(reader)), config and lazy weights of a GGUF file."""
    reader = open_gguf(path)
    config = gguf_config(reader)
    return reader, config, gguf_weights(reader, config)


class _Reader(GGUFReader):
    """The gguf package's reader, reading the file through a plain ndarray view of its memory map.
    It takes a few views per metadata value, and a numpy.memmap runs Python code for every view
    (__getitem__, __array_finalize__): a 151k-token vocabulary took 6.5 s to parse that way, 2.0 s
    this way. The same bytes and fields; tensor data are plain views of the same mapping."""

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:  # the first read: the constructor has just mapped the file
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        values = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype)[:count]
        return values.view(values.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def open_gguf(path: str) -> GGUFReader:
    """Parse the header and check every tensor lies inside the file (catches truncated downloads)."""
    try:
        reader = _Reader(path)
    except Exception as exc:  # the reader indexes past the end of damaged files: IndexError, ValueError...
        raise ModelLoadError(f"invalid or truncated GGUF file ({type(exc).__name__}: {exc})") from exc
    size = os.path.getsize(path)
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise ModelLoadError(f"file is truncated (tensor {tensor.name} extends past the end of the file)")
    return reader


def gguf_config(reader: GGUFReader) -> ModelConfig:
    arch = gguf_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(GGUF_ARCHITECTURES)})")

    def meta(key: str, default: Any = None) -> Any:
        value = gguf_value(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata key {arch}.{key} is missing")
        return value

    names = {t.name for t in reader.tensors}
    hidden = meta("embedding_length")
    heads = meta("attention.head_count")
    head_dim = meta("attention.key_length", hidden // heads)
    gemma = _gemma3_fields(meta, head_dim) if arch == "gemma3" else {}
    token_list = reader.fields.get("tokenizer.ggml.tokens")
    eos_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    eos_ids = [gguf_value(reader, f"tokenizer.ggml.{k}") for k in eos_keys]
    return ModelConfig(
        architecture=arch,
        vocab_size=meta("vocab_size", len(token_list.data) if token_list else None),
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_layers=meta("block_count"),
        num_heads=heads,
        num_kv_heads=meta("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=meta("rope.freq_base", 10000.0),
        rope_scaling=_rope_scaling(reader, arch),
        max_position_embeddings=meta("context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(i for i in eos_ids if i is not None)),
        checkpoint_dtype=torch.float32,
        **gemma,
    )


def _gemma3_fields(meta: Callable[..., Any], head_dim: int) -> dict[str, Any]:
    layers = meta("block_count")
    return {
        # llama.cpp's attention scale for Gemma 3 (the 27B's query_pre_attn_scalar differs; transformers
        # reads these files with its default of 256, which is head_dim for every other size).
        "query_pre_attn_scalar": head_dim,
        "sliding_window": meta("attention.sliding_window"),
        "sliding_layers": tuple(i for i in range(layers) if (i + 1) % _GEMMA3_SLIDING_PATTERN),
        "rope_local_theta": _GEMMA3_LOCAL_ROPE_THETA,
        "final_logit_softcapping": meta("final_logit_softcapping", False) or None,
    }


def gguf_weights(reader: GGUFReader, config: ModelConfig) -> WeightSource:
    """Check every tensor can be named and dequantized now; return a lazy (name, fp32 tensor) source."""
    plan = []
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            continue
        name = _hf_name(tensor.name, config.architecture)
        if name is None:
            raise ModelLoadError(f"unexpected tensor {tensor.name!r} for a {config.architecture} model")
        plan.append((name, tensor))
    for first_of_type in {t.tensor_type: t for _, t in reversed(plan)}.values():
        check_dequantizable(first_of_type)

    def weights(
        select: Select | None = None, leave_out: frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        # Dequantized whole (a rank's columns cut K across quantized blocks); the checkpoint cache's
        # copy, read on later loads, is sliced as it is read.
        for name, tensor in plan:
            if name not in leave_out:
                yield name, select_part(select, name, _to_torch(tensor, name, config))

    return weights


def _hf_name(gguf_name: str, arch: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    layer_names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in layer_names:
        return None
    return f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}"


def check_dequantizable(tensor: ReaderTensor) -> None:
    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return
    try:
        # One zero block is enough to find out whether the gguf package implements this type.
        dequantize(np.zeros((1, GGML_QUANT_SIZES[tensor.tensor_type][1]), dtype=np.uint8), tensor.tensor_type)
    except NotImplementedError:
        raise ModelLoadError(
            f"tensor {tensor.name} uses quantization type {tensor.tensor_type.name}, which cannot be dequantized"
        ) from None


def raw_tensors(reader: GGUFReader) -> Iterator[tuple[str, ReaderTensor]]:
    """(HF name, tensor) with the stored blocks untouched, for loaders that keep weights quantized."""
    arch = gguf_value(reader, "general.architecture")
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, arch)
        if name is not None:
            yield name, tensor


def _dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """The gguf package's dequantization, a slice of rows per call: it keeps every 16-row piece of a
    call until it joins them into the result, so a whole table (Qwen2.5's 151k-row embedding) held
    twice its float32 size and spent most of its time joining."""
    rows = data.reshape(-1, data.shape[-1])
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or len(rows) <= DEQUANTIZE_ROWS:
        return dequantize(data, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    out = np.empty((len(rows), rows.shape[1] // size * block), dtype=np.float32)
    for start in range(0, len(rows), DEQUANTIZE_ROWS):
        out[start : start + DEQUANTIZE_ROWS] = dequantize(rows[start : start + DEQUANTIZE_ROWS], qtype)
    return out.reshape(*data.shape[:-1], out.shape[1])


def dequantized(tensor: ReaderTensor) -> torch.Tensor:
    """A tensor of the file in fp32, in torch's dimension order ([out, in] for a matrix)."""
    values = _dequantize(tensor.data, tensor.tensor_type)
    if not values.flags.writeable:
        # F32 tensors come back as views of the read-only memory map, which torch cannot wrap.
        values = values.copy()
    # GGUF lists dimensions fastest-varying first; torch wants them slowest first ([out, in]).
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return torch.from_numpy(values).reshape(shape)


def _to_torch(tensor: ReaderTensor, name: str, config: ModelConfig) -> torch.Tensor:
    weight = dequantized(tensor)
    if config.architecture == "gemma3" and name.endswith("norm.weight"):
        # llama.cpp's converter stores Gemma's norm weights as 1 + w; the checkpoint form is w.
        weight = weight - 1
    return fix_rotary_rows(weight, name, config)


def fix_rotary_rows(weight: torch.Tensor, name: str, config: ModelConfig) -> torch.Tensor:
    """Undoes llama.cpp's q/k row order; rows may carry any trailing shape (weights, block scales)."""
    if config.architecture == "llama":
        if ".q_proj." in name:
            return _unpermute_rotary(weight, config.num_heads)
        if ".k_proj." in name:
            return _unpermute_rotary(weight, config.num_kv_heads)
    return weight


def _unpermute_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter reorders each head's q/k rows from HF's half-split rotary layout
    (x[:d/2], x[d/2:]) to interleaved pairs (x0, x1), ...; this puts the rows back."""
    rest = weight.shape[1:]
    return weight.reshape(heads, weight.shape[0] // heads // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


def _rope_scaling(reader: GGUFReader, arch: str) -> dict[str, Any] | None:
    kind = gguf_value(reader, f"{arch}.rope.scaling.type", "none")
    factor = gguf_value(reader, f"{arch}.rope.scaling.factor")
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if kind == "none":
        return None if freqs is None else _llama3_rope_scaling(freqs, reader, arch)
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor}
        original = gguf_value(reader, f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = original
        return scaling
    raise ModelLoadError(f"unsupported rope scaling type {kind!r}")


def _llama3_rope_scaling(freqs: ReaderTensor, reader: GGUFReader, arch: str) -> dict[str, Any] | None:
    """Recover HF's llama3 rope_scaling from the per-frequency divisors llama.cpp stores.

    Llama 3 divides the i-th inverse frequency by 1 (short wavelengths), by `factor` (long ones), or
    in between by 1 / ((1 - s) / factor + s) with s = a / wavelength + b linear in 1 / wavelength.
    The divisors fix `factor`, a and b. HF parameterises a and b by (original context L, low, high)
    with a = L / (high - low) and b = -low / (high - low), one degree of freedom too many, so L
    keeps Llama 3's 8192 and low/high follow. Any such triple yields identical frequencies.
    """
    divisors = dequantize(freqs.data, freqs.tensor_type).astype(np.float64).reshape(-1)
    factor = round(float(divisors.max()), 4)
    if factor == 1.0:
        return None
    rotary_dim = gguf_value(reader, f"{arch}.rope.dimension_count", 2 * len(divisors))
    base = gguf_value(reader, f"{arch}.rope.freq_base", 10000.0)
    wavelengths = 2 * math.pi * base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    # float32 storage blurs the two flat regions by ~1e-7; anything clearly between them is interpolated.
    middle = (divisors > 1 + 1e-4) & (divisors < factor * (1 - 1e-4))
    if middle.sum() < 2:
        raise ModelLoadError("cannot recover llama3 rope scaling: rope_freqs has fewer than two interpolated entries")
    smooth = (1 / divisors[middle] - 1 / factor) / (1 - 1 / factor)
    a, b = (float(c) for c in np.polyfit(1 / wavelengths[middle], smooth, 1))
    original = 8192
    span = original / a
    low = -b * span
    # The divisors are float32; rounding recovers the exact small numbers real configs use.
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": round(low, 4),
        "high_freq_factor": round(low + span, 4),
        "original_max_position_embeddings": original,
    }
