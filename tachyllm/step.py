"""The plain data that crosses between scheduling and execution, once per step (vLLM v1's rule).

The scheduler decides how many new tokens each sequence computes and describes the step as a
StepBatch; the model runner (and the backend it runs on) reads only that, never the scheduler's
own objects; the runner answers with a StepResult, which the scheduler alone applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tachyllm.sampling_params import SamplingParams

# (chosen token's logprob, its rank, top ids, top logprobs) of one sampled position.
LogprobInfo = tuple[float, int, list[int], list[float]]


@dataclass(eq=False)
class SamplingInput:
    """What sampling needs of the sequence a row belongs to."""

    params: SamplingParams
    # The sequence's tokens so far, prompt then output. The scheduler's own list, shared rather than
    # copied (a copy per step would cost O(tokens so far)): read-only for the runner.
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None = None
    # For drafts a draft model sampled: the distribution each was drawn from ([drafts, vocab]).
    draft_probs: torch.Tensor | None = None
    # Structured outputs: int32 [1 + drafts, vocab / 32], the tokens the grammar allows at the
    # sampled position and after each draft token (one bit per token; structured_output/grammar.py).
    token_bitmask: torch.Tensor | None = None

    @property
    def allowed_tokens(self) -> torch.Tensor | None:
        """The bitmask row of the position sampled after the sequence's tokens."""
        return None if self.token_bitmask is None else self.token_bitmask[0]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(eq=False)
class PromptLogprobsInput:
    """Prompt logprobs (SamplingParams.prompt_logprobs) wanted from some of a sequence's rows this step:
    rows first_row .. first_row + len(target_ids) - 1 of its step, each scored for the prompt token
    that follows it (for the last row of a chunk, the next chunk's first token)."""

    num_logprobs: int  # top-N alternatives besides the prompt token itself
    first_row: int
    target_ids: list[int]


@dataclass(eq=False)
class PoolingInput:
    """How a pooling sequence's hidden states become its result (docs/pooling.md): pooled over its
    tokens (MEAN, CLS: the first, LAST), then for "embed" cut to `dimensions` and L2-normalised, for
    "classify" / "score" passed through the model's classification head."""

    pooling_type: str  # "MEAN", "CLS" or "LAST"
    task: str  # "embed", "classify" or "score"
    normalize: bool
    dimensions: int | None = None
    token_type_ids: list[int] | None = None  # an encoder input's token types (None: all 0)


@dataclass(eq=False, kw_only=True)
class ScheduledSeq:
    """One sequence's share of a step: the tokens it computes and where their K/V goes."""

    seq_id: int
    request_id: str
    start: int  # tokens with K/V before this step: the position of the first new token
    token_ids: list[int]  # this step's tokens: the next uncomputed ones, then any draft tokens
    num_draft_tokens: int
    block_table: list[int]  # the sequence's KV blocks (the scheduler's list: read-only here)
    seq_len: int  # the sequence's length without drafts (a prompt's length while it is prefilled)
    # After this step every token of the sequence has K/V, so its last position is sampled.
    completes: bool
    sampling: SamplingInput | None = None  # what sampling needs, when the step samples this sequence
    prompt_logprobs: PromptLogprobsInput | None = None  # prompt rows to score, when its request asks
    # The sliding-window layers' own blocks (read-only), where they have a pool of their own; entries
    # before the window of the step's first query are placeholders that attention never reads.
    window_block_table: list[int] | None = None
    lora_slot: int = 0  # the loaded LoRA adapter the sequence runs with (tachyllm/lora); 0: the base model
    # A pooling sequence (prefill only): its rows are pooled, none sampled; when `completes`, the result
    # carries its pooled vector.
    pooling: PoolingInput | None = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_real_tokens(self) -> int:
        return len(self.token_ids) - self.num_draft_tokens

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[self.num_real_tokens :]

    @property
    def is_decode(self) -> bool:
        """One real token (and maybe drafts after it): the few queries at the end of a context."""
        return self.num_real_tokens == 1


@dataclass
class StepBatch:
    seqs: list[ScheduledSeq]  # batch row order: decodes first, then prefill chunks
    # Sequences that ended (finished, aborted, preempted) since the previous batch: per-sequence
    # state kept by the runner or a backend is dropped.
    finished_seq_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass
class SeqResult:
    """The tokens one sampled sequence gained: one token, or for a speculating sequence its accepted
    draft tokens followed by the target's own next token."""

    seq_id: int
    token_ids: list[int]
    logprobs: list[LogprobInfo | None]
    num_draft_tokens: int = 0
    num_accepted: int = 0


@dataclass
class StepResult:
    seqs: list[SeqResult]
    # seq id -> the logprob entry of each row its PromptLogprobsInput asked for, in row order.
    prompt_logprobs: dict[int, list[LogprobInfo]] = field(default_factory=dict)
    # seq id -> the result of each pooling sequence the step completed (fp32, on the CPU).
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)
