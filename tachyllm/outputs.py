"""What the engine hands back to callers: RequestOutput with one CompletionOutput per sample."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: str


# One dict per generated token: token id -> Logprob (the top-N plus the chosen token).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token, as vLLM has it: None for the first (nothing precedes it), then token id ->
# Logprob (the top-N plus the prompt token itself), each given the tokens before it.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop" | "length" | "abort" | "error" | "rejected" | None while running. "rejected": the request's own
    # input failed once it ran (a structured-output constraint that broke at a token; RequestOutput.error
    # says why), as opposed to "error", a failure of the engine.
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (rejected: why)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def extend(self, delta: CompletionOutput) -> None:
        """Appends what a later DELTA output of this choice added (its text is the caller's to join)
        and takes its end state."""
        self.token_ids += delta.token_ids
        if self.logprobs is not None and delta.logprobs is not None:
            self.logprobs += delta.logprobs
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        self.cumulative_logprob = delta.cumulative_logprob


class RequestEvent(NamedTuple):
    """Something that happened to a request in the engine, for its trace: "scheduled" / "resumed" (with the
    prompt tokens found in the prefix cache), "prefill_chunk", "preempted", "model_step" (detailed traces)."""

    name: str
    time: float  # time.time()
    attributes: dict[str, Any]


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) recorded by the engine, and what users derive from them."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0
    # Speculative decoding (vLLM's definitions): verification steps that carried draft tokens, the
    # draft tokens proposed, and those the target accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # Output tokens of each sample (choice), set when the request finishes.
    sample_output_tokens: list[int] = field(default_factory=list)
    num_preemptions: int = 0  # times a sequence of the request was preempted for lack of KV blocks
    params_n: int = 1  # the request's n and max_tokens (vLLM's request_params_* metrics)
    params_max_tokens: int | None = None
    # The request's trace events, in order: a list only when the engine traces requests
    # (otlp_traces_endpoint), else None, so that an untraced request records nothing.
    events: list[RequestEvent] | None = None

    def record(self, name: str, time: float, **attributes: Any) -> None:
        """Adds a trace event; a no-op for an untraced request. Callers on hot paths check `events` first."""
        if self.events is not None:
            self.events.append(RequestEvent(name, time, attributes))

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def mean_tpot(self) -> float | None:
        """Mean time per output token after the first: (last - first token time) / (tokens - 1)."""
        if self.first_token_time is None or self.last_token_time is None or self.num_generated_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generated_tokens - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Set when this request failed: refused (e.g. prompt too long; outputs is then empty), rejected once it
    # ran (finish_reason "rejected"), or the engine failed while running it (finish_reason "error").
    error: str | None = None
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: every prompt token's, once the prefill is done (a DELTA output
    # carries them once, in the first output after the prefill).
    prompt_logprobs: PromptLogprobs | None = None

    def __repr__(self) -> str:
        texts = [o.text for o in self.outputs]
        return (
            f"RequestOutput(id={self.request_id!r}, finished={self.finished}, outputs={texts!r}, error={self.error!r})"
        )


@dataclass
class PoolingOutput:
    """A pooling request's result: an embedding, or a classifier's outputs (fp32, on the CPU)."""

    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    """The one, final output of a pooling request (vLLM's). `error`: why it failed (`outputs.data` is then
    empty)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool
    metrics: RequestMetrics
    error: str | None = None

    def __repr__(self) -> str:
        shape = tuple(self.outputs.data.shape)
        return f"PoolingRequestOutput(id={self.request_id!r}, shape={shape}, error={self.error!r})"


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class EmbeddingRequestOutput:
    """A PoolingRequestOutput seen as an embedding (vLLM's typed view)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool
    error: str | None = None

    @classmethod
    def from_base(cls, base: PoolingRequestOutput) -> EmbeddingRequestOutput:
        data = base.outputs.data
        return cls(base.request_id, base.prompt_token_ids, EmbeddingOutput(data.tolist()), base.finished, base.error)


@dataclass
class ScoringRequestOutput:
    """A PoolingRequestOutput seen as one score (vLLM's typed view): a cross-encoder's sigmoid score, or
    the cosine similarity of two embeddings."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool
    error: str | None = None

    @classmethod
    def from_base(cls, base: PoolingRequestOutput) -> ScoringRequestOutput:
        data = base.outputs.data
        score = float(data.reshape(-1)[0]) if data.numel() else float("nan")
        return cls(base.request_id, base.prompt_token_ids, ScoringOutput(score), base.finished, base.error)


@dataclass
class ClassificationRequestOutput:
    """A PoolingRequestOutput seen as class probabilities (vLLM's typed view)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool
    error: str | None = None

    @classmethod
    def from_base(cls, base: PoolingRequestOutput) -> ClassificationRequestOutput:
        data = base.outputs.data
        return cls(
            base.request_id, base.prompt_token_ids, ClassificationOutput(data.tolist()), base.finished, base.error
        )


# What an engine emits: a generation request's output, or a pooling request's (final) one.
EngineOutput = RequestOutput | PoolingRequestOutput


class DeltaAccumulator:
    """Adds up a request's DELTA outputs (RequestOutputKind.DELTA) into one output holding everything
    so far, in O(size of each delta): texts are joined once, when result() is asked for."""

    def __init__(self) -> None:
        self._out: RequestOutput | None = None
        self._texts: dict[int, list[str]] = {}

    def add(self, delta: RequestOutput) -> None:
        if self._out is None:
            self._out = delta
            self._texts = {c.index: [c.text] for c in delta.outputs}
            return
        out = self._out
        for c in delta.outputs:
            out.outputs[c.index].extend(c)
            self._texts[c.index].append(c.text)
        out.finished, out.error, out.metrics = delta.finished, delta.error, delta.metrics
        if delta.prompt_logprobs is not None:
            out.prompt_logprobs = delta.prompt_logprobs

    def result(self) -> RequestOutput:
        out = self._out
        assert out is not None, "result() follows at least one add()"
        for c in out.outputs:
            parts = self._texts[c.index]
            c.text = parts[0] if len(parts) == 1 else "".join(parts)
            self._texts[c.index] = [c.text]
        return out


# Upper bounds of the tokens-per-step histogram (vLLM's iteration_tokens_total buckets).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class StepStats:
    """Counters the engine accumulates; the server and logs read them."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    finished_reasons: dict[str, int] = field(default_factory=dict)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # [i] = drafts whose token at position i (0-based) was accepted; acceptance at i = this / drafts
    # that reached position i, and accepted / draft tokens overall.
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    spec_draft_tokens_per_pos: list[int] = field(default_factory=list)
    spec_suffix_tree_nodes: int = 0  # suffix decoding: the global tree's size now (a gauge)
    # Steps by the tokens their forward computed: [i] counts steps of at most ITERATION_TOKEN_BUCKETS[i]
    # tokens (and more than the bound before); the last entry, steps above every bound.
    iteration_token_steps: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1))
    iteration_tokens: int = 0  # their sum

    def record_iteration(self, num_tokens: int) -> None:
        self.iteration_token_steps[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1
        self.iteration_tokens += num_tokens

    def record_spec(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_draft_tokens
        self.spec_num_accepted_tokens += num_accepted
        grow = num_draft_tokens - len(self.spec_draft_tokens_per_pos)
        if grow > 0:
            self.spec_draft_tokens_per_pos += [0] * grow
            self.spec_accepted_per_pos += [0] * grow
        for i in range(num_draft_tokens):
            self.spec_draft_tokens_per_pos[i] += 1
        for i in range(num_accepted):
            self.spec_accepted_per_pos[i] += 1

    @property
    def spec_acceptance_rate(self) -> float | None:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else None

    @property
    def spec_mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts: tokens gained per verification step, the bonus token included."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else None
