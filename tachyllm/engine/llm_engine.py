"""LLMEngine: owns the model, the KV cache and the scheduler; one step() = schedule, run, sample, emit."""

from __future__ import annotations

import logging
import time

import torch

from tachyllm import faults
from tachyllm.backends import create_backend
from tachyllm.config import EngineConfig, default_threads
from tachyllm.detokenizer import IncrementalDetokenizer
from tachyllm.engine.block_manager import BlockManager
from tachyllm.engine.scheduler import Scheduler
from tachyllm.engine.sequence import Request, Sequence
from tachyllm.engine.stats_logger import StatsLogger
from tachyllm.errors import EngineCorruptedError, RequestError
from tachyllm.kernels.kv_quant import KV_STORAGE
from tachyllm.loading import load_checkpoint
from tachyllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, StepStats
from tachyllm.quantization.kv_calibration import kv_cache_scales
from tachyllm.runner import kv_cache
from tachyllm.runner.model_loader import build_model
from tachyllm.runner.model_runner import ModelRunner
from tachyllm.runner.sampler import Sampler
from tachyllm.sampling_params import SamplingParams
from tachyllm.spec_decode.speculator import Speculator

logger = logging.getLogger("tachyllm")

# After this many failed steps in a row, a failing step fails every request, not only its own.
MAX_FAILED_STEPS = 3


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        torch.set_num_threads(config.threads or default_threads())
        self.device = torch.device(config.device)
        self.dtype = config.resolve_dtype()
        t0 = time.perf_counter()
        ckpt = load_checkpoint(config.model)
        self.model_config = mc = ckpt.config
        self.tokenizer = ckpt.tokenizer
        self.model_name = config.model or "SmolLM2-135M-Instruct"
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.backend = create_backend(config.backend, self.device)

        self.model, self.weight_bytes = build_model(
            ckpt, self.dtype, self.backend, self.max_model_len,
            config.quantization, config.quant_group_size, config.quant_skip, config.quant_activation_bits,
        )  # fmt: skip
        model = self.model

        kv_dtype = KV_STORAGE.get(config.kv_cache_dtype, self.dtype)
        block_bytes = kv_cache.bytes_per_block(mc, config.block_size, kv_dtype)
        wanted = config.max_num_seqs * -(-self.max_model_len // config.block_size) * block_bytes
        cache_bytes = config.kv_cache_memory or kv_cache.default_kv_cache_memory(self.device, wanted)
        num_blocks = cache_bytes // block_bytes
        if num_blocks < 1:
            raise RequestError(f"kv_cache_memory={cache_bytes} bytes holds no block (one block needs {block_bytes} bytes)")
        scales = kv_cache_scales(model, self.tokenizer, kv_dtype) if config.kv_cache_dtype != "auto" else None
        caches = self.backend.allocate_kv_cache(mc, num_blocks, config.block_size, kv_dtype, scales)
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB, %s); max_model_len %d",
            num_blocks, config.block_size, num_blocks * config.block_size, num_blocks * block_bytes / 2**20,
            str(kv_dtype).removeprefix("torch."), self.max_model_len,
        )  # fmt: skip
        if config.kv_cache_dtype != "auto":
            logger.info(
                "KV cache dtype %s: %.1fx the blocks of %s at the same memory",
                config.kv_cache_dtype, self.dtype.itemsize / kv_dtype.itemsize, str(self.dtype).removeprefix("torch."),
            )  # fmt: skip

        self.stats = StepStats()
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching, extra_key=self._prefix_cache_key()
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill, self.stats,
            config.max_decode_slowdown,
        )
        eos = list(mc.eos_token_ids) or ([self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])
        self.eos_token_ids = eos
        sampler = Sampler(mc.vocab_size, eos, self.device, config.seed)
        self.runner = ModelRunner(self.model, caches, config.block_size, sampler, self.backend)
        self.speculator = None
        if config.speculative_config is not None:
            self.speculator = Speculator(
                config.speculative_config, self.model, ckpt, sampler, num_blocks, config.block_size,
                self.max_model_len, self.dtype, self.backend,
            )  # fmt: skip
        self.requests: dict[str, Request] = {}
        # The fault barrier's view of the current step: what it works on, who failed already, and
        # how many steps in a row have failed.
        self._step_seqs: list[Sequence] | None = None
        self._step_failed: dict[str, RequestOutput] = {}
        self._failed_steps = 0
        self.stats_logger = StatsLogger(config.block_size, config.enable_prefix_caching)
        logger.info("engine ready in %.1f s: %s (%s, %s)", time.perf_counter() - t0, ckpt.source, mc.architecture, self.dtype)

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
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> Request:
        """Validates and queues a request; raises RequestError (nothing queued) when it can never run."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise RequestError(
                    f"prompt token ids must be in [0, {self.model_config.vocab_size}), got {bad[:3]}", param="prompt"
                )
        if not token_ids:
            raise RequestError("prompt is empty (no tokens)", param="prompt")
        if unknown := params.token_ids_at_or_above(self.model_config.vocab_size):
            name, token = unknown[0]
            raise RequestError(
                f"{name}: token id {token} is not in the vocabulary (ids 0 to {self.model_config.vocab_size - 1})",
                param=name,
            )
        self._check_fits(len(token_ids), params)

        req = Request(request_id, text, token_ids, params, RequestMetrics(arrival_time or time.time()), priority)
        for i in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed + i)
            seq = Sequence(
                request=req,
                index=i,
                token_ids=list(token_ids),
                num_prompt_tokens=len(token_ids),
                detokenizer=IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens),
                generator=generator,
            )
            req.seqs.append(seq)
        # Only now, with nothing left to fail, does the request enter the scheduler: all or nothing.
        for seq in req.seqs:
            self.scheduler.add(seq)
        self.requests[request_id] = req
        self.stats.num_prompt_tokens += len(token_ids)
        return req

    def _check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        total = prompt_len + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        blocks = self.block_manager.blocks_needed(total)
        if blocks > self.block_manager.num_blocks:
            raise RequestError(
                f"prompt + max_tokens = {total} tokens needs {blocks} KV blocks but the cache has only "
                f"{self.block_manager.num_blocks}; raise kv_cache_memory or lower max_tokens"
            )
        if not self.config.enable_chunked_prefill and prompt_len > self.config.max_num_batched_tokens:
            raise RequestError(
                f"prompt ({prompt_len} tokens) exceeds max_num_batched_tokens ({self.config.max_num_batched_tokens}) "
                "and chunked prefill is disabled"
            )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Ends a request at any stage; its blocks are free when this returns."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            self.scheduler.finish(seq, "abort")
        req.metrics.finished_time = time.time()
        try:
            return self._make_output(req)
        except Exception as e:  # the request is gone either way; say why its output is missing
            logger.exception("request %s: its output could not be made while aborting it", request_id)
            return self._error_output(req, e)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
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
            if not blamed or self._failed_steps >= MAX_FAILED_STEPS:
                # Nobody to pin it on (a waiting request broke scheduling), or failing the step's
                # requests did not help: fail them all, so that every failed step ends some request
                # and the engine cannot fail the same way forever.
                blamed = dict(self.requests)
            logger.exception("engine step failed; failing %d request(s)", len(blamed))
            outputs = list(self._step_failed.values()) + [self._fail_request(req, e) for req in blamed.values()]
            self._check_consistent()
            return outputs

    def _step(self) -> list[RequestOutput]:
        faults.check("schedule", self.scheduler.running)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler)
        sched = self.scheduler.schedule()
        if sched.empty:
            return []
        self._step_seqs = [s.seq for s in sched.scheduled]
        now = time.time()
        for s in sched.scheduled:
            if s.seq.request.metrics.first_scheduled_time is None:
                s.seq.request.metrics.first_scheduled_time = now
        t0 = time.perf_counter()
        results = self.runner.execute(sched)
        step_seconds = time.perf_counter() - t0
        self.scheduler.observe_step(sched, step_seconds)
        for s in sched.scheduled:
            if not s.spec_token_ids:
                s.seq.num_computed_tokens += s.num_new_tokens
                self.block_manager.cache_full_blocks(s.seq)
        self.stats.num_steps += 1

        now = time.time()
        touched: dict[str, Request] = {}
        spec_outcomes = []
        failed = self._step_failed  # kept on self: should the step fail later, these are still answered
        for r in results:
            seq = r.seq
            if r.num_draft_tokens:
                # KV is valid for the last token and the accepted drafts; the rest is rolled back.
                seq.num_computed_tokens += 1 + r.num_accepted
                spec_outcomes.append((r.num_draft_tokens, r.num_accepted))
                self.stats.record_spec(r.num_draft_tokens, r.num_accepted)
                m = seq.request.metrics
                m.spec_num_drafts += 1
                m.spec_num_draft_tokens += r.num_draft_tokens
                m.spec_num_accepted_tokens += r.num_accepted
            if seq.request.request_id in failed:
                continue
            try:
                for token, logprob in zip(r.token_ids, r.logprobs):
                    self._append_token(seq, token, logprob, now)
                    if seq.is_finished:
                        break
            except Exception as e:  # this request's own tokens: only it fails
                logger.exception("request %s failed while its tokens were applied", seq.request.request_id)
                failed[seq.request.request_id] = self._fail_request(seq.request, e)
                continue
            if r.num_draft_tokens and not seq.is_finished:
                self.block_manager.trim(seq, seq.num_tokens)
                self.block_manager.cache_full_blocks(seq)
            touched[seq.request.request_id] = seq.request
        if self.speculator is not None:
            self.speculator.observe(sched, step_seconds, spec_outcomes)
            Speculator.clear([s.seq for s in sched.scheduled] + sched.preempted)
        outputs = list(failed.values())
        for req in touched.values():
            if req.request_id not in failed:
                outputs.append(self._emit(req, now))
        try:
            self.stats_logger.maybe_log(self.stats, self.scheduler, self.block_manager, sched.scheduled)
        except Exception:  # a log line is not worth a request
            logger.exception("stats logging failed")
        return outputs

    def _emit(self, req: Request, now: float) -> RequestOutput:
        """The request's output for this step; a request whose output cannot be made fails alone."""
        try:
            faults.check("output", req.seqs)
            out = self._make_output(req)
        except Exception as e:
            logger.exception("request %s failed while its output was made", req.request_id)
            return self._fail_request(req, e)
        if req.finished:
            req.metrics.finished_time = now
            self.requests.pop(req.request_id, None)
        return out

    def _fail_request(self, req: Request, error: Exception) -> RequestOutput:
        """Ends the request with finish_reason "error" (its blocks are free when this returns) and
        returns its final output, which carries the error and whatever text it had produced."""
        for seq in req.seqs:
            self.scheduler.finish(seq, "error")
        req.metrics.finished_time = time.time()
        self.requests.pop(req.request_id, None)
        return self._error_output(req, error)

    @staticmethod
    def _error_output(req: Request, error: Exception) -> RequestOutput:
        # Even a sequence that had just finished ("stop", "length") reports the failure.
        completions = [CompletionOutput(seq.index, seq.text, seq.output_token_ids, "error") for seq in req.seqs]
        message = f"the engine failed while running this request ({type(error).__name__}: {error})"
        return RequestOutput(
            req.request_id, req.prompt, req.prompt_token_ids, completions, True, req.metrics, error=message
        )

    def _check_consistent(self) -> None:
        """After a failed step: every KV block is either free or held by a live sequence."""
        live = [seq for req in self.requests.values() for seq in req.seqs if not seq.is_finished]
        try:
            self.block_manager.check_invariants(live)
        except AssertionError as e:
            raise EngineCorruptedError(f"KV-block bookkeeping is inconsistent after a failed step: {e}") from None

    def _append_token(self, seq: Sequence, token: int, logprob, now: float) -> None:
        params, metrics = seq.params, seq.request.metrics
        seq.token_ids.append(token)
        self.stats.num_generation_tokens += 1
        if seq.index == 0:
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
            metrics.num_generated_tokens += 1
        if logprob is not None:
            chosen_lp, rank, top_ids, top_lps = logprob
            entry = {tid: Logprob(lp, r + 1, self._token_text(tid)) for r, (tid, lp) in enumerate(zip(top_ids, top_lps))}
            entry[token] = Logprob(chosen_lp, rank, self._token_text(token))
            seq.logprobs.append(entry)
            seq.cumulative_logprob += chosen_lp

        faults.check("detokenize", (seq,))
        delta = seq.detokenizer.add_tokens([token])
        seq.text += delta
        n_out = seq.num_output_tokens
        can_stop = n_out >= params.min_tokens
        if can_stop and not params.ignore_eos and token in self.eos_token_ids:
            self.scheduler.finish(seq, "stop", token)
        elif can_stop and token in params.stop_token_ids:
            self.scheduler.finish(seq, "stop", token)
        elif can_stop and params.stop_strings and self._truncate_at_stop_string(seq, len(delta)):
            pass
        elif n_out >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self.scheduler.finish(seq, "length")

    def _truncate_at_stop_string(self, seq: Sequence, new_chars: int) -> bool:
        """Ends seq at the earliest stop string in its text (the stop string is not emitted)."""
        stops = seq.params.stop_strings
        # Only the newest characters can complete a match that was not there before.
        window_start = max(0, len(seq.text) - new_chars - max(map(len, stops)) + 1)
        best = None
        for stop in stops:
            idx = seq.text.find(stop, window_start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return False
        seq.text = seq.text[: best[0]]
        self.scheduler.finish(seq, "stop", best[1])
        return True

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _make_output(self, req: Request) -> RequestOutput:
        completions = []
        for seq in req.seqs:
            text = seq.text
            if not seq.is_finished and seq.params.stop_strings:
                # Hold back a possible stop-string prefix until it is confirmed or ruled out.
                text = text[: max(0, len(text) - max(map(len, seq.params.stop_strings)) + 1)]
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=seq.output_token_ids,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
                    cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
                )
            )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=completions,
            finished=req.finished,
            metrics=req.metrics,
            num_cached_tokens=req.num_cached_tokens,
        )
