"""Speculator: the engine's hook for speculative decoding. Before scheduling it gives decoding
sequences draft tokens (how many: the adaptive controller); after the step it feeds the measured
step time and each verification's outcome back to the controller."""

from __future__ import annotations

import logging

import torch

from tachyllm.backends.base import Backend
from tachyllm.engine.scheduler import Scheduler, SchedulerOutput
from tachyllm.engine.sequence import Sequence
from tachyllm.loading import Checkpoint
from tachyllm.models.llama import LlamaForCausalLM
from tachyllm.runner.sampler import Sampler
from tachyllm.spec_decode.adaptive import AdaptiveController
from tachyllm.spec_decode.config import SpeculativeConfig
from tachyllm.spec_decode.draft_model import DraftModelProposer, build_draft_model, draft_blocks
from tachyllm.spec_decode.ngram import NgramProposer

logger = logging.getLogger("tachyllm")

# A draft model speculates for sequences it is at most this many tokens behind: catching up on a
# whole prompt is a prefill, which the per-step cost model does not account for. Others join one
# at a time, when a single sequence is given drafts (a probe, or a batch of one).
MAX_DRAFT_LAG = 8


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        target: LlamaForCausalLM,
        ckpt: Checkpoint,
        sampler: Sampler,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        dtype: torch.dtype,
        backend: Backend,
    ):
        self.config = config
        self.max_model_len = max_model_len
        self.ngram: NgramProposer | None = None
        self.draft: DraftModelProposer | None = None
        if config.method == "ngram":
            self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        else:
            model = build_draft_model(config.model, target, ckpt, dtype, backend, max_model_len)
            self.draft = DraftModelProposer(
                model, draft_blocks(num_blocks, block_size, max_model_len), block_size, sampler, dtype, backend
            )
        self.controller = AdaptiveController(
            config.num_speculative_tokens, config.adaptive, config.disable_by_batch_size,
            has_draft_model=self.draft is not None,
        )  # fmt: skip
        # What this step's draft forwards cost: (tokens, seconds) each.
        self._proposal_costs: list[tuple[int, float]] = []
        logger.info(
            "speculative decoding: %s, up to %d tokens per step, adaptive %s%s", config.method if self.ngram else config.model,
            config.num_speculative_tokens, "on" if config.adaptive else "off",
            f", off above {config.disable_by_batch_size} running" if config.disable_by_batch_size else "",
        )  # fmt: skip

    def propose(self, scheduler: Scheduler) -> None:
        """Sets spec_token_ids on the running sequences that will decode this step."""
        running = scheduler.running
        self.clear(running)
        if self.draft is not None:
            self.draft.release_finished(running)
        self._proposal_costs = []
        decoding = [s for s in running if s.num_uncomputed_tokens == 1]
        # Drafts past max_tokens or the context limit could never be used.
        caps = [min(self.config.num_speculative_tokens, s.params.max_tokens - s.num_output_tokens - 1,
                    self.max_model_len - s.num_tokens) for s in decoding]  # fmt: skip
        candidates = [(s, cap) for s, cap in zip(decoding, caps) if cap >= 1]
        if not candidates:
            return
        prefill_tokens = sum(s.num_uncomputed_tokens for s in running if s.num_uncomputed_tokens > 1)
        base_tokens = len(decoding) + min(prefill_tokens, scheduler.max_num_batched_tokens - len(decoding))

        lookups: dict[int, list[int]] = {}
        if self.ngram is not None and self.controller.can_skip_proposals(len(candidates), len(decoding), base_tokens):
            return
        if self.ngram is not None:
            for seq, cap in candidates:
                drafts = self.ngram.propose(seq, cap)
                if drafts:
                    lookups[seq.seq_id] = drafts
            candidates = [(s, cap) for s, cap in candidates if s.seq_id in lookups]
        else:
            lags = {s.seq_id: self.draft.lag(s) for s, _ in candidates}
            candidates.sort(key=lambda c: lags[c[0].seq_id])
            synced = [c for c in candidates if lags[c[0].seq_id] <= MAX_DRAFT_LAG]
            candidates = synced or candidates[:1]
        k = self.controller.choose(len(candidates), len(decoding), base_tokens, len(running))
        if k == 0:
            return
        if self.controller.probing:
            candidates = candidates[:1]
        if self.ngram is not None:
            for seq, _ in candidates:
                seq.spec_token_ids = lookups[seq.seq_id][:k]
        else:
            self.draft.propose([s for s, _ in candidates], [min(k, cap) for _, cap in candidates])
            self._proposal_costs = self.draft.forward_costs

    def observe(self, sched: SchedulerOutput, step_seconds: float, outcomes: list[tuple[int, int]]) -> None:
        """outcomes: (draft tokens, accepted) of each verification this step."""
        self.controller.record_step(sched.num_batched_tokens, step_seconds)
        for size, seconds in self._proposal_costs:
            self.controller.record_proposal(size, seconds)
        for num_drafts, num_accepted in outcomes:
            self.controller.record_acceptance(num_drafts, num_accepted)

    @staticmethod
    def clear(seqs: list[Sequence]) -> None:
        for seq in seqs:
            seq.clear_spec()
