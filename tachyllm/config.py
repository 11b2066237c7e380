"""EngineConfig: how the engine runs a model. Users write its options flat (LLM(**kwargs), the CLI flags
generated from it, models.yaml); the engine's parts take the groups it exposes (`cache_config`,
`scheduler_config`, `quant_config`, `parallel_config`, `backend_config`, `speculative_config`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from tachyllm.argtypes import boolean, byte_size
from tachyllm.chat_template import chat_template_flag, read_chat_template
from tachyllm.errors import ConfigError
from tachyllm.option_values import (
    BACKENDS,
    CONVERTS,
    DETAILED_TRACE_MODULES,
    DTYPE_ALIASES,
    DTYPES,
    KV_CACHE_DTYPES,
    LORA_DTYPES,
    OMP_THREADS_BIND,
    POOLING_TYPES,
    QUANT_ACTIVATION_BITS,
    QUANT_GROUP_SIZES,
    QUANTIZATION_METHODS,
    RUNNERS,
    TASKS,
    TP_ALL_REDUCES,
)
from tachyllm.sampling_params import MAX_LOGPROBS
from tachyllm.speculative_config import SpeculativeConfig


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


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache: its blocks, their storage, its size and prefix caching (EngineConfig.cache_config)."""

    block_size: int
    kv_cache_dtype: str
    enable_prefix_caching: bool
    kv_cache_memory: int | None = None  # bytes; None: sized from the free memory
    gpu_memory_utilization: float | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    """What one step may schedule (EngineConfig.scheduler_config; the Scheduler takes it)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    max_decode_slowdown: float | None = None
    max_loras: int | None = None  # distinct LoRA adapters in one step (None: no adapters served)


@dataclass(frozen=True)
class QuantConfig:
    """Weight quantization as build_model applies it (EngineConfig.quant_config; a draft model has its own).
    None means unset: dense weights or a pre-quantized checkpoint's own method, the largest group size that
    divides each layer, the default skip list, quantization/activation_bits.py's rounding rule."""

    method: str | None = None
    group_size: int | None = None
    skip: str | None = None
    activation_bits: int | None = None


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (EngineConfig.parallel_config; docs/tensor_parallel.md)."""

    tensor_parallel_size: int
    tp_cpu_binding: bool
    tp_all_reduce: str | None = None


@dataclass(frozen=True)
class BackendConfig:
    """Where and on which kernels the model runs (EngineConfig.backend_config)."""

    backend: str
    device: str
    dtype: str
    deterministic: bool
    enforce_eager: bool
    threads: int | None = None


@dataclass
class EngineConfig:
    """Engine options, named as in vLLM where such a name exists. Each field is also a command-line flag,
    --field-name-with-dashes, generated from its `option` metadata (tachyllm/engine_args.py). The fields
    stay flat, as users write them; the properties below group them for the parts of the engine that
    take them, read from the fields at each access (so a group never disagrees with its fields)."""

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
    omp_threads_bind: str = option(
        "auto",
        "pin the compute threads other than the calling one, one per CPU: auto (when the engine has a thread"
        " for every usable CPU) or nobind (vLLM's VLLM_CPU_OMP_THREADS_BIND modes) (default: auto)",
        choices=OMP_THREADS_BIND,
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
        'speculative decoding, JSON: {"method": "ngram", "num_speculative_tokens": 4},'
        ' {"method": "draft_model", "model": "PATH|self:int4|self:layers=N", "num_speculative_tokens": 4}'
        ' or {"method": "suffix"}',
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

    # Request tracing (docs/observability.md): spans exported over OTLP, vLLM's flag names.
    otlp_traces_endpoint: str | None = option(
        None,
        "export a trace of every request to this OTLP endpoint, e.g. http://localhost:4317 (the exporter reads the"
        " standard OTEL_EXPORTER_OTLP_* variables; needs the tracing extra: pip install 'tachyllm[tracing]')",
    )
    collect_detailed_traces: str | None = option(
        None,
        "with --otlp-traces-endpoint: add each step's model timing to the spans of the requests in it"
        " (model, worker or all: the same timings; costs a little per step)",
        choices=DETAILED_TRACE_MODULES,
    )
    otlp_traces_record_text: bool = option(
        False,
        "with --otlp-traces-endpoint: record prompts and generated text in the spans (default: never, only counts"
        " and timings)",
    )

    # LoRA adapters (docs/lora.md), with vLLM's names.
    enable_lora: bool = option(
        False,
        "serve LoRA adapters (PEFT or GGUF files) over the base model, unmerged, many in one batch (default: off)",
    )
    max_loras: int = option(1, "distinct LoRA adapters in one step; requests for others wait (default: 1)")
    max_lora_rank: int = option(16, "the highest LoRA rank an adapter may have (default: 16)")
    max_cpu_loras: int | None = option(
        None, "LoRA adapters kept loaded, the least recently used unused one evicted first (default: max_loras)"
    )
    lora_dtype: str = option(
        "auto",
        "how LoRA adapters' weights are stored: auto = int8 with a scale per rank over quantized base linears (the"
        " CPU kernels), else bfloat16 for bf16 activations with the backend's LoRA kernels, else float32",
        choices=LORA_DTYPES,
    )

    # Pooling (docs/pooling.md), vLLM's names: embeddings, scores, classification instead of generation.
    runner: str = option(
        "auto",
        "what the engine runs the model for: generate (text), pooling (embeddings, scores); auto = pooling for an"
        " encoder-only checkpoint (BERT) or with --convert embed/classify, else generate",
        choices=RUNNERS,
    )
    convert: str = option(
        "auto",
        "how a generative (causal) model is used by the pooling runner: embed (its pooled final hidden states);"
        " none / auto = as the checkpoint is (an encoder's own head)",
        choices=CONVERTS,
    )
    task: str = option(
        "auto",
        "deprecated spelling of --runner / --convert (vLLM's): generate, embed, score, classify (default: auto)",
        choices=TASKS,
    )
    pooling_type: str | None = option(
        None,
        "how a pooling model turns an input's hidden states into one vector: MEAN, CLS (the first token) or LAST"
        " (default: a sentence-transformers folder's 1_Pooling/config.json, else CLS for a BERT classifier, MEAN"
        " for a BERT encoder, LAST for a causal model)",
        choices=POOLING_TYPES,
    )
    normalize: bool | None = option(
        None,
        "pooling: L2-normalise embeddings, true or false (default: the model's own, a sentence-transformers"
        " Normalize module; true for a causal embedder)",
        choices=(True, False),
        parse=boolean,
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
        self._check_lora()
        self._check_pooling()
        if self.max_logprobs < -1:
            raise ConfigError(f"max_logprobs must be >= 0, or -1 for the whole vocabulary, got {self.max_logprobs}")
        if self.collect_detailed_traces is not None and self.collect_detailed_traces not in DETAILED_TRACE_MODULES:
            raise ConfigError(
                f"collect_detailed_traces must be one of {', '.join(DETAILED_TRACE_MODULES)} (or unset), "
                f"got {self.collect_detailed_traces!r}"
            )
        if self.collect_detailed_traces is not None and self.otlp_traces_endpoint is None:
            raise ConfigError("collect_detailed_traces needs otlp_traces_endpoint (where the traces go)")
        if self.otlp_traces_record_text and self.otlp_traces_endpoint is None:
            raise ConfigError("otlp_traces_record_text needs otlp_traces_endpoint (where the traces go)")
        if self.max_constraint_bytes < 1:
            raise ConfigError(f"max_constraint_bytes must be >= 1, got {self.max_constraint_bytes}")
        if not self.constraint_compile_timeout > 0:
            raise ConfigError(f"constraint_compile_timeout must be > 0 seconds, got {self.constraint_compile_timeout}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device!r} requested but CUDA is not available")
        # The backend (one of the registered ones, and able to run here) is checked where it is created:
        # backends.create_backend, before the engine reads the checkpoint.

    @property
    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            kv_cache_dtype=self.kv_cache_dtype,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_memory=self.kv_cache_memory,
            gpu_memory_utilization=self.gpu_memory_utilization,
        )

    @property
    def scheduler_config(self) -> SchedulerConfig:
        assert self.max_num_batched_tokens is not None  # __post_init__ sets the device's default
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_decode_slowdown=self.max_decode_slowdown,
            max_loras=self.max_loras if self.enable_lora else None,
        )

    @property
    def quant_config(self) -> QuantConfig:
        return QuantConfig(
            method=self.quantization,
            group_size=self.quant_group_size,
            skip=self.quant_skip,
            activation_bits=self.quant_activation_bits,
        )

    @property
    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            tp_cpu_binding=self.tp_cpu_binding,
            tp_all_reduce=self.tp_all_reduce,
        )

    @property
    def backend_config(self) -> BackendConfig:
        return BackendConfig(
            backend=self.backend,
            device=self.device,
            dtype=self.dtype,
            deterministic=self.deterministic,
            enforce_eager=self.enforce_eager,
            threads=self.threads,
        )

    def _check_pooling(self) -> None:
        for name, allowed in (("runner", RUNNERS), ("convert", CONVERTS), ("task", TASKS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.pooling_type is not None:
            self.pooling_type = self.pooling_type.upper()
            if self.pooling_type not in POOLING_TYPES:
                raise ConfigError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ConfigError(f"normalize must be true or false (or unset), got {self.normalize!r}")
        # --task is vLLM's older spelling: embed / score / classify mean the pooling runner.
        if self.task in ("embed", "score", "classify"):
            if self.runner == "generate":
                raise ConfigError(f"task={self.task!r} needs the pooling runner, but runner is 'generate'")
            self.runner = "pooling"
            if self.convert == "auto" and self.task == "embed":
                self.convert = "embed"
        elif self.task == "generate":
            if self.runner == "pooling":
                raise ConfigError("task='generate' contradicts runner='pooling'")
            self.runner = "generate"
        if self.convert in ("embed", "classify"):
            if self.runner == "generate":
                raise ConfigError(f"convert={self.convert!r} needs the pooling runner, but runner is 'generate'")
            self.runner = "pooling"

    @property
    def pooling_requested(self) -> bool | None:
        """True: the pooling runner was asked for; False: generation was; None: the checkpoint decides."""
        return {"pooling": True, "generate": False}.get(self.runner)

    def _check_lora(self) -> None:
        if self.lora_dtype not in LORA_DTYPES:
            raise ConfigError(f"lora_dtype must be one of {', '.join(LORA_DTYPES)}, got {self.lora_dtype!r}")
        if self.max_loras < 1:
            raise ConfigError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ConfigError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

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
