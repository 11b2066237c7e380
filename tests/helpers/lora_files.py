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
