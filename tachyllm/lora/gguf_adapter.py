"""A LoRA adapter read from llama.cpp's GGUF LoRA file (what its convert_lora_to_gguf.py writes:
`general.type = adapter`, `adapter.type = lora`, `adapter.lora.alpha`, tensors
`blk.N.<tensor>.weight.lora_a` / `.lora_b`), checked against the base model like a PEFT adapter.

The file holds A as [r, in] and B as [out, r] (GGUF lists the dimensions reversed: lora_a is
(in, r) there). Quantized tensors (Q8_0 and the other types the gguf package reads) are dequantized
to fp32 here, at load: the adapter runs in fp32 whatever its file type. For a `llama` file, B of
attn_q / attn_k carries llama.cpp's rotary row order, which is put back to the checkpoint's, as
for the base weights."""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace
from pathlib import Path

import torch

from tachyllm.errors import AdapterError, ModelLoadError
from tachyllm.loading.gguf import check_dequantizable, dequantized, fix_rotary_rows, gguf_value, open_gguf
from tachyllm.lora.peft import LoRAAdapter, check_lora_tensor, projection_shapes, store_pairs
from tachyllm.model_config import ModelConfig

# llama.cpp's tensor names of the projections an adapter may target.
GGUF_PROJECTIONS = {
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}
LORA_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")
# The base families an adapter file's general.architecture fits (Mistral GGUFs say "llama").
COMPATIBLE_ARCHITECTURES = {
    "llama": ("llama", "mistral"),
    "qwen2": ("qwen2",),
    "qwen3": ("qwen3",),
    "gemma3": ("gemma3",),
}


def load_gguf_adapter(path: str, cfg: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """Reads and checks the GGUF LoRA file `path` for a base model of config `cfg`."""
    where = f"LoRA adapter {path!r}"
    try:
        reader = open_gguf(path)
    except ModelLoadError as e:
        raise AdapterError(f"{where}: not a readable GGUF file ({e})") from None

    def field(key: str) -> object:
        return gguf_value(reader, key)

    if field("general.type") != "adapter":
        raise AdapterError(
            f"{where}: general.type={field('general.type')!r} is not supported (a LoRA adapter file says 'adapter')"
        )
    if field("adapter.type") != "lora":
        raise AdapterError(
            f"{where}: adapter.type={field('adapter.type')!r} is not supported (only 'lora' adapters are)"
        )
    if field("adapter.alora.invocation_tokens") is not None:
        raise AdapterError(f"{where}: adapter.alora.invocation_tokens is set: activated LoRA adapters are not served")
    arch = field("general.architecture")
    if cfg.architecture not in COMPATIBLE_ARCHITECTURES.get(str(arch), ()):
        raise AdapterError(f"{where}: general.architecture={arch!r} does not fit the base model ({cfg.architecture})")
    alpha = field("adapter.lora.alpha") or 0.0
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"{where}: adapter.lora.alpha={alpha!r} is not supported (it must be a number)")

    lora_tensors = []
    for tensor in reader.tensors:
        match = LORA_TENSOR.fullmatch(tensor.name)
        if match is None or match[2] not in GGUF_PROJECTIONS:
            embedding = tensor.name.startswith(("token_embd.", "output."))
            what = "the embedding or LM head, which is not served" if embedding else "no projection LoRA is served on"
            supported = f"blk.N.{{{','.join(GGUF_PROJECTIONS)}}}.weight.lora_{{a,b}}"
            raise AdapterError(f"{where}: tensor {tensor.name!r} adapts {what} (supported: {supported})")
        if len(tensor.shape) != 2:
            raise AdapterError(
                f"{where}: tensor {tensor.name!r} has {len(tensor.shape)} dimensions; a LoRA A or B has 2"
            )
        try:
            check_dequantizable(tensor)
        except ModelLoadError as e:
            raise AdapterError(f"{where}: {e}") from None
        lora_tensors.append((tensor, int(match[1]), GGUF_PROJECTIONS[match[2]], match[3].upper()))
    if not lora_tensors:
        raise AdapterError(f"{where}: the file holds no LoRA weights")
    # The rank: A's rows, B's columns (reversed in the file: lora_a is (in, r), lora_b (r, out)).
    first, _, _, first_half = lora_tensors[0]
    rank = int(first.shape[1] if first_half == "A" else first.shape[0])
    if rank > max_lora_rank:
        raise AdapterError(f"{where}: r={rank} (tensor {first.name!r}) is above max_lora_rank={max_lora_rank}")
    # llama.cpp's scale: alpha / r, and 1 when the file has no alpha (0).
    scale = alpha / rank if alpha else 1.0
    adapter = LoRAAdapter(path, rank, float(scale), hashlib.sha256(Path(path).read_bytes()).digest())
    shapes = projection_shapes(cfg)
    rotary_order = replace(cfg, architecture=str(arch))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor, layer, proj, half in lora_tensors:
        weight = dequantized(tensor)
        check_lora_tensor(adapter, tensor.name, layer, proj, half, weight, shapes, cfg.num_layers)
        if half == "B":  # its rows are the projection's output features
            weight = fix_rotary_rows(weight, f"self_attn.{proj}.", rotary_order)
        halves.setdefault((layer, proj), {})[half] = weight.float()
    store_pairs(adapter, halves, "the file")
    return adapter
