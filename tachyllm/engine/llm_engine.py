"""LLMEngine: owns the model, the KV cache, the scheduler and the output processor; one step() =
schedule, run, apply the result, emit outputs."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from tachyllm import faults, tracing
from tachyllm.backends import LayerKV, create_backend
from tachyllm.config import EngineConfig
from tachyllm.core.block_manager import BlockManager
from tachyllm.core.scheduler import Scheduler, SeqUpdate
from tachyllm.core.sequence import Request, Sequence
from tachyllm.engine.input_processor import InputLimits, InputProcessor, PoolingLimits, ProcessedRequest
from tachyllm.engine.output_processor import OutputProcessor
from tachyllm.engine.pooling import pooling_setup
from tachyllm.engine.stats_logger import StatsLogger
from tachyllm.errors import ConfigError, EngineCorruptedError, RequestError, WorkerError
from tachyllm.host_malloc import keep_freed_memory, use_one_arena
from tachyllm.kernels.kv_quant import KV_STORAGE
from tachyllm.kernels.native import bind_team_threads
from tachyllm.loading import Checkpoint, load_checkpoint, load_tokenizer
from tachyllm.loading.default_model import DEFAULT_MODEL_NAME
from tachyllm.loading.generation_config import default_sampling_values
from tachyllm.lora.manager import LoadedAdapter, LoadTimes, LoRAManager
from tachyllm.lora.request import LoRARequest
from tachyllm.model_config import ModelConfig
from tachyllm.outputs import (
    CompletionOutput,
    EngineOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
    StepStats,
)
from tachyllm.platform import compute_thread_cpus, default_threads
from tachyllm.pooling_params import PoolingParams
from tachyllm.quantization.kv_calibration import kv_cache_scales
from tachyllm.runner import cuda_graphs, kv_cache
from tachyllm.runner.model_loader import build_encoder, build_model
from tachyllm.runner.model_runner import EncoderRunner, ModelRunner
from tachyllm.sampling.sampler import Sampler
from tachyllm.sampling_params import SamplingParams
from tachyllm.spec_decode.speculator import Speculator
from tachyllm.speculative_config import SpeculativeConfig
from tachyllm.structured_output.compiler import ConstraintLimits

if TYPE_CHECKING:  # imported where used: torch.distributed only when tensor parallelism is on
    from tachyllm.distributed.executor import TensorParallelExecutor

logger = logging.getLogger("tachyllm")

# After this many failed steps in a row, a failing step fails every request, not only its own.
MAX_FAILED_STEPS = 3
# An encoder warms up the step sizes of single inputs up to this many tokens at start (EncoderRunner.warm_up):
# the short queries a latency-bound caller sends. Longer steps take tens of milliseconds, against which the
# few milliseconds of building their kernels on first use are small.
ENCODER_WARM_UP_ROWS = 256


@dataclass(frozen=True)
class LoRARequestsInfo:
    """The LoRA adapters of the running and the waiting requests, by name (vLLM's lora_requests_info)."""

    max_loras: int
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    requests: dict[str, int] = field(default_factory=dict)  # requests admitted per adapter name (a copy)
    load_times: LoadTimes = field(default_factory=LoadTimes)  # a copy


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state at one moment; immutable (its counters are copies), so any thread may read it."""

    num_running: int = 0  # requests with a sequence in the running batch
    num_waiting: int = 0  # requests admitted to the engine but not running (preempted ones included)
    num_unstarted: int = 0  # requests admitted to the engine and never scheduled yet
    # Never-started requests that find no free batch slot (max_num_seqs) before them: the queue proper.
    num_queued: int = 0
    # Batch slots that neither a running nor a waiting sequence will take.
    free_batch_slots: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use
    stats: StepStats = field(default_factory=StepStats)
    # The KV cache's configuration as vLLM's cache_config_info labels it (LLMEngine.cache_config_info).
    cache_config: dict[str, str] = field(default_factory=dict)
    lora: LoRARequestsInfo | None = None  # with enable_lora


class LLMEngine:
    def __init__(self, config: EngineConfig):
        if config.enable_lora and config.tensor_parallel_size > 1:
            raise ConfigError("enable_lora does not run with tensor_parallel_size > 1 (docs/lora.md)")
        if config.tensor_parallel_size > 1:
            from tachyllm.distributed.worker import exit_if_importing_main  # distributed/ only when used

            exit_if_importing_main()  # before anything loads in a worker that should not be here
        self.config = config
        use_one_arena()
        threads = config.threads or default_threads()
        torch.set_num_threads(threads)
        self.device = torch.device(config.device)
        if self.device.type == "cpu" and config.tensor_parallel_size == 1:  # ranks: tp_cpu_binding places them
            cpus = bind_team_threads(compute_thread_cpus(config.omp_threads_bind, threads))
            if pinned := [cpu for cpu in cpus if cpu >= 0]:
                logger.info("compute threads pinned to CPUs %s, the calling thread free", pinned)
        self.dtype = config.resolve_dtype()
        t0 = time.perf_counter()
        # Created first: a backend that cannot run here fails before the checkpoint is read.
        self.backend = create_backend(config.backend, self.device)
        # Read before the weights, so that a bad file fails at once. Requests that leave these fields
        # unset take these values (vLLM's --generation-config auto).
        self.default_sampling_params = default_sampling_values(config.generation_config, config.model)
        if self.default_sampling_params:
            logger.info(
                "default sampling values from the model's generation config: %s (--generation-config vllm ignores it)",
                ", ".join(f"{k}={v}" for k, v in self.default_sampling_params.items()),
            )
        ckpt = load_checkpoint(config.model)
        self.model_config = mc = ckpt.config
        self.tokenizer = ckpt.tokenizer if config.tokenizer is None else load_tokenizer(config.tokenizer)
        if config.tokenizer is not None and self.tokenizer.vocab_size > mc.vocab_size:
            raise ConfigError(
                f"the tokenizer has {self.tokenizer.vocab_size} tokens, more than the model's vocabulary "
                f"({mc.vocab_size}): its ids past {mc.vocab_size - 1} have no embedding"
            )
        if config.chat_template is not None:
            self.tokenizer = self.tokenizer.with_chat_template(config.chat_template)
        self.model_name = config.model or DEFAULT_MODEL_NAME
        # The weights' quantization: the option, or a pre-quantized checkpoint's own.
        self.quantization = config.quantization or (ckpt.prequantized.format.method if ckpt.prequantized else None)
        # What the model is served for (engine/pooling.py): generation, or embeddings / scores.
        self.pooling_setup = pooling_setup(config, mc)
        self.runner_type = self.pooling_setup.runner_type
        self.pooling_tasks = self.pooling_setup.tasks
        self.embedding_dim = self.pooling_setup.embedding_dim
        self.is_matryoshka = self.pooling_setup.is_matryoshka
        self.max_model_len = config.max_model_len or mc.max_seq_length or mc.max_position_embeddings
        if mc.is_encoder and self.max_model_len > mc.max_position_embeddings:
            raise ConfigError(
                f"max_model_len={self.max_model_len} exceeds the encoder's {mc.max_position_embeddings} positions"
            )
        self.executor: TensorParallelExecutor | None = None  # the tensor-parallel group, when there is one
        # Why the engine can no longer serve (a dead tensor-parallel worker, inconsistent KV
        # bookkeeping), or None: it then refuses every request and must be restarted.
        self.failure: EngineCorruptedError | None = None
        try:
            self._build(config, ckpt, t0)
        except BaseException:
            self.shutdown()
            raise
        keep_freed_memory()

    def _build(self, config: EngineConfig, ckpt: Checkpoint, t0: float) -> None:
        self.eos_token_ids = self._eos_token_ids()
        self.speculator: Speculator | None = None
        self.lora: LoRAManager | None = None
        self.runner: ModelRunner | TensorParallelExecutor | EncoderRunner
        if self.pooling_setup.encoder:
            self._build_encoder(config, ckpt)
        else:
            self._build_decoder(config, ckpt)
        self.requests: dict[str, Request] = {}
        # The fault barrier's view of the current step: what it works on, who failed already, and
        # how many steps in a row have failed.
        self._step_seqs: list[Sequence] | None = None
        self._step_failed: dict[str, EngineOutput] = {}
        self._failed_steps = 0
        # An encoder keeps no KV cache, so its prefix caching is off whatever the option says.
        self.stats_logger = StatsLogger(config.block_size, self.block_manager.enable_prefix_caching)
        logger.info(
            "engine ready in %.1f s: %s (%s, %s, %s runner)",
            time.perf_counter() - t0, ckpt.source, self.model_config.architecture, self.dtype, self.runner_type,
        )  # fmt: skip

    def _build_encoder(self, config: EngineConfig, ckpt: Checkpoint) -> None:
        """An encoder (BERT): no KV cache at all, each input computed whole in one step (docs/pooling.md)."""
        if config.tensor_parallel_size > 1 or config.enable_lora:
            raise ConfigError("encoder (BERT) models run without tensor parallelism and LoRA adapters")
        encoder, self.weight_bytes = build_encoder(
            ckpt, self.dtype, self.backend, config.quant_config, batch_invariant=config.deterministic
        )
        # One placeholder block that no sequence takes: an encoder's inputs hold no K/V.
        self._build_scheduling(config, num_blocks=1, window_blocks=0, prefix_caching=False)
        self.runner = EncoderRunner(encoder, self.backend)
        self.runner.warm_up(min(self.max_model_len, ENCODER_WARM_UP_ROWS))
        logger.info("encoder: no KV cache; inputs of up to %d tokens, each whole in one step", self.max_model_len)

    def _build_decoder(self, config: EngineConfig, ckpt: Checkpoint) -> None:
        """A decoder-only model: its KV cache, scheduling and runner (with a speculator if configured)."""
        rank_config = self._build_model(config, ckpt)
        graph_queries = self._graph_query_counts()
        # A sequence's longest block table.
        max_blocks = -(-self.max_model_len // config.block_size)
        caches, layout = self._allocate_kv_cache(config, rank_config, graph_queries, max_blocks)
        self._build_scheduling(config, layout.num_blocks, layout.window_blocks, config.enable_prefix_caching)
        sampler = Sampler(self.model_config.vocab_size, self.eos_token_ids, self.device, config.seed)
        self._build_runner(config, caches, layout.num_blocks, sampler, graph_queries, max_blocks)
        if config.speculative_config is not None:
            self.speculator = Speculator(
                config, target=self.model, ckpt=ckpt, sampler=sampler, num_blocks=layout.num_blocks,
                block_size=config.block_size, max_model_len=self.max_model_len, dtype=self.dtype,
                backend=self.backend, step_costs=self.scheduler.step_cost,
            )  # fmt: skip

    def _build_model(self, config: EngineConfig, ckpt: Checkpoint) -> ModelConfig:
        """The model (or rank 0's shard, with the tensor-parallel workers started); returns the config
        of what this process holds, which its KV cache is sized to."""
        if config.tensor_parallel_size > 1:
            from tachyllm.distributed.executor import TensorParallelExecutor  # torch.distributed only when used

            self.executor = TensorParallelExecutor(config, ckpt, self.backend, self.max_model_len)
            self.model, self.weight_bytes = self.executor.model, self.executor.weight_bytes
            rank_config = self.executor.plan.config
        else:
            self.model, self.weight_bytes = build_model(
                ckpt, self.dtype, self.backend, self.max_model_len, config.quant_config,
                batch_invariant=config.deterministic,
                fuse_layers=not config.enable_lora or self.backend.lora_kernels() is not None,
            )  # fmt: skip
            rank_config = self.model_config
        # LoRA: the targeted linears wrapped; the backend's fused layers run the adapters with its LoRA
        # kernels, and are off where it has none (they would bypass the wrappers).
        if config.enable_lora:
            max_cpu_loras = config.max_cpu_loras or config.max_loras
            max_tokens = config.max_num_batched_tokens
            assert max_tokens is not None, "EngineConfig.__post_init__ sets it"
            self.lora = LoRAManager(
                self.model, self.model_config, self.device, config.max_lora_rank, max_cpu_loras,
                kernels=self.backend.lora_kernels(), dtype=self.dtype, max_tokens=max_tokens,
                lora_dtype=config.lora_dtype,
            )  # fmt: skip
        if config.deterministic and self.backend.name != "cpu":
            logger.info(
                "the %s backend is not batch invariant: outputs may depend on the batch and on prefix-cache hits "
                "(docs/determinism.md)", self.backend.name,
            )  # fmt: skip
        return rank_config

    def _allocate_kv_cache(
        self, config: EngineConfig, rank_config: ModelConfig, graph_queries: tuple[int, ...] | None, max_blocks: int
    ) -> tuple[list[LayerKV], kv_cache.KVCacheLayout]:
        """The KV cache's pools sized (the option, or what the memory and the configured sequences
        allow) and allocated; logged."""
        mc, cache = self.model_config, config.cache_config
        kv_dtype = KV_STORAGE.get(cache.kv_cache_dtype, self.dtype)
        # Gemma 3's sliding-window layers get a pool of their own (runner/kv_cache.py has the rule).
        max_batched = config.max_num_batched_tokens
        assert max_batched is not None, "EngineConfig.__post_init__ sets it"
        limits = dict(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=max_batched, max_model_len=self.max_model_len
        )
        wanted = kv_cache.wanted_bytes(rank_config, cache.block_size, kv_dtype, **limits)
        graph_bytes = 0
        if graph_queries and cache.kv_cache_memory is None:
            # Measured over a cache of the model dtype: the graphs' memory is activations, whatever the cache stores.
            graph_bytes = cuda_graphs.measure_graph_memory(
                self.model, self.backend,
                lambda n: self.backend.allocate_kv_cache(mc, n, cache.block_size, self.dtype),
                block_size=cache.block_size, max_num_seqs=config.max_num_seqs, max_blocks=max_blocks,
                query_counts=graph_queries,
            )  # fmt: skip
        cache_bytes = cache.kv_cache_memory or kv_cache.default_kv_cache_memory(
            self.device, wanted, cache.gpu_memory_utilization, graph_bytes
        )
        layout = kv_cache.kv_cache_layout(rank_config, cache.block_size, kv_dtype, cache_bytes, **limits)
        num_blocks = layout.num_blocks
        if num_blocks < 1:
            raise RequestError(
                f"kv_cache_memory={cache_bytes} bytes holds no block (one block needs {layout.block_bytes} bytes)"
            )
        scales = kv_cache_scales(self.model, self.tokenizer, kv_dtype) if cache.kv_cache_dtype != "auto" else None
        caches = self.backend.allocate_kv_cache(
            rank_config, num_blocks, cache.block_size, kv_dtype, scales, layout.window_blocks
        )
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB, %s); max_model_len %d",
            num_blocks, cache.block_size, num_blocks * cache.block_size, layout.total_bytes / 2**20,
            str(kv_dtype).removeprefix("torch."), self.max_model_len,
        )  # fmt: skip
        if layout.window_blocks:
            logger.info(
                "KV cache: the %d sliding-window layers (window %d) hold their last blocks only, in a pool of "
                "their own: %d blocks (%.1f MiB) of the above", len(mc.sliding_layers), mc.sliding_window,
                layout.window_blocks - 1, layout.window_blocks * layout.window_block_bytes / 2**20,
            )  # fmt: skip
        if cache.kv_cache_dtype != "auto":
            logger.info(
                "KV cache dtype %s: %.1fx the blocks of %s at the same memory",
                cache.kv_cache_dtype, self.dtype.itemsize / kv_dtype.itemsize, str(self.dtype).removeprefix("torch."),
            )  # fmt: skip
        return caches, layout

    def _eos_token_ids(self) -> list[int]:
        """The model's end-of-sequence tokens, else the tokenizer's."""
        eos_token_id = self.tokenizer.eos_token_id
        return list(self.model_config.eos_token_ids) or ([eos_token_id] if eos_token_id is not None else [])

    def _build_scheduling(
        self, config: EngineConfig, num_blocks: int, window_blocks: int, prefix_caching: bool
    ) -> None:
        """What decides each step over the KV blocks: the block manager, the scheduler, the request checks
        and the output processor."""
        mc, cache = self.model_config, config.cache_config
        self.stats = StepStats()
        # vLLM's CacheConfig.metrics_info() names for what applies here (num_gpu_blocks: the KV blocks, on
        # whatever device), as /metrics' cache_config_info labels them.
        self.cache_config_info = {
            "block_size": str(cache.block_size),
            "cache_dtype": cache.kv_cache_dtype,
            "enable_prefix_caching": str(prefix_caching),
            "num_gpu_blocks": str(num_blocks),
        }
        self.block_manager = BlockManager(
            num_blocks, cache.block_size, prefix_caching, extra_key=self._prefix_cache_key(),
            window=mc.sliding_window, window_blocks=window_blocks,
        )  # fmt: skip
        scheduling = config.scheduler_config
        limits = InputLimits(
            vocab_size=mc.vocab_size,
            max_model_len=self.max_model_len,
            num_kv_blocks=num_blocks,
            block_size=cache.block_size,
            max_num_batched_tokens=scheduling.max_num_batched_tokens,
            enable_chunked_prefill=scheduling.enable_chunked_prefill,
            max_logprobs=mc.vocab_size if config.max_logprobs == -1 else config.max_logprobs,
        )
        constraint_limits = ConstraintLimits(config.max_constraint_bytes, config.constraint_compile_timeout)
        pooling = None
        if self.runner_type == "pooling":
            setup = self.pooling_setup
            # An encoder computes an input whole in one step: it must fit the step's budget too.
            max_input = (
                min(self.max_model_len, scheduling.max_num_batched_tokens) if setup.encoder else limits.context_limit
            )
            pooling = PoolingLimits(setup.tasks, setup.embedding_dim, setup.is_matryoshka, max_input, setup.encoder)
        self.input_processor = InputProcessor(
            self.tokenizer, limits, self.eos_token_ids, constraint_limits, pooling=pooling
        )
        self.scheduler = Scheduler(
            self.block_manager, scheduling, self.stats, eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
        )  # fmt: skip
        self.output_processor = OutputProcessor(self.tokenizer)

    def _build_runner(
        self,
        config: EngineConfig,
        caches: list[LayerKV],
        num_blocks: int,
        sampler: Sampler,
        graph_queries: tuple[int, ...] | None,
        max_blocks: int,
    ) -> None:
        """What runs a step: this process's ModelRunner (capturing CUDA graphs where they apply), or the
        tensor-parallel executor over every rank's."""
        if self.executor is not None:
            self.executor.start(caches, num_blocks, config.block_size, sampler)
            self.runner = self.executor
        else:
            runner = ModelRunner(self.model, caches, config.block_size, sampler, self.backend)
            runner.lora_segments = self.lora.segments if self.lora is not None else None
            if graph_queries:
                runner.use_graphs(config.max_num_seqs, max_blocks, graph_queries)
            self.runner = runner

    def _graph_query_counts(self) -> tuple[int, ...] | None:
        """Queries per sequence of the decode-only steps CUDA graphs capture (1, and 1 + k when
        speculating k tokens), or None when every step runs eagerly."""
        if self.device.type != "cuda" or self.config.enforce_eager or self.executor is not None:
            return None
        if self.runner_type == "pooling":  # its steps are prefills: none would replay a graph
            return None
        if self.config.enable_lora:
            logger.info("CUDA graphs off: LoRA adapters' steps are not captured yet")
            return None
        if not self.backend.graph_capturable:
            logger.info(
                "CUDA graphs off: the %s backend's steps cannot be captured (--backend cuda)", self.backend.name
            )
            return None
        if self.model_config.sliding_layers:
            # Their own KV pool would need a second set of graph buffers.
            logger.info("CUDA graphs off: the model's sliding-window layers are not captured yet")
            return None
        spec = self.config.speculative_config
        if spec is None:
            return (1,)
        assert isinstance(spec, SpeculativeConfig), "EngineConfig.__post_init__ parses speculative_config"
        return (1, 1 + spec.num_speculative_tokens)

    def shutdown(self) -> None:
        """Stops the engine's worker processes (tensor parallelism); idempotent, a no-op without them."""
        if self.executor is not None:
            self.executor.shutdown()

    def _prefix_cache_key(self) -> bytes:
        """Cached KV blocks are only reusable by an engine that stores K/V the same way."""
        key = str(self.dtype)
        if self.config.kv_cache_dtype != "auto":
            key += f"/kv={self.config.kv_cache_dtype}"
        return key.encode()

    # -- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | ProcessedRequest,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """Validates (self.input_processor) and queues a request; raises RequestError (nothing queued) when
        it can never run. A ProcessedRequest, which that processor made and checked, is queued as it is,
        with its own params. `lora_request`: the LoRA adapter it runs with (loaded now if need be; a
        ProcessedRequest's own otherwise)."""
        if self.failure is not None:
            raise EngineCorruptedError(f"the engine has shut down: {self.failure}")
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, ProcessedRequest):
            if params is not None and params is not prompt.params:
                raise ValueError("a ProcessedRequest carries its own sampling params; pass none or the same")
            processed = prompt
            lora_request = lora_request or prompt.lora_request
        else:
            processed = self.input_processor.process(prompt, params or SamplingParams())
        if isinstance(processed.params, PoolingParams):
            return self._add_pooling_request(request_id, processed, processed.params, arrival_time, priority)
        if self.runner_type == "pooling":
            raise RequestError(
                "this model is served by the pooling runner (embeddings, scores): it does not generate text",
                param="model",
            )
        text, token_ids, params = processed.prompt, processed.prompt_token_ids, processed.params
        # Compiled where the request was checked: here a cache hit, or a compile for a caller that
        # skipped the check (its cost then falls on this thread).
        grammar = self.input_processor.compile_grammar(params)
        adapter = self._adapter(lora_request)

        metrics = RequestMetrics(
            arrival_time or time.time(),
            params_n=params.n,
            params_max_tokens=params.max_tokens,
            events=[] if self.config.otlp_traces_endpoint else None,
        )
        req = Request(request_id, text, token_ids, params, metrics, priority)
        if adapter is not None:
            req.lora_slot, req.lora_digest = adapter.slot, adapter.adapter.digest
        for i in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed + i)
            seq = Sequence(
                request=req, index=i, token_ids=list(token_ids), num_prompt_tokens=len(token_ids), generator=generator
            )
            seq.grammar = grammar.start() if grammar is not None else None
            req.seqs.append(seq)
        self.output_processor.add_request(req)
        # Only now, with nothing left to fail, does the request enter the scheduler: all or nothing.
        for seq in req.seqs:
            self.scheduler.add(seq)
        self.requests[request_id] = req
        self.stats.num_prompt_tokens += len(token_ids)
        if adapter is not None and self.lora is not None:
            name = adapter.request.lora_name
            self.lora.requests_by_name[name] = self.lora.requests_by_name.get(name, 0) + 1
        return req

    def _add_pooling_request(
        self,
        request_id: str,
        processed: ProcessedRequest,
        params: PoolingParams,
        arrival_time: float | None,
        priority: int,
    ) -> Request:
        """Queues a checked pooling request: one prefill-only sequence, whose result ends it."""
        if self.runner_type != "pooling":
            raise RequestError(
                "this model generates text: embeddings and scores need a model served by the pooling runner",
                param="model",
            )
        if processed.lora_request is not None:
            raise RequestError("LoRA adapters do not apply to pooling requests", param="lora_request")
        token_ids = processed.prompt_token_ids
        metrics = RequestMetrics(
            arrival_time or time.time(), params_max_tokens=0, events=[] if self.config.otlp_traces_endpoint else None
        )
        # SamplingParams() stands for what the scheduler reads of every request; nothing is sampled.
        req = Request(request_id, processed.prompt, token_ids, SamplingParams(), metrics, priority)
        req.pooling = self.pooling_setup.pooling_input(params, processed.token_type_ids)
        seq = Sequence(request=req, index=0, token_ids=list(token_ids), num_prompt_tokens=len(token_ids))
        seq.kv_free = self.pooling_setup.encoder
        req.seqs.append(seq)
        self.scheduler.add(seq)
        self.requests[request_id] = req
        self.stats.num_prompt_tokens += len(token_ids)
        return req

    def _pooling_output(self, req: Request, error: str | None = None) -> PoolingRequestOutput:
        """A pooling request's one output: its result, or (failed, aborted) an empty one with `error`."""
        data = req.pooled if req.pooled is not None and error is None else torch.empty(0)
        return PoolingRequestOutput(
            req.request_id, req.prompt_token_ids, PoolingOutput(data), True, req.metrics, error=error
        )

    def _adapter(self, lora_request: LoRARequest | None) -> LoadedAdapter | None:
        """The loaded adapter a request names (None: the base model); raises RequestError when it cannot run."""
        if lora_request is None:
            return None
        if self.lora is None:
            raise RequestError("lora_request needs an engine started with enable_lora", param="lora_request")
        return self.lora.acquire(lora_request, {r.lora_slot for r in self.requests.values()})

    def abort_request(self, request_id: str) -> EngineOutput | None:
        """Ends a request at any stage; its blocks are free when this returns."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            self.scheduler.finish(seq, "abort")
        req.metrics.finished_time = time.time()
        if req.pooling is not None:
            return self._pooling_output(req, error="aborted")
        try:
            return self.output_processor.make_output(request_id)
        except Exception as e:  # the request is gone either way; say why its output is missing
            logger.exception("request %s: its output could not be made while aborting it", request_id)
            return self._error_output(req, e)

    def abort_all(self) -> list[EngineOutput]:
        """Aborts every request; all KV blocks are free when this returns."""
        return [out for request_id in list(self.requests) if (out := self.abort_request(request_id)) is not None]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def can_fail_between_steps(self) -> bool:
        """Whether something outside the steps can fail this engine (its tensor-parallel workers can
        die while it idles): its driver should then call check_health() now and then."""
        return self.executor is not None

    def check_health(self) -> EngineCorruptedError | None:
        """Why the engine can no longer serve (self.failure), noticing first a tensor-parallel worker
        that died between steps; None while it can serve."""
        if self.failure is None and self.executor is not None and (why := self.executor.check_workers()):
            self.failure = WorkerError(why)
        return self.failure

    # -- what others may read -----------------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        """Running / waiting / never-started requests, KV-cache usage and a copy of the counters."""
        running = {s.request.request_id for s in self.scheduler.running}
        waiting = {s.request.request_id for s in self.scheduler.waiting} - running
        # Waiting sequences take the free batch slots in the scheduler's order; a never-started request
        # with a sequence left over queues.
        free_slots = self.scheduler.max_num_seqs - len(self.scheduler.running)
        queued = set()
        for seq in self.scheduler.waiting:
            if free_slots > 0:
                free_slots -= 1
            elif seq.request.metrics.first_scheduled_time is None:
                queued.add(seq.request.request_id)
        stats = self.stats
        return EngineSnapshot(
            num_running=len(running),
            num_waiting=len(waiting),
            num_unstarted=sum(r.metrics.first_scheduled_time is None for r in self.requests.values()),
            num_queued=len(queued),
            free_batch_slots=max(free_slots, 0),
            kv_cache_usage=self.block_manager.usage,
            stats=replace(
                stats,
                finished_reasons=dict(stats.finished_reasons),
                spec_accepted_per_pos=list(stats.spec_accepted_per_pos),
                spec_draft_tokens_per_pos=list(stats.spec_draft_tokens_per_pos),
                iteration_token_steps=list(stats.iteration_token_steps),
            ),
            cache_config=self.cache_config_info,
            lora=self._lora_requests_info(),
        )

    def _lora_requests_info(self) -> LoRARequestsInfo | None:
        if self.lora is None:
            return None
        names = {loaded.slot: loaded.request.lora_name for loaded in self.lora.loaded.values()}

        def adapters(seqs: list[Sequence]) -> tuple[str, ...]:
            return tuple(sorted({names[s.request.lora_slot] for s in seqs if s.request.lora_slot}))

        scheduler = self.scheduler
        lora = self.lora
        return LoRARequestsInfo(
            self.config.max_loras,
            adapters(scheduler.running),
            adapters(scheduler.waiting),
            dict(lora.requests_by_name),
            LoadTimes(list(lora.load_times.buckets), lora.load_times.total_seconds),
        )

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """One iteration: schedule, run, sample, emit. It is a fault barrier: an exception inside it
        (a bug, a kernel error) fails the requests the step was working on, with the error, and
        returns their blocks; the engine goes on with the others. A failure that can be pinned on one
        request (detokenizing or emitting its tokens) fails that request alone. Raises only when the
        KV-block bookkeeping is no longer consistent after a failure: that engine must not go on."""
        self._step_seqs = None  # until scheduled: any running sequence may be touched
        self._step_failed = {}
        try:
            outputs = self._step()
            self._failed_steps = 0
            return outputs
        except Exception as e:
            self._failed_steps += 1
            seqs = self.scheduler.running if self._step_seqs is None else self._step_seqs
            blamed = {s.request.request_id: s.request for s in seqs if s.request.request_id in self.requests}
            if isinstance(e, WorkerError):
                # The tensor-parallel group is gone (its executor stopped it): every request fails, and the
                # engine refuses new ones.
                self.failure = e
                blamed = dict(self.requests)
            elif not blamed or self._failed_steps >= MAX_FAILED_STEPS:
                # Nobody to pin it on (a waiting request broke scheduling), or failing the step's
                # requests did not help: fail them all, so that every failed step ends some request
                # and the engine cannot fail the same way forever.
                blamed = dict(self.requests)
            logger.exception("engine step failed; failing %d request(s)", len(blamed))
            outputs = list(self._step_failed.values()) + [self._fail_request(req, e) for req in blamed.values()]
            self._check_consistent()
            return outputs

    def _step(self) -> list[EngineOutput]:
        faults.check("schedule", self.scheduler.running)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler)
        with tracing.span("schedule"):
            batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        self._step_seqs = self.scheduler.in_flight()
        now = time.time()
        for seq in self._step_seqs:
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = now
        t0 = time.perf_counter()
        result = self.runner.execute(batch)
        seconds = time.perf_counter() - t0
        if self.config.collect_detailed_traces:
            for seq in self._step_seqs:
                seq.request.metrics.record(
                    "model_step", now, sample=seq.index, seconds=seconds, batch_seqs=len(batch.seqs),
                    batch_tokens=batch.num_tokens,
                )  # fmt: skip
        updates = self.scheduler.update_from_output(batch, result, seconds)
        self.stats.num_steps += 1
        self.stats.record_iteration(batch.num_tokens)
        if self.speculator is not None:
            self.speculator.observe(batch, result, seconds)
            self.stats.spec_suffix_tree_nodes = self.speculator.suffix_tree_nodes
        outputs = self._process(updates)
        try:
            self.stats_logger.maybe_log(self.stats, self.scheduler, self.block_manager, batch, self._step_seqs)
        except Exception:  # a log line is not worth a request
            logger.exception("stats logging failed")
        return outputs

    def _process(self, updates: list[SeqUpdate]) -> list[EngineOutput]:
        """Detokenizes what the step added and emits each touched request's output; a request whose
        tokens cannot be processed fails alone."""
        failed = self._step_failed  # kept on self: should the step fail later, these are still answered
        touched: dict[str, Request] = {}
        for update in updates:
            req = update.seq.request
            if req.request_id in failed:
                continue
            if req.pooling is not None:  # its result is its output: nothing to detokenize
                touched[req.request_id] = req
                continue
            try:
                self.output_processor.apply(update, self.scheduler)
            except Exception as e:  # this request's own tokens: only it fails
                logger.exception("request %s failed while its tokens were applied", req.request_id)
                failed[req.request_id] = self._fail_request(req, e)
                continue
            touched[req.request_id] = req
        outputs: list[EngineOutput] = list(failed.values())
        now = time.time()
        for req in touched.values():
            if req.request_id not in failed and (out := self._emit(req, now)) is not None:
                outputs.append(out)
        return outputs

    def _emit(self, req: Request, now: float) -> EngineOutput | None:
        """The request's output for this step (None: it asked for its final output only); a request
        whose output cannot be made fails alone."""
        finished = req.finished
        if finished:
            req.metrics.finished_time = now
        if req.pooling is not None:
            try:
                faults.check("output", req.seqs)
            except Exception as e:
                logger.exception("request %s failed while its output was made", req.request_id)
                return self._fail_request(req, e)
            self.requests.pop(req.request_id, None)
            return self._pooling_output(req)
        try:
            out = self.output_processor.make_output(req.request_id)
        except Exception as e:
            logger.exception("request %s failed while its output was made", req.request_id)
            return self._fail_request(req, e)
        if finished:
            self.requests.pop(req.request_id, None)
        return out

    def _fail_request(self, req: Request, error: Exception) -> EngineOutput:
        """Ends the request with finish_reason "error" (its blocks are free when this returns) and
        returns its final output, which carries the error and whatever text it had produced."""
        for seq in req.seqs:
            self.scheduler.finish(seq, "error")
        req.metrics.finished_time = time.time()
        self.requests.pop(req.request_id, None)
        return self._error_output(req, error)

    def _error_output(self, req: Request, error: Exception) -> EngineOutput:
        """The failed request's last output: what it had produced, every sample with finish_reason
        "error" (even one that had just finished with "stop" or "length")."""
        message = f"the engine failed while running this request ({type(error).__name__}: {error})"
        if req.pooling is not None:
            return self._pooling_output(req, error=message)
        try:
            output = self.output_processor.make_output(req.request_id, error=message)
            assert output is not None, "with an error every sample has finished: there is a final output"
            return output
        except Exception:  # its output state is broken too: report the failure without its text
            logger.exception("request %s: its text could not be recovered", req.request_id)
            self.output_processor.remove_request(req.request_id)
            completions = [CompletionOutput(seq.index, "", seq.output_token_ids, "error") for seq in req.seqs]
            return RequestOutput(
                req.request_id, req.prompt, req.prompt_token_ids, completions, True, req.metrics, error=message
            )

    def _check_consistent(self) -> None:
        """After a failed step: every KV block is either free or held by a live sequence."""
        live = [seq for req in self.requests.values() for seq in req.seqs if not seq.is_finished]
        try:
            self.block_manager.check_invariants(live)
        except AssertionError as e:
            self.failure = EngineCorruptedError(f"KV-block bookkeeping is inconsistent after a failed step: {e}")
            raise self.failure from None
