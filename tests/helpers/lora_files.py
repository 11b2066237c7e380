"""Tiny random LoRA adapters written in PEFT's exact on-disk format, and the base model with an adapter's
W + scale · B · A merged in (the reference an unmerged adapter must match)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODULE_OF = {p: "self_attn" for p in ALL_TARGETS[:4]} | {p: "mlp" for p in ALL_TARGETS[4:]}


def _shapes(model_dir: Path) -> tuple[dict[str, tuple[int, int]], int]:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }  # fmt: skip
    return shapes, cfg["num_hidden_layers"]


def adapter_key(layer: int, proj: str, half: str) -> str:
    return f"base_model.model.model.layers.{layer}.{MODULE_OF[proj]}.{proj}.lora_{half}.weight"


def write_adapter(
    directory: Path,
    model_dir: Path,
    targets: list[str],
    rank: int = 4,
    alpha: float = 8,
    use_rslora: bool = False,
    seed: int = 0,
    config_overrides: dict | None = None,
    tensor_overrides: dict[str, torch.Tensor | None] | None = None,
) -> Path:
    """A random adapter (B not zero, unlike PEFT's init, so that it changes the output) as PEFT saves one."""
    shapes, num_layers = _shapes(model_dir)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for proj in targets:
            in_features, out_features = shapes[proj]
            tensors[adapter_key(layer, proj, "A")] = torch.randn(rank, in_features, generator=gen) * 0.2
            tensors[adapter_key(layer, proj, "B")] = torch.randn(out_features, rank, generator=gen) * 0.2
    for key, value in (tensor_overrides or {}).items():
        if value is None:
            tensors.pop(key)
        else:
            tensors[key] = value
    config = {
        "alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": str(model_dir), "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "layers_pattern": None,
        "layers_to_transform": None, "lora_alpha": alpha, "lora_dropout": 0.0, "modules_to_save": None,
        "peft_type": "LORA", "r": rank, "rank_pattern": {}, "revision": None, "target_modules": targets,
        "task_type": "CAUSAL_LM", "use_dora": False, "use_rslora": use_rslora,
    }  # fmt: skip
    config.update(config_overrides or {})
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, directory / "adapter_model.safetensors", metadata={"format": "pt"})
    return directory


def merge_adapter(model_dir: Path, adapter_dir: Path, into: Path) -> Path:
    """A copy of the base checkpoint with W + scale · B · A for every projection the adapter targets."""
    shutil.copytree(model_dir, into)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    rank = config["r"]
    scale = config["lora_alpha"] / (math.sqrt(rank) if config["use_rslora"] else rank)
    lora = load_file(adapter_dir / "adapter_model.safetensors")
    weights = load_file(model_dir / "model.safetensors")
    _, num_layers = _shapes(model_dir)
    for layer in range(num_layers):
        for proj in config["target_modules"]:
            a, b = lora[adapter_key(layer, proj, "A")], lora[adapter_key(layer, proj, "B")]
            name = f"model.layers.{layer}.{MODULE_OF[proj]}.{proj}.weight"
            weights[name] = (weights[name].double() + scale * (b.double() @ a.double())).to(weights[name].dtype)
    save_file(weights, into / "model.safetensors", metadata={"format": "pt"})
    return into


# llama.cpp's tensor names of the seven projections (blk.N.<name>.weight.lora_a / .lora_b).
GGUF_NAMES = {
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
    "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
}  # fmt: skip


def _rotary_interleave(b: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order for a llama model: each head's rows from HF's half-split
    rotary layout to interleaved pairs (applied to B, whose rows are the projection's outputs)."""
    return b.reshape(heads, 2, b.shape[0] // heads // 2, *b.shape[1:]).transpose(1, 2).reshape(b.shape)


def write_gguf_adapter(
    path: Path,
    model_dir: Path,
    peft_dir: Path,
    quantize_a: bool = False,
    metadata: dict[str, object] | None = None,
    extra_tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """The PEFT adapter in `peft_dir` as llama.cpp's convert_lora_to_gguf.py writes it for a llama base:
    general.type adapter, adapter.type lora, adapter.lora.alpha, A [r, in] and B [out, r] per projection
    (the file's dimensions reversed), B of attn_q / attn_k in llama.cpp's rotary row order.
    `quantize_a`: A stored as Q8_0 blocks. `metadata`: string / float keys to set (None: left out)."""
    import gguf
    from gguf.quants import quantize

    config = json.loads((peft_dir / "adapter_config.json").read_text())
    model_cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = {"q_proj": model_cfg["num_attention_heads"], "k_proj": model_cfg["num_key_value_heads"]}
    lora = load_file(peft_dir / "adapter_model.safetensors")
    fields: dict[str, object] = {
        "general.type": "adapter", "adapter.type": "lora", "adapter.lora.alpha": float(config["lora_alpha"]),
    }  # fmt: skip
    fields.update(metadata or {})
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in fields.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif value is not None:
            writer.add_float32(key, float(value))
    _, num_layers = _shapes(model_dir)
    for layer in range(num_layers):
        for proj in config["target_modules"]:
            a, b = lora[adapter_key(layer, proj, "A")], lora[adapter_key(layer, proj, "B")]
            if proj in heads:
                b = _rotary_interleave(b, heads[proj])
            name = f"blk.{layer}.{GGUF_NAMES[proj]}.weight"
            if quantize_a:
                kind = gguf.GGMLQuantizationType.Q8_0
                writer.add_tensor(f"{name}.lora_a", quantize(a.numpy(), kind), raw_dtype=kind)
            else:
                writer.add_tensor(f"{name}.lora_a", a.numpy())
            writer.add_tensor(f"{name}.lora_b", b.contiguous().numpy())
    for name, tensor in (extra_tensors or {}).items():
        writer.add_tensor(name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
