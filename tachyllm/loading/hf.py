"""Hugging Face model directories: config.json -> ModelConfig, *.safetensors -> lazily read weights."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tachyllm.errors import ModelLoadError
from tachyllm.loading.hf_quantized import PrequantizedWeights, parse_quant_format
from tachyllm.loading.sentence_transformers import read_pooling
from tachyllm.loading.weights import Select, WeightSource, read_part, select_part
from tachyllm.model_config import ModelConfig
from tachyllm.option_values import DTYPES

HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "BertModel": "bert",
    "BertForSequenceClassification": "bert",
}
# model_type of a bare config (saved without a model class) -> architecture
_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "bert": "bert",
}
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_INDEX_FILE = "model.safetensors.index.json"


def load_hf(
    directory: Path,
) -> tuple[ModelConfig, Callable[[], Iterator[tuple[str, torch.Tensor]]], PrequantizedWeights | None]:
    """Config, lazy weights and, for a pre-quantized checkpoint (quantization_config), its packed
    linears, of a Hugging Face directory (the tokenizer is Tokenizer.from_hf_dir)."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ModelLoadError("directory has no config.json (expected a Hugging Face model directory)")
    cfg = read_json(config_file)
    # The architecture and the quantization format are checked before looking for weights: they
    # are the more useful complaints.
    arch = _architecture(cfg)
    quant_format = parse_quant_format(cfg["quantization_config"]) if cfg.get("quantization_config") else None
    tensors = tensor_files(directory)
    packed = PrequantizedWeights(quant_format, tensors) if quant_format is not None else None
    # A packed linear stands in for its dense weight (the stream yields it dequantized).
    names = dict(tensors)
    if packed is not None:
        names.update({f"{m}.weight": tensors[next(iter(tensors))] for m in packed.modules})
    config = hf_config(directory, cfg, arch, names)
    return config, hf_weights(tensors, config, packed), packed


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def tensor_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, read from the file headers only."""
    index = directory / _INDEX_FILE
    if index.is_file():
        files = sorted({directory / f for f in read_json(index)["weight_map"].values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{_INDEX_FILE} lists missing file(s) {', '.join(missing)}")
    else:
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ModelLoadError("no *.safetensors weight files (other formats are not supported)")
    located: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            located.update((name, file) for name in handle.keys())
    return located


def _architecture(cfg: dict[str, Any]) -> str:
    declared = cfg.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in declared if a in HF_ARCHITECTURES), None)
    if not declared and cfg.get("model_type") in _MODEL_TYPES:
        arch = _MODEL_TYPES[cfg["model_type"]]  # a bare config saved without a model class
    if arch is None:
        shown = ", ".join(declared) or f"model_type {cfg.get('model_type')!r}"
        raise ModelLoadError(f"unsupported architecture {shown} (supported: {', '.join(HF_ARCHITECTURES)})")
    return arch


def hf_config(directory: Path, cfg: dict[str, Any], arch: str, tensors: dict[str, Path]) -> ModelConfig:
    if arch == "bert":
        return _bert_config(directory, cfg, tensors)
    _check_complete(cfg["num_hidden_layers"], tensors)
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    rope_theta, rope_scaling = _rope(cfg)
    gemma = _gemma3_fields(cfg) if arch == "gemma3" else {}
    if gemma:
        rope_theta, rope_scaling = gemma.pop("rope")
    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        # Some checkpoints omit the flag and simply leave lm_head out.
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)) or "lm_head.weight" not in tensors,
        # Tensor presence is authoritative: Qwen2 always has q/k/v biases without saying so.
        attention_bias="model.layers.0.self_attn.q_proj.bias" in tensors,
        qk_norm="model.layers.0.self_attn.q_norm.weight" in tensors,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(directory, cfg),
        checkpoint_dtype=_checkpoint_dtype(cfg, tensors),
        is_matryoshka=_is_matryoshka(cfg),
        **gemma,
    )


def _is_matryoshka(cfg: dict[str, Any]) -> bool:
    """Whether the model's embeddings may be cut to their first dimensions (vLLM reads the same keys)."""
    return bool(cfg.get("is_matryoshka") or cfg.get("matryoshka_dimensions"))


def _bert_config(directory: Path, cfg: dict[str, Any], tensors: dict[str, Path]) -> ModelConfig:
    """A BERT encoder (BertModel), or a BertForSequenceClassification cross-encoder with its head, with a
    sentence-transformers folder's pooling."""
    activation = cfg.get("hidden_act", "gelu")
    if activation != "gelu":
        raise ModelLoadError(f"unsupported BERT config: hidden_act = {activation!r} (supported: gelu)")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ModelLoadError(f"unsupported BERT config: position_embedding_type = {cfg['position_embedding_type']!r}")
    classifier = "BertForSequenceClassification" in (cfg.get("architectures") or [])
    if classifier and cfg.get("problem_type") not in (None, "regression", "single_label_classification"):
        raise ModelLoadError(f"unsupported BERT classifier: problem_type = {cfg['problem_type']!r}")
    num_labels = len(cfg.get("id2label") or {}) or cfg.get("num_labels") or 2 if classifier else None
    prefix = "bert." if any(name.startswith("bert.") for name in tensors) else ""
    embedding = f"{prefix}embeddings.word_embeddings.weight"
    if embedding not in tensors:
        raise ModelLoadError(f"weight missing: {embedding}")
    if classifier and "classifier.weight" not in tensors:
        raise ModelLoadError("weight missing: classifier.weight (a BertForSequenceClassification checkpoint)")
    layers, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    missing = [
        name
        for i in range(layers)
        for name in (
            f"{prefix}encoder.layer.{i}.attention.self.query.weight",
            f"{prefix}encoder.layer.{i}.output.dense.weight",
        )
        if name not in tensors
    ]
    if missing:
        raise ModelLoadError(f"{len(missing)} weight(s) missing, e.g. {missing[0]}")
    pooling = read_pooling(directory)
    declared = cfg.get("dtype") or cfg.get("torch_dtype")
    return ModelConfig(
        architecture="bert",
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 512),
        type_vocab_size=cfg.get("type_vocab_size", 2),
        layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
        num_labels=num_labels,
        pooling_type=pooling.pooling_type,
        pooling_normalize=pooling.normalize,
        is_matryoshka=_is_matryoshka(cfg),
        max_seq_length=pooling.max_seq_length,
        checkpoint_dtype=DTYPES[declared] if declared in DTYPES else _stored_dtype(tensors, embedding),
    )


# Gemma 3's activation under its two names in configs.
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def _gemma3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's own ModelConfig fields, "rope" = the global layers' (theta, scaling). Layer types come
    from layer_types, or from the older sliding_window_pattern (every Nth layer global, 6 by default)."""
    activation = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if activation not in _GELU_TANH:
        raise ModelLoadError(f"unsupported Gemma 3 config: hidden_activation = {activation!r}")
    # Neither is in any Gemma 3 checkpoint; the attention kernels have no place for them.
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if cfg.get(key):
            raise ModelLoadError(f"unsupported Gemma 3 config: {key} = {cfg[key]!r}")
    layers = cfg["num_hidden_layers"]
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if len(types) != layers or unknown:
        raise ModelLoadError(f"config layer_types must name {layers} sliding_attention / full_attention layers")
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers >= 5: one rope dict per layer type
        rope = _rope({"rope_theta": 1_000_000.0, "rope_parameters": params["full_attention"]})
        local_theta = (params.get("sliding_attention") or {}).get("rope_theta", 10_000.0)
    else:
        rope = _rope({"rope_theta": 1_000_000.0, **cfg})
        local_theta = cfg.get("rope_local_base_freq", 10_000.0)
    return {
        "rope": rope,
        "query_pre_attn_scalar": cfg.get("query_pre_attn_scalar", 256),
        "sliding_window": cfg.get("sliding_window"),
        "sliding_layers": tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        "rope_local_theta": float(local_theta),
        "final_logit_softcapping": cfg.get("final_logit_softcapping"),
    }


def hf_weights(
    tensors: dict[str, Path], config: ModelConfig, packed: PrequantizedWeights | None = None
) -> WeightSource:
    by_file: dict[Path, list[str]] = {}
    stored_packed = packed.stored_names() if packed is not None else set()
    for name, file in tensors.items():
        tied_head = name == "lm_head.weight" and config.tie_word_embeddings
        # Old checkpoints saved the rotary cache as a buffer; it is recomputed, not loaded.
        if not tied_head and not name.endswith("rotary_emb.inv_freq") and name not in stored_packed:
            by_file.setdefault(file, []).append(name)

    def weights(
        select: Select | None = None, leave_out: frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for file, names in by_file.items():
            with safe_open(file, framework="pt") as handle:
                for name in names:
                    if name not in leave_out:
                        yield name, read_part(handle, name, select)
        for module in packed.modules if packed is not None else ():
            name = f"{module}.weight"
            if not (module == "lm_head" and config.tie_word_embeddings) and name not in leave_out:
                assert packed is not None, "the loop runs over its modules"
                yield name, select_part(select, name, packed.read(module).dequantize())

    return weights


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """transformers >= 5 writes rope_parameters (theta included); older configs rope_theta + rope_scaling."""
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = {k: v for k, v in (cfg.get("rope_scaling") or params).items() if k != "rope_theta"}
    kind = scaling.pop("type", None)
    scaling.setdefault("rope_type", kind or "default")
    return theta, None if scaling["rope_type"] == "default" else scaling


def _eos_ids(directory: Path, cfg: dict[str, Any]) -> list[int]:
    """config.json's eos plus generation_config.json's, which often adds the chat end-of-turn token."""
    ids: list[int] = []
    sources = [cfg]
    generation = directory / "generation_config.json"
    if generation.is_file():
        sources.append(read_json(generation))
    for source in sources:
        value = source.get("eos_token_id")
        ids.extend([value] if isinstance(value, int) else value or [])
    return list(dict.fromkeys(ids))


def _checkpoint_dtype(cfg: dict[str, Any], tensors: dict[str, Path]) -> torch.dtype:
    declared = cfg.get("dtype") or cfg.get("torch_dtype")
    if declared in DTYPES:
        return DTYPES[declared]
    # Undeclared: the embedding's storage type is what the weights really are.
    return _stored_dtype(tensors, "model.embed_tokens.weight")


def _stored_dtype(tensors: dict[str, Path], name: str) -> torch.dtype:
    with safe_open(tensors[name], framework="pt") as handle:
        return _SAFETENSORS_DTYPES.get(handle.get_slice(name).get_dtype(), torch.float32)


def _check_complete(num_layers: int, tensors: dict[str, Path]) -> None:
    """Fail at load time, not halfway through building the model, on a partial download."""
    layer_parts = [
        "input_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "post_attention_layernorm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ]
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    required += [f"model.layers.{i}.{part}" for i in range(num_layers) for part in layer_parts]
    missing = [name for name in required if name not in tensors]
    if missing:
        raise ModelLoadError(f"{len(missing)} weight(s) missing, e.g. {missing[0]}")
