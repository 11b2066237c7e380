"""Per-request scheduling state: a Request groups the n Sequences sampled from one prompt. What
callers see of a request (its text, logprobs) is the output processor's (engine/output_processor.py)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from tachyllm.outputs import RequestMetrics
from tachyllm.sampling_params import SamplingParams
from tachyllm.step import LogprobInfo, PoolingInput
from tachyllm.structured_output.grammar import Grammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One token stream. Its KV lives in the blocks of block_table (and window_block_table); the first
    num_computed_tokens of token_ids have KV in the cache, the rest still need a forward."""

    request: Request
    index: int  # position among the request's n samples
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # The sliding-window layers' blocks, where they have a pool of their own (core/block_manager.py):
    # as long as block_table, the blocks before the window of its next query released (NULL_BLOCK).
    window_block_table: list[int] = field(default_factory=list)
    # Hash of each full block in block_table order (prefix caching); grows as blocks fill.
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks of block_table already registered in the prefix cache
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # Speculative decoding: tokens proposed for this step (after the last token) and, for a sampled
    # draft model, the draft's distribution each was drawn from ([len, vocab]); cleared every step.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: torch.Tensor | None = None
    # Structured outputs: where the sequence is in its grammar (advanced by every accepted token).
    grammar: Grammar | None = None
    num_preemptions: int = 0  # times its KV was freed to make room; each is recomputed on resuming
    # An encoder's input (no KV cache): computed whole in one step, holding no blocks.
    kv_free: bool = False

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def clear_spec(self) -> None:
        self.spec_token_ids = []
        self.spec_draft_probs = None

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether this sequence still scores prompt positions: a request's prompt logprobs are
        computed by its first sample, once (a recompute after preemption skips the known ones)."""
        return (
            self.index == 0
            and self.params.prompt_logprobs is not None
            and len(self.request.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def arrival_order(self) -> tuple[int, float, int]:
        """Sort key: lower priority value first, then earlier arrival."""
        return (self.request.priority, self.request.metrics.arrival_time, self.seq_id)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    priority: int = 0
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    # Prompt logprobs known so far (SamplingParams.prompt_logprobs): entry i scores prompt token i + 1.
    prompt_logprobs: list[LogprobInfo] = field(default_factory=list)
    # The LoRA adapter it runs with: its slot (0: the base model), and its content digest, which keys
    # the request's prefix-cache blocks apart from the base model's and other adapters'.
    lora_slot: int = 0
    lora_digest: bytes = b""
    # A pooling request (docs/pooling.md; `params` are then neutral defaults, unused): how it pools (its
    # token types included), and its result once computed.
    pooling: PoolingInput | None = None
    pooled: torch.Tensor | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
