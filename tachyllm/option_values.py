"""The values engine options accept: a leaf module, so that every module checking an option (config.py,
speculative_config.py, the loaders) reads the same lists without importing one another."""

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# vLLM's other spellings of --dtype.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}

# Weight-only quantization methods (tachyllm/quantization) and KV-cache storage types (kernels/kv_quant.py).
# awq, gptq, compressed-tensors also name a pre-quantized checkpoint's format (its quantization_config decides).
QUANTIZATION_METHODS = ("int8", "int4", "awq", "gguf", "fp8", "gptq", "compressed-tensors")
QUANT_GROUP_SIZES = (32, 64, 128)
QUANT_ACTIVATION_BITS = (8, 16)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
# How LoRA adapters' weights are stored (tachyllm/lora/layers.py, StepSegments.weight_dtype_for).
LORA_DTYPES = ("auto", "int8", "bfloat16", "float32")
# How CPU tensor-parallel ranks sum their partial results (docs/tensor_parallel.md).
TP_ALL_REDUCES = ("shm", "gloo")
# How the compute threads are pinned to CPUs (platform.compute_thread_cpus): vLLM's VLLM_CPU_OMP_THREADS_BIND
# modes.
OMP_THREADS_BIND = ("auto", "nobind")
# Execution backends (tachyllm/backends): auto = cuda on a GPU, cpu where the C++ kernels run, else torch.
BACKENDS = ("auto", "torch", "cpu", "cuda")
# vLLM's --collect-detailed-traces values; tachyllm records the same per-step model timings for each.
DETAILED_TRACE_MODULES = ("model", "worker", "all")
# Pooling (docs/pooling.md), vLLM's names: what an engine runs a model for, how a causal model is turned
# into an embedder or classifier, the older --task spelling of both, how hidden states are pooled.
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
TASKS = ("auto", "generate", "embed", "score", "classify")
POOLING_TYPES = ("MEAN", "CLS", "LAST")
