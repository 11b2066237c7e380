"""Configuration dataclasses: what the model is (ModelConfig) and how the engine runs it (EngineConfig)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from tachyllm.errors import ConfigError
from tachyllm.spec_decode.config import SpeculativeConfig

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Weight-only quantization methods (tachyllm/quantization) and KV-cache storage types (kernels/kv_quant.py).
QUANTIZATION_METHODS = ("int8", "int4", "awq", "gguf")
QUANT_GROUP_SIZES = (32, 64, 128)
QUANT_ACTIVATION_BITS = (8, 16)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")


@dataclass
class ModelConfig:
    """Architecture hyper-parameters, independent of the file format they came from."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope_scaling dict ({"rope_type": "llama3", "factor": ..., ...}) or None.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # dtype the checkpoint was stored in; used by dtype="auto".
    checkpoint_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")


@dataclass
class EngineConfig:
    """Engine options, named as in vLLM where such a name exists."""

    model: str | None = None  # GGUF file or HF directory; None = embedded SmolLM2-135M-Instruct
    dtype: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int | None = None  # bytes; None = a share of free memory
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Cap prefill chunks so that a step with decodes takes at most this many times as long as the
    # decodes alone (predicted from measured steps); None = chunks fill max_num_batched_tokens.
    max_decode_slowdown: float | None = None
    seed: int = 0
    threads: int | None = None  # torch intra-op threads; None = OMP_NUM_THREADS or all cores
    quantization: str | None = None  # weight-only: int8, int4, awq, gguf; None = model dtype
    quant_group_size: int | None = None  # int4/awq; None = largest of 128/64/32 dividing each layer
    quant_skip: str | None = None  # comma list (lm_head, attn, mlp, name fragments); None = "lm_head"; "none"
    # Activation rounding of the C++ int4/Q8_0 kernels, per 32 inputs: 16 (default) or 8 (llama.cpp's
    # Q8_1: ~1.4x batched throughput on the default model, mean KL vs fp32 0.0044 instead of 0.0012).
    quant_activation_bits: int = 16
    kv_cache_dtype: str = "auto"  # auto (model dtype), fp8 (= fp8_e4m3), fp8_e5m2, int8
    # vLLM-style dict or JSON string, e.g. {"method": "ngram", "num_speculative_tokens": 4}; see spec_decode/config.py
    speculative_config: SpeculativeConfig | dict | str | None = None

    def __post_init__(self) -> None:
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ConfigError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or unset), got {self.quantization!r}"
            )
        if self.quant_group_size is not None and self.quant_group_size not in QUANT_GROUP_SIZES:
            raise ConfigError(
                f"quant_group_size must be one of {', '.join(map(str, QUANT_GROUP_SIZES))}, got {self.quant_group_size!r}"
            )
        if self.quant_group_size is not None and self.quantization not in ("int4", "awq"):
            raise ConfigError(f"quant_group_size applies to quantization int4 or awq, not {self.quantization!r}")
        if self.quant_activation_bits not in QUANT_ACTIVATION_BITS:
            raise ConfigError(f"quant_activation_bits must be 8 or 16, got {self.quant_activation_bits!r}")
        if self.quant_activation_bits != 16 and self.quantization not in ("int4", "awq", "gguf"):
            raise ConfigError(f"quant_activation_bits applies to quantization int4, awq or gguf, not {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be 'auto' or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_decode_slowdown is not None and not self.max_decode_slowdown > 1.0:
            raise ConfigError(f"max_decode_slowdown must be > 1.0 (or unset), got {self.max_decode_slowdown}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device!r} requested but CUDA is not available")

    def resolve_dtype(self) -> torch.dtype:
        """'auto' is bfloat16: half the bytes of fp32 per weight, and this CPU has native bf16 dot
        products (AVX512_BF16). Pass dtype='float32' for bit-faithful comparison with transformers."""
        if self.dtype == "auto":
            return torch.bfloat16
        return DTYPES[self.dtype]


def default_threads() -> int:
    env = os.environ.get("OMP_NUM_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return os.cpu_count() or 1
