"""Configuration dataclasses: what the model is (ModelConfig) and how the engine runs it (EngineConfig)."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from tachyllm.argtypes import byte_size
from tachyllm.chat_template import chat_template_flag, read_chat_template
from tachyllm.errors import ConfigError
from tachyllm.sampling_params import MAX_LOGPROBS
from tachyllm.speculative_config import SpeculativeConfig

logger = logging.getLogger("tachyllm")

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# vLLM's other spellings of --dtype.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}

# Weight-only quantization methods (tachyllm/quantization) and KV-cache storage types (kernels/kv_quant.py).
# awq, gptq, compressed-tensors also name a pre-quantized checkpoint's format (its quantization_config decides).
QUANTIZATION_METHODS = ("int8", "int4", "awq", "gguf", "fp8", "gptq", "compressed-tensors")
QUANT_GROUP_SIZES = (32, 64, 128)
QUANT_ACTIVATION_BITS = (8, 16)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
# How CPU tensor-parallel ranks sum their partial results (docs/tensor_parallel.md).
TP_ALL_REDUCES = ("shm", "gloo")
# Execution backends (tachyllm/backends): auto = cuda on a GPU, cpu where the C++ kernels run, else torch.
BACKENDS = ("auto", "torch", "cpu", "cuda")


def option(default: Any, help: str, *, choices: Sequence | None = None, parse: Callable[[str], Any] | None = None):
    """An EngineConfig field that is also a command-line flag (tachyllm/engine_args.py builds it
    from this metadata). `choices`: the values the flag accepts; `parse`: turns the flag's text into the value
    when the field's type does not say how (byte sizes, a JSON string)."""
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if parse is not None:
        metadata["parse"] = parse
    return field(default=default, metadata=metadata)


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
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Gemma 3)
    # Gemma 3. Attention scale query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5).
    query_pre_attn_scalar: float | None = None
    # Sliding-window attention: the layers whose index is in `sliding_layers` see only the last
    # `sliding_window` positions (their own included), and rotate with `rope_local_theta` (unscaled).
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None
    final_logit_softcapping: float | None = None  # logits <- cap * tanh(logits / cap)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # dtype the checkpoint was stored in; used by dtype="auto".
    checkpoint_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        self.sliding_layers = tuple(self.sliding_layers)  # a JSON list when read back from the checkpoint cache
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.sliding_layers and not (self.sliding_window or 0) >= 1:
            raise ConfigError(f"sliding-window layers need sliding_window >= 1, got {self.sliding_window!r}")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer's attention, or None where it sees its whole context."""
        return self.sliding_window if layer in self.sliding_layers else None


@dataclass
class EngineConfig:
    """Engine options, named as in vLLM where such a name exists. Each field is also a command-line flag,
    --field-name-with-dashes, generated from its `option` metadata (tachyllm/engine_args.py)."""

    model: str | None = option(
        None, "GGUF file or Hugging Face model directory (default: embedded SmolLM2-135M-Instruct)"
    )
    tokenizer: str | None = option(
        None,
        "a tokenizer to use instead of the model's: a Hugging Face tokenizer directory (tokenizer.json) or a GGUF"
        " file, a local path (default: the model's own)",
    )
    dtype: str = option(
        "auto",
        "weights and activations dtype; auto = bfloat16; half = float16, float = float32 (vLLM's aliases)",
        choices=("auto", *DTYPES, *DTYPE_ALIASES),
    )
    device: str = option("cpu", "cpu or cuda[:N]")
    max_model_len: int | None = option(None, "context length limit (default: the model's max_position_embeddings)")
    block_size: int = option(16, "tokens per KV-cache block")
    max_num_seqs: int = option(256, "sequences running at once")
    max_num_batched_tokens: int | None = option(
        None, "token budget of one step (default: 2048 on the CPU; 8192 on a GPU, as vLLM's server on large GPUs)"
    )
    kv_cache_memory: int | None = option(
        None, "KV cache size in bytes, e.g. 2G (default: a share of free memory)", parse=byte_size
    )
    enable_prefix_caching: bool = option(
        True, "prefix caching: a prompt reuses the KV cache of a prefix computed before (default: on)"
    )
    enable_chunked_prefill: bool = option(
        True, "chunked prefill: long prompts run in chunks beside running decodes (default: on)"
    )
    # Cap prefill chunks so that a step with decodes takes at most this many times as long as the
    # decodes alone (predicted from measured steps); None = chunks fill max_num_batched_tokens.
    max_decode_slowdown: float | None = option(
        None,
        "cut prefill chunks so that steps with running decodes take at most this factor of the decodes' own step,"
        " e.g. 2 (default: off)",
    )
    seed: int = option(0, "engine seed for requests without their own")
    threads: int | None = option(
        None, "compute threads (default: OMP_NUM_THREADS, or the usable CPUs: affinity mask, cgroup CPU quota)"
    )
    quantization: str | None = option(
        None,
        "weight quantization: int8, int4, awq, gguf (weight-only), fp8 (per-channel e4m3 weights, per-token"
        " dynamic activations; Hopper GPUs or the CPU); a pre-quantized checkpoint's own (awq, gptq,"
        " compressed-tensors) is used automatically (default: none, or the checkpoint's quantization_config)",
    )
    quant_group_size: int | None = option(
        None, "int4/awq group size: 32, 64 or 128 (default: largest that divides each layer)"
    )
    quant_skip: str | None = option(
        None, "layers kept unquantized, comma list: lm_head, attn, mlp, name fragments, or none (default: lm_head)"
    )
    # Activation rounding of the C++ block kernels, per 32 inputs. Unset: a GGUF file's blocks (gguf) take
    # llama.cpp's 8 bits when a check at load finds the model's next-token distributions within KL 0.01
    # of 16 bits', else 16; other formats 16 (quantization/activation_bits.py).
    quant_activation_bits: int | None = option(
        None,
        "activation rounding of the int4/gguf C++ kernels, per 32 inputs: 8 (llama.cpp's: faster batches) or 16"
        " (closer to unrounded) (default: gguf 8 where a check at load measures KL(16 || 8) <= 0.01 on"
        " calibration text, median of 4 windows, kept between starts; else 16; other formats 16)",
        choices=QUANT_ACTIVATION_BITS,
    )
    kv_cache_dtype: str = option("auto", "KV cache storage: auto (model dtype), fp8 (= fp8_e4m3), fp8_e5m2, int8")
    # vLLM-style dict or JSON string; see speculative_config.py for the keys
    speculative_config: SpeculativeConfig | dict | str | None = option(
        None,
        'speculative decoding, JSON: {"method": "ngram", "num_speculative_tokens": 4} or'
        ' {"method": "draft_model", "model": "PATH|self:int4|self:layers=N", "num_speculative_tokens": 4}',
        parse=str,
    )
    # Batch invariance (docs/determinism.md): bf16 linears run the C++ kernel at every row count; off,
    # steps above NATIVE_MAX_ROWS tokens use oneDNN where it packs bf16 (AVX-512), faster for long
    # prefills. float32 is invariant either way.
    deterministic: bool = option(
        True,
        "batch-invariant outputs: the same tokens whether a prefix was cached, how the prompt was chunked, what"
        " else was in the batch (default: on; --no-deterministic: oneDNN for large steps, faster long prefills)",
    )
    # "auto": the model directory's generation_config.json (vLLM's default); "vllm": none; else a folder holding one.
    generation_config: str = option(
        "auto",
        "default sampling values of requests that set none (temperature, top_p, top_k, min_p, repetition_penalty,"
        " max_tokens): auto = the model's generation_config.json, vllm = tachyllm's own defaults, or a FOLDER"
        " holding a generation_config.json",
    )
    gpu_memory_utilization: float | None = option(
        None,
        "fraction (0-1] of a CUDA device's memory for this engine (weights, KV cache) as in vLLM; the KV cache gets"
        " what the weights leave; ignored on the CPU (default: 0.9 on CUDA)",
    )
    chat_template: str | None = option(
        None,
        "a Jinja chat template replacing the model's: a file, or the template itself (default: the model's)",
        parse=chat_template_flag,
    )
    backend: str = option(
        "auto",
        "execution backend: cpu (tachyllm's C++ kernels), cuda (Triton kernels on the GPU), torch (portable PyTorch"
        " ops); auto = cuda on a CUDA device when triton imports, cpu when the device is the CPU and the kernels"
        " built, else torch",
        choices=BACKENDS,
    )
    # Structured outputs (docs/structured_outputs.md): what one request's constraint may cost.
    max_constraint_bytes: int = option(
        256 << 10,
        "structured outputs: largest constraint (JSON schema, regex, grammar, choices, tools' grammar) in bytes,"
        " e.g. 1M; a larger one is refused (default: 256K)",
        parse=byte_size,
    )
    constraint_compile_timeout: float = option(
        10.0,
        "structured outputs: seconds a request waits for its constraint to compile; past it the request is refused"
        " (the compile finishes in the background and is cached) (default: 10)",
    )
    max_logprobs: int = option(
        MAX_LOGPROBS,
        "most alternatives a request may ask for per token (logprobs, top_logprobs, prompt_logprobs); more is"
        " refused; -1 = the whole vocabulary (default: 20)",
    )
    # vLLM's flag name. Graphs need a CUDA device and a backend whose step metadata they can capture.
    enforce_eager: bool = option(
        False,
        "no CUDA graphs: every step runs eagerly (default: decode-only steps replay graphs captured at start-up"
        " for batch-size buckets, on a CUDA device with a backend that supports them)",
    )

    # Tensor parallelism (docs/tensor_parallel.md): the engine starts N - 1 worker processes; each rank holds
    # 1/N of every layer and joins one all-reduce after attention and one after the MLP.
    tensor_parallel_size: int = option(
        1, "split the model over this many processes (tensor parallelism: gloo on the CPU, NCCL on CUDA) (default: 1)"
    )
    tp_cpu_binding: bool = option(
        False,
        "tensor parallelism on the CPU: pin each rank's threads to its own share of the usable cores (its NUMA node"
        " when there is one node per rank) (default: off)",
    )
    # None: shm where it can be had (the C++ kernels built, room in /dev/shm), else gloo.
    tp_all_reduce: str | None = option(
        None,
        "tensor parallelism on the CPU: the ranks' per-layer sums over shared memory (shm) or gloo's all-reduce"
        " (gloo) (default: shm where the C++ kernels built; CUDA ranks use NCCL)",
        choices=TP_ALL_REDUCES,
    )

    def __post_init__(self) -> None:
        self._parse_byte_sizes()
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.max_num_batched_tokens is None:
            # On a GPU a step's overhead is its launches, not its tokens: fewer, larger prefill steps.
            self.max_num_batched_tokens = 8192 if self.device.startswith("cuda") else 2048
        if self.chat_template is not None:
            self.chat_template = read_chat_template(self.chat_template)
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ConfigError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or unset), got {self.quantization!r}"
            )
        if self.quant_group_size is not None and self.quant_group_size not in QUANT_GROUP_SIZES:
            raise ConfigError(
                f"quant_group_size must be one of {', '.join(map(str, QUANT_GROUP_SIZES))}, "
                f"got {self.quant_group_size!r}"
            )
        if self.quant_group_size is not None and self.quantization not in ("int4", "awq"):
            raise ConfigError(f"quant_group_size applies to quantization int4 or awq, not {self.quantization!r}")
        if self.quant_activation_bits not in (None, *QUANT_ACTIVATION_BITS):
            raise ConfigError(f"quant_activation_bits must be 8 or 16, got {self.quant_activation_bits!r}")
        # Unset quantization may still mean a pre-quantized checkpoint's (checked once it is read).
        if self.quant_activation_bits == 8 and self.quantization in ("int8", "fp8"):
            raise ConfigError(
                f"quant_activation_bits applies to quantization int4, awq, gguf, gptq or compressed-tensors, "
                f"not {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be 'auto' or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
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
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tp_all_reduce is not None and self.tp_all_reduce not in TP_ALL_REDUCES:
            raise ConfigError(f"tp_all_reduce must be shm or gloo (or unset), got {self.tp_all_reduce!r}")
        if self.tp_all_reduce is not None and self.device.startswith("cuda"):
            raise ConfigError(f"tp_all_reduce={self.tp_all_reduce!r} is for CPU ranks; CUDA ranks all-reduce with NCCL")
        if self.max_logprobs < -1:
            raise ConfigError(f"max_logprobs must be >= 0, or -1 for the whole vocabulary, got {self.max_logprobs}")
        if self.max_constraint_bytes < 1:
            raise ConfigError(f"max_constraint_bytes must be >= 1, got {self.max_constraint_bytes}")
        if not self.constraint_compile_timeout > 0:
            raise ConfigError(f"constraint_compile_timeout must be > 0 seconds, got {self.constraint_compile_timeout}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device!r} requested but CUDA is not available")
        if self.backend != "auto":
            from tachyllm.backends import resolve_backend_name  # the backends import the model layers' kernels

            resolve_backend_name(self.backend, torch.device(self.device))

    def _parse_byte_sizes(self) -> None:
        """Byte-size options given as text (LLM(kv_cache_memory="2G"), as on the command line) parsed as their
        flag parses them; anything but a whole number of bytes or such a text is refused, naming the option."""
        for option_field in fields(self):
            value = getattr(self, option_field.name)
            if option_field.metadata.get("parse") is not byte_size or value is None:
                continue
            try:
                parsed = byte_size(value) if isinstance(value, str) else value
            except ValueError:
                parsed = None
            if not isinstance(parsed, int) or isinstance(parsed, bool):
                raise ConfigError(
                    f"{option_field.name} must be a number of bytes or a size such as 512M or 2G, got {value!r}"
                )
            setattr(self, option_field.name, parsed)

    def resolve_dtype(self) -> torch.dtype:
        """'auto' is bfloat16: half the bytes of fp32 per weight, multiplied by the C++ kernel with
        AVX512_BF16 dot products (or widened to fp32 in registers on AVX2 CPUs). Pass dtype='float32'
        for bit-faithful comparison with transformers."""
        if self.dtype == "auto":
            return torch.bfloat16
        return DTYPES[self.dtype]


# Where the CPU limits are read; module attributes so that tests can point them elsewhere.
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, ValueError):
        return None


def _quota(quota: str, period: str) -> float | None:
    """CPUs a CFS quota allows, or None for no limit ("max" in v2, -1 in v1)."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_cpu_quota() -> float | None:
    """The tightest CPU quota (in CPUs, e.g. 1.5) of this process's cgroup and its parents, as a
    container runtime or Kubernetes `resources.limits.cpu` sets it; None when there is none.
    cgroup v2: `cpu.max` ("QUOTA PERIOD" or "max PERIOD"); v1: cpu.cfs_quota_us / cpu.cfs_period_us."""
    dirs: list[Path] = []
    own = _read(PROC_SELF_CGROUP) or ""
    for line in own.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        rel = path.strip().lstrip("/")
        if hierarchy == "0" and controllers == "":  # v2: "0::/path"
            base = CGROUP_ROOT
        elif "cpu" in controllers.split(","):  # v1: "N:cpu,cpuacct:/path"
            mounts = [CGROUP_ROOT / d for d in ("cpu", "cpu,cpuacct", "cpuacct,cpu") if (CGROUP_ROOT / d).is_dir()]
            if not mounts:
                continue
            base = mounts[0]
        else:
            continue
        d = base / rel if rel else base
        while True:  # the cgroup and every parent up to the mount point (a container sees its own root)
            dirs.append(d)
            if d == base:
                break
            d = d.parent
    dirs += [CGROUP_ROOT, CGROUP_ROOT / "cpu", CGROUP_ROOT / "cpu,cpuacct"]  # when /proc/self/cgroup is unreadable
    limits = []
    for d in dict.fromkeys(dirs):
        v2 = _read(d / "cpu.max")
        if v2:
            parts = v2.split()
            if len(parts) == 2:
                limits.append(_quota(*parts))
        v1q, v1p = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
        if v1q and v1p:
            limits.append(_quota(v1q, v1p))
    known = [q for q in limits if q is not None]
    return min(known) if known else None


def available_cpus() -> int:
    """CPUs this process may use: the affinity mask (taskset, cpusets, `docker --cpuset-cpus`), capped
    by a cgroup CPU quota rounded up (`docker --cpus 1.5`, Kubernetes CPU limits: 2). os.cpu_count()
    counts the machine's CPUs, which is too many inside a container or under taskset."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, math.ceil(quota - 1e-6))
    return max(1, cpus)


def default_threads() -> int:
    """OMP_NUM_THREADS if set, else every CPU this process may use (available_cpus). Warns when other
    processes already keep the cores busy (warn_if_busy)."""
    env = os.environ.get("OMP_NUM_THREADS")
    threads = int(env) if env and env.isdigit() and int(env) > 0 else available_cpus()
    warn_if_busy(threads)
    return threads


# libgomp's idle threads spin up to GOMP_SPINCOUNT iterations (default 300,000) before they
# sleep; on cores shared with another busy process that spinning collapses decoding
# (docs/cpu_fast_path.md#threads). 300 avoids the collapse but slows a quiet machine's single
# stream, so it is advice, not a default (measurements: docs/design_measurements.md#openmp-spin-count).
LOW_SPINCOUNT = 300
OMP_WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def warn_if_busy(threads: int) -> None:
    """A warning when the 1-minute load average (other processes: the engine has not started yet) plus
    this engine's threads exceeds the usable CPUs by half a CPU or more, with the two remedies measured."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return
    cpus = available_cpus()
    if load + threads <= cpus + 0.5:
        return
    fewer = max(1, cpus - round(load))
    spin = ""
    if not any(os.environ.get(k) for k in OMP_WAIT_ENV):
        spin = (f"; or start the process with GOMP_SPINCOUNT={LOW_SPINCOUNT} (OpenMP threads then sleep"
                " instead of spinning while they wait: decoding slows in proportion to its CPU share)")  # fmt: skip
    logger.warning(
        "load average %.1f on %d usable CPUs: other processes share the cores with the %d compute threads. "
        "If decoding is slow, --threads %d (or OMP_NUM_THREADS) leaves them their cores%s",
        load, cpus, threads, fewer, spin,
    )  # fmt: skip
