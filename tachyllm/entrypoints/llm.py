"""The offline API: LLM(...).generate / .chat, and for a pooling model .embed / .score / .classify /
.encode (docs/pooling.md), named and shaped like vLLM's."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence as SequenceABC
from dataclasses import fields, replace
from typing import Any, cast

import torch
import torch.nn.functional as F
from tqdm import tqdm

from tachyllm.chat_template import read_chat_template
from tachyllm.config import EngineConfig
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.engine_args import HUB_FLAGS, NO_HUB
from tachyllm.errors import ConfigError, RequestError
from tachyllm.loading.tokenizer import Tokenizer
from tachyllm.lora.request import LoRARequest
from tachyllm.otel import RequestTracer, TracedRequest, TraceOptions
from tachyllm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    EngineOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
    ScoringRequestOutput,
)
from tachyllm.pooling_params import PoolingParams, PoolingTask
from tachyllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("tachyllm")

Prompt = str | list[int] | dict
Message = dict[str, Any]


class LLM:
    """LLM(model=None loads the embedded SmolLM2-135M-Instruct). Keyword options are EngineConfig's."""

    def __init__(self, model: str | None = None, **options):
        # vLLM's hub options: trust_remote_code means nothing here (no checkpoint code runs); the others fetch.
        options.pop("trust_remote_code", None)
        hub = sorted(name for name in options if f"--{name.replace('_', '-')}" in HUB_FLAGS)
        if hub:
            raise ConfigError(f"{', '.join(hub)}: {NO_HUB}")
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown LLM option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        config = EngineConfig(model=model, **options)
        # Before the weights load: a missing tracing extra fails at once.
        self._tracer = None
        if config.otlp_traces_endpoint is not None:
            self._tracer = RequestTracer(TraceOptions(config.otlp_traces_endpoint, config.otlp_traces_record_text))
        self.engine = LLMEngine(config)
        self._ids = itertools.count()
        self._built_in = threading.get_ident()
        self._warned_thread = False

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (or --tokenizer's; with --chat-template's template, if one was given): encode,
        decode, apply_chat_template (text, or token ids with tokenize=True), get_vocab, special token ids, and
        what code written for a transformers tokenizer calls: tokenizer(text).input_ids, batch_decode,
        convert_ids_to_tokens, convert_tokens_to_ids, pad_token_id, eos_token_id, len()."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation config values (--generation-config auto, as in
        vLLM), else tachyllm's defaults; what generate uses when given no sampling_params."""
        return SamplingParams(**self.engine.default_sampling_params)

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in input order. A prompt that cannot
        be served (empty, too long, a LoRA adapter that cannot be loaded, ...) gets an output with `error`
        set; the others still run. `lora_request`: the LoRA adapter of every prompt, or one per prompt
        (None: the base model); the LLM needs enable_lora=True."""
        return self._generate(prompts, sampling_params, use_tqdm, lora_request, "text_completion")

    def _generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None,
        use_tqdm: bool,
        lora_request: LoRARequest | list[LoRARequest | None] | None,
        operation: str,
    ) -> list[RequestOutput]:
        self._check_thread()
        call_start = time.time()
        prompt_list = _as_prompt_list(prompts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompt_list):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompt_list)} prompts")
            params_list = sampling_params
        else:
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompt_list)
        if isinstance(lora_request, list):
            if len(lora_request) != len(prompt_list):
                raise ValueError(f"got {len(lora_request)} lora_request for {len(prompt_list)} prompts")
            lora_list = lora_request
        else:
            lora_list = [lora_request] * len(prompt_list)

        results: dict[str, EngineOutput] = {}
        order: list[str] = []
        traced: dict[str, TracedRequest] = {}
        for prompt, params, lora in zip(prompt_list, params_list, lora_list):
            request_id = str(next(self._ids))
            order.append(request_id)
            prompt_arg = prompt
            if self._tracer is not None:
                traced[request_id] = TracedRequest(
                    time.time(), operation, self.engine.model_name, request_id, [params],
                    record_text=self._tracer.options.record_text,
                )  # fmt: skip
            try:
                prompt_arg = _prompt_value(prompt)
                # Only the final output is kept: no copy of the completion so far at every step.
                req = self.engine.add_request(
                    request_id, prompt_arg, replace(params, output_kind=RequestOutputKind.FINAL_ONLY), lora_request=lora
                )
                if request_id in traced:
                    traced[request_id].admitted_time = req.metrics.arrival_time
                    traced[request_id].prompts = [req.prompt]
            except RequestError as e:
                logger.warning("request %s rejected: %s", request_id, e)
                token_ids = list(prompt_arg) if isinstance(prompt_arg, list) else []
                text = prompt_arg if isinstance(prompt_arg, str) else None
                results[request_id] = RequestOutput(
                    request_id, text, token_ids, [], True, RequestMetrics(time.time()), error=str(e)
                )
        try:
            self._run(results, len(order) - len(results), use_tqdm)
        finally:
            if self._tracer is not None:
                self._trace_call(call_start, traced, results)
        return [_generated(results[i]) for i in order]

    def _trace_call(self, start: float, traced: dict[str, TracedRequest], results: dict[str, EngineOutput]) -> None:
        """One trace per generate call: a root span, and an llm_request span per prompt under it."""
        tracer = self._tracer
        assert tracer is not None, "called only when this LLM traces its calls"
        root = tracer.start(None, start, name="llm_generate")
        for request_id, request in traced.items():
            span = tracer.start(None, request.start_time, parent=root)
            if (out := results.get(request_id)) is not None:
                assert isinstance(out, RequestOutput), "only generation calls are traced"
                if out.outputs:
                    request.observe(out)
                else:  # refused before it ran
                    request.error = out.error
            tracer.finish(span, request, out.metrics.finished_time if out is not None else None)
        root.end()

    def _check_thread(self) -> None:
        """Warns once when generating from another thread than the one that built this LLM: each
        thread that runs OpenMP kernels keeps its own worker pool, and with two pools libgomp
        throttles its spin-waits (offline 64 x 128/128 on 2 cores measured ~15-25% slower)."""
        if self._warned_thread or threading.get_ident() == self._built_in or self.engine.device.type != "cpu":
            return
        self._warned_thread = True
        logger.warning(
            "LLM.generate called from another thread than the one that built this LLM: on CPU each thread running "
            "the engine keeps its own OpenMP worker pool, which slowed batched steps by ~15-25%% in our measurements; "
            "build the LLM in the thread that generates"
        )

    def _run(self, results: dict[str, EngineOutput], num_requests: int, use_tqdm: bool) -> None:
        bar = tqdm(total=num_requests, desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start, out_tokens = time.perf_counter(), 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if isinstance(out, RequestOutput):
                            out_tokens += sum(len(o.token_ids) for o in out.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"output {out_tokens / (time.perf_counter() - start):.1f} tok/s")
        except BaseException:
            # Leave the engine clean (all blocks free) if generation is interrupted.
            self.engine.abort_all()
            raise
        finally:
            bar.close()

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Renders one conversation, or each of a list of them, in the model's chat template (or
        `chat_template`: the template's text or a Jinja file), then generates: one output per
        conversation, in order (vLLM's LLM.chat). `continue_final_message` continues the last
        (assistant) message instead of starting a new turn; `chat_template_kwargs` are template
        variables (e.g. {"enable_thinking": False}); `lora_request` as generate's. A conversation the
        template refuses raises RequestError before anything runs."""
        conversations = cast(
            list[list[dict[str, Any]]], [messages] if messages and isinstance(messages[0], dict) else messages
        )
        template = read_chat_template(chat_template) if chat_template is not None else None
        processor = self.engine.input_processor
        prompts: list[Prompt] = [
            {
                "prompt_token_ids": processor.chat_prompt_ids(
                    conv,
                    add_generation_prompt,
                    tools,
                    continue_final_message=continue_final_message,
                    chat_template=template,
                    template_vars=chat_template_kwargs,
                )
            }
            for conv in conversations
        ]
        return self._generate(prompts, sampling_params, use_tqdm, lora_request, "chat")

    # -- pooling models (docs/pooling.md) -----------------------------------------------------------
    def encode(
        self,
        prompts: Prompt | list[Prompt],
        pooling_params: PoolingParams | list[PoolingParams] | None = None,
        use_tqdm: bool = False,
        truncate_prompt_tokens: int | None = None,
        pooling_task: PoolingTask | None = None,
    ) -> list[PoolingRequestOutput]:
        """Runs every input through a pooling model; outputs in input order, each with its result's raw
        tensor. An input that cannot be served (empty, too long, a task the model does not serve) gets an
        output with `error` set; the others still run. `truncate_prompt_tokens` and `pooling_task` override
        the params' fields."""
        prompt_list = _as_prompt_list(prompts)
        if isinstance(pooling_params, list):
            if len(pooling_params) != len(prompt_list):
                raise ValueError(f"got {len(pooling_params)} pooling_params for {len(prompt_list)} prompts")
            params_list = pooling_params
        else:
            params_list = [pooling_params or PoolingParams(task=self._default_task())] * len(prompt_list)
        overrides: dict[str, Any] = {}
        if truncate_prompt_tokens is not None:
            overrides["truncate_prompt_tokens"] = truncate_prompt_tokens
        if pooling_task is not None:
            overrides["task"] = pooling_task
        return self._pool(
            [(p, replace(params, **overrides), None) for p, params in zip(prompt_list, params_list)], use_tqdm
        )

    def embed(
        self,
        prompts: Prompt | list[Prompt],
        pooling_params: PoolingParams | list[PoolingParams] | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[EmbeddingRequestOutput]:
        """Each input's embedding (vLLM's LLM.embed), in input order."""
        self._need_task("embed")
        outs = self.encode(prompts, pooling_params, use_tqdm, truncate_prompt_tokens, pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(out) for out in outs]

    def classify(
        self, prompts: Prompt | list[Prompt], truncate_prompt_tokens: int | None = None, use_tqdm: bool = False
    ) -> list[ClassificationRequestOutput]:
        """Each input's class probabilities from the model's classification head (vLLM's LLM.classify)."""
        self._need_task("classify")
        outs = self.encode(prompts, None, use_tqdm, truncate_prompt_tokens, pooling_task="classify")
        return [ClassificationRequestOutput.from_base(out) for out in outs]

    def score(
        self,
        text_1: str | list[str],
        text_2: str | list[str],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[ScoringRequestOutput]:
        """How well each text_2 matches its text_1 (vLLM's LLM.score): one text_1 against every text_2
        (1-to-1, 1-to-N), or pairwise (N-to-N). A cross-encoder scores each (text_1, text_2) pair with its
        classifier (the sigmoid of its one logit); an embedding model gives the cosine similarity of the
        two texts' embeddings."""
        firsts = [text_1] if isinstance(text_1, str) else list(text_1)
        seconds = [text_2] if isinstance(text_2, str) else list(text_2)
        if not firsts or not seconds:
            raise RequestError("score needs at least one text on each side", param="text_1" if not firsts else "text_2")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise RequestError(
                f"score pairs texts 1-to-1, 1-to-N or N-to-N; got {len(firsts)} text_1 and {len(seconds)} text_2",
                param="text_2",
            )
        tasks = self.engine.pooling_tasks
        if "score" in tasks:
            params = PoolingParams(task="score", truncate_prompt_tokens=truncate_prompt_tokens)
            outs = self._pool([(a, params, b) for a, b in zip(firsts, seconds)], use_tqdm)
            return [ScoringRequestOutput.from_base(out) for out in outs]
        self._need_task("embed")
        texts = list(dict.fromkeys(firsts + seconds))  # each distinct text embedded once
        params = PoolingParams(task="embed", truncate_prompt_tokens=truncate_prompt_tokens)
        embedded = dict(zip(texts, self._pool([(t, params, None) for t in texts], use_tqdm)))
        return [
            ScoringRequestOutput.from_base(_cosine(str(i), embedded[a], embedded[b]))
            for i, (a, b) in enumerate(zip(firsts, seconds))
        ]

    def _default_task(self) -> PoolingTask:
        return "embed" if "embed" in self.engine.pooling_tasks else "classify"

    def _need_task(self, task: str) -> None:
        if task not in self.engine.pooling_tasks:
            served = (
                ", ".join(sorted(self.engine.pooling_tasks)) or f"none: it runs the {self.engine.runner_type} runner"
            )
            raise RequestError(f"this model does not serve {task!r} (it serves: {served})", param="task")

    def _pool(
        self, items: list[tuple[Prompt, PoolingParams, str | None]], use_tqdm: bool
    ) -> list[PoolingRequestOutput]:
        """Runs pooling requests (input, params, the pair's second text or None) to completion, in order."""
        self._check_thread()
        results: dict[str, EngineOutput] = {}
        order: list[str] = []
        processor = self.engine.input_processor
        for prompt, params, pair in items:
            request_id = str(next(self._ids))
            order.append(request_id)
            try:
                processed = processor.process_pooling(_prompt_value(prompt), params, pair)
                self.engine.add_request(request_id, processed)
            except RequestError as e:
                logger.warning("request %s rejected: %s", request_id, e)
                token_ids = list(prompt) if isinstance(prompt, list) else []
                results[request_id] = PoolingRequestOutput(
                    request_id, token_ids, PoolingOutput(torch.empty(0)), True, RequestMetrics(time.time()), str(e)
                )
        self._run(results, len(order) - len(results), use_tqdm)
        outs = [results[i] for i in order]
        return [out for out in outs if isinstance(out, PoolingRequestOutput)]


def _generated(out: EngineOutput) -> RequestOutput:
    assert isinstance(out, RequestOutput), "a generation request's output"
    return out


def _cosine(request_id: str, a: PoolingRequestOutput, b: PoolingRequestOutput) -> PoolingRequestOutput:
    """The cosine similarity of two embeddings as one pooling output (the error of either, if one failed)."""
    error = a.error or b.error
    data = torch.empty(0) if error else F.cosine_similarity(a.outputs.data, b.outputs.data, dim=0).reshape(1)
    return PoolingRequestOutput(
        request_id, a.prompt_token_ids + b.prompt_token_ids, PoolingOutput(data), True, a.metrics, error
    )


def _prompt_value(prompt: Prompt) -> str | list[int]:
    """A prompt as the engine takes it: text or token ids, given as such or as vLLM's TextPrompt
    ({"prompt": str}) / TokensPrompt ({"prompt_token_ids": [...]})."""
    if not isinstance(prompt, dict):
        return prompt
    keys = set(prompt)
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if keys == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], list):
        return prompt["prompt_token_ids"]
    raise RequestError(
        'a prompt dict must be {"prompt": str} or {"prompt_token_ids": [int, ...]}, '
        f"got keys {sorted(map(str, keys))}",
        param="prompt",
    )


def _as_prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, SequenceABC) and prompts and all(isinstance(t, int) for t in prompts):
        return [cast(list[int], list(prompts))]  # one prompt given as token ids
    return list(cast(list[Prompt], prompts))
