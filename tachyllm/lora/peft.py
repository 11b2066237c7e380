"""A LoRA adapter read from PEFT's on-disk format (adapter_config.json + adapter_model.safetensors) and
checked against the base model: every variant the engine does not run fails here, in one error that
names the field and its value, before any request uses the adapter."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tachyllm.errors import AdapterError
from tachyllm.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target (PEFT's module names, one decoder layer's).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT's shorthand for every linear of the decoder layers (the LM head excluded).
ALL_LINEAR = "all-linear"
# Targets of the embedding / LM head, which the engine does not adapt.
UNSUPPORTED_TARGETS = ("embed_tokens", "lm_head")
# PEFT's keys: base_model.model.model.layers.N.<self_attn|mlp>.<proj>.lora_<A|B>[.adapter name].weight
WEIGHT_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight"
)


@dataclass
class LoRAAdapter:
    """One adapter's weights, fp32: (layer index, projection) -> (A [r, in], B [out, r]); its update
    of a projection is scale · B · A."""

    path: str
    rank: int
    scale: float
    digest: bytes  # sha256 of its config and weights files: the prefix cache's key for it
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in features, out features) of each targetable projection of the base model."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def load_peft_adapter(path: str, cfg: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """Reads and checks the PEFT adapter in directory `path` for a base model of config `cfg`."""
    directory = Path(path)
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for f in (config_file, weights_file):
        if not f.is_file():
            raise AdapterError(f"LoRA adapter {path!r} has no {f.name} (PEFT format: {CONFIG_FILE} + {WEIGHTS_FILE})")
    config_bytes, weights_bytes = config_file.read_bytes(), weights_file.read_bytes()
    try:
        config = json.loads(config_bytes)
    except json.JSONDecodeError as e:
        raise AdapterError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"LoRA adapter {path!r}: {CONFIG_FILE} must hold a JSON object")
    rank, scale, targets = _check_config(config, path, max_lora_rank)
    digest = hashlib.sha256(config_bytes + b"\0" + weights_bytes).digest()
    adapter = LoRAAdapter(path, rank, scale, digest)
    _read_weights(adapter, weights_bytes, targets, projection_shapes(cfg), cfg.num_layers)
    return adapter


def _check_config(config: dict, path: str, max_lora_rank: int) -> tuple[int, float, set[str]]:
    """(rank, scale, targeted projections) of a PEFT LoRA config; raises AdapterError for what the engine
    does not run."""

    def refuse(name: str, why: str) -> AdapterError:
        return AdapterError(f"LoRA adapter {path!r}: {name}={config.get(name)!r} is not supported ({why})")

    if config.get("peft_type", "LORA") != "LORA":
        raise refuse("peft_type", "only LORA adapters are")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise refuse("r", "the rank must be a positive integer")
    if rank > max_lora_rank:
        raise AdapterError(f"LoRA adapter {path!r}: r={rank} is above max_lora_rank={max_lora_rank}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise refuse("lora_alpha", "it must be a number")
    if config.get("use_dora"):
        raise refuse("use_dora", "DoRA adapters are not served")
    if config.get("modules_to_save"):
        raise refuse("modules_to_save", "fully trained modules besides the LoRA weights are not served")
    if config.get("bias", "none") != "none":
        raise refuse("bias", "only bias 'none' is served")
    if config.get("lora_bias"):
        raise refuse("lora_bias", "LoRA B biases are not served")
    for per_module in ("rank_pattern", "alpha_pattern"):
        if config.get(per_module):
            raise refuse(per_module, "every projection must have the adapter's own r and lora_alpha")
    targets = config.get("target_modules")
    if targets == ALL_LINEAR:
        targets = list(TARGET_MODULES)
    elif isinstance(targets, str):
        targets = [targets]  # a single name (PEFT would read other strings as a regex)
    if not isinstance(targets, list) or not targets:
        raise refuse("target_modules", f"list some of {', '.join(TARGET_MODULES)}")
    projections = set()
    for name in targets:
        # PEFT matches a name against the end of a module's path, and saves "all-linear" as the full
        # paths it matched (model.layers.0.self_attn.q_proj): the projection is the last part.
        projection = name.rsplit(".", 1)[-1] if isinstance(name, str) else name
        if projection in UNSUPPORTED_TARGETS:
            raise AdapterError(
                f"LoRA adapter {path!r}: target_modules contains {name!r}, which is not supported "
                "(embedding and LM-head targets are not served)"
            )
        if projection not in TARGET_MODULES:
            raise AdapterError(
                f"LoRA adapter {path!r}: target_modules contains {name!r}, which is not supported "
                f"(supported: {', '.join(TARGET_MODULES)})"
            )
        projections.add(projection)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scale, projections


def _read_weights(
    adapter: LoRAAdapter, data: bytes, targets: set[str], shapes: dict[str, tuple[int, int]], num_layers: int
) -> None:
    """Fills adapter.weights from the safetensors bytes, checking every key and shape."""
    from safetensors.torch import load  # the loaders' dependency already

    where = f"LoRA adapter {adapter.path!r}"
    try:
        tensors = load(data)
    except Exception as e:  # safetensors' own errors name no common class
        raise AdapterError(f"{where}: {WEIGHTS_FILE} cannot be read ({e})") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if "lora_magnitude_vector" in key:
            raise AdapterError(f"{where}: tensor {key!r} is a DoRA magnitude, which is not served")
        if any(name in key for name in UNSUPPORTED_TARGETS):
            raise AdapterError(f"{where}: tensor {key!r} adapts the embedding or LM head, which is not served")
        match = WEIGHT_KEY.fullmatch(key)
        if match is None:
            raise AdapterError(f"{where}: tensor {key!r} is not a LoRA weight of a decoder layer's projection")
        layer, proj, half = int(match[1]), match[2], match[3]
        if proj not in targets:
            raise AdapterError(f"{where}: tensor {key!r} adapts {proj}, which target_modules does not list")
        check_lora_tensor(adapter, key, layer, proj, half, tensor, shapes, num_layers)
        halves.setdefault((layer, proj), {})[half] = tensor.float()
    store_pairs(adapter, halves, WEIGHTS_FILE)


def check_lora_tensor(
    adapter: LoRAAdapter,
    key: str,
    layer: int,
    proj: str,
    half: str,
    tensor: torch.Tensor,
    shapes: dict[str, tuple[int, int]],
    num_layers: int,
) -> None:
    """Checks one A (`half` "A": [r, in]) or B ([out, r]) of a projection against the base model."""
    where = f"LoRA adapter {adapter.path!r}"
    if layer >= num_layers:
        raise AdapterError(f"{where}: tensor {key!r} is for layer {layer}; the base model has {num_layers}")
    in_features, out_features = shapes[proj]
    expected = (adapter.rank, in_features) if half == "A" else (out_features, adapter.rank)
    if tuple(tensor.shape) != expected:
        raise AdapterError(
            f"{where}: tensor {key!r} has shape {tuple(tensor.shape)}; the base model's {proj} with "
            f"r={adapter.rank} needs {expected}"
        )


def store_pairs(adapter: LoRAAdapter, halves: dict[tuple[int, str], dict[str, torch.Tensor]], source: str) -> None:
    """Fills adapter.weights from each projection's checked halves; refuses a half without the other."""
    where = f"LoRA adapter {adapter.path!r}"
    for (layer, proj), pair in sorted(halves.items()):
        if len(pair) != 2:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise AdapterError(f"{where}: layer {layer}'s {proj} has no {missing} weight")
        adapter.weights[(layer, proj)] = (pair["A"].contiguous(), pair["B"].contiguous())
    if not adapter.weights:
        raise AdapterError(f"{where}: {source} holds no LoRA weights")
