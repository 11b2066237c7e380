"""Speculator: the engine's hook for speculative decoding. Before scheduling it gives decoding
sequences draft tokens (how many: the adaptive controller); after the step it feeds the measured
step time and each verification's outcome back to the controller."""

from __future__ import annotations

import logging

import torch

from tachyllm.backends.base import Backend
from tachyllm.config import EngineConfig
from tachyllm.core.scheduler import Scheduler
from tachyllm.core.step_cost import StepCostModel
from tachyllm.loading import Checkpoint
from tachyllm.models.llama import LlamaForCausalLM
from tachyllm.sampling.sampler import Sampler
from tachyllm.spec_decode.adaptive import AdaptiveController
from tachyllm.spec_decode.draft_model import DraftModelProposer, build_draft_model, draft_blocks
from tachyllm.spec_decode.ngram import NgramProposer
from tachyllm.spec_decode.proposer import Proposer
from tachyllm.spec_decode.suffix import SuffixProposer
from tachyllm.speculative_config import SpeculativeConfig
from tachyllm.step import StepBatch, StepResult

logger = logging.getLogger("tachyllm")

# A draft model speculates for sequences it is at most this many tokens behind: catching up on a
# whole prompt is a prefill, which the per-step cost model does not account for. Others join one
# at a time, when a single sequence is given drafts (a probe, or a batch of one).
MAX_DRAFT_LAG = 8


class Speculator:
    def __init__(
        self,
        engine_config: EngineConfig,
        *,
        target: LlamaForCausalLM,
        ckpt: Checkpoint,
        sampler: Sampler,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        dtype: torch.dtype,
        backend: Backend,
        step_costs: StepCostModel,
    ):
        config = engine_config.speculative_config
        assert isinstance(config, SpeculativeConfig), "EngineConfig.__post_init__ parses speculative_config"
        self.config = config
        self.max_model_len = max_model_len
        self.proposer: Proposer
        if config.method == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        elif config.method == "suffix":
            self.proposer = SuffixProposer(config)
        else:
            model = build_draft_model(engine_config, target, ckpt, dtype, backend, max_model_len)
            self.proposer = DraftModelProposer(
                model, draft_blocks(num_blocks, block_size, max_model_len), block_size, sampler, dtype, backend
            )
        self.controller = AdaptiveController(
            config.num_speculative_tokens, config.adaptive, config.disable_by_batch_size,
            has_draft_model=self.proposer.runs_forwards, step_costs=step_costs,
        )  # fmt: skip
        logger.info(
            "speculative decoding: %s, up to %d tokens per step, adaptive %s%s",
            config.model if config.method == "draft_model" else config.method,
            config.num_speculative_tokens, "on" if config.adaptive else "off",
            f", off above {config.disable_by_batch_size} running" if config.disable_by_batch_size else "",
        )  # fmt: skip
        # What this step's draft forwards cost: (tokens, seconds) each.
        self._proposal_costs: list[tuple[int, float]] = []

    def propose(self, scheduler: Scheduler) -> None:
        """Sets spec_token_ids on the running sequences that will decode this step."""
        running = scheduler.running
        proposer = self.proposer
        for seq in running:
            seq.clear_spec()
        proposer.release_finished(running)
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

        if not proposer.runs_forwards:
            # Free to propose: propose for every candidate, and only those with drafts speculate.
            if self.controller.can_skip_proposals(len(candidates), len(decoding), base_tokens):
                return
            drafts = proposer.propose([s for s, _ in candidates], [cap for _, cap in candidates])
            found = {s.seq_id: d for (s, _), d in zip(candidates, drafts) if d.token_ids}
            # Longest drafts first, for when only some rows pay (a suffix draft's length grows with
            # the match it rests on).
            candidates = sorted(
                ((s, cap) for s, cap in candidates if s.seq_id in found),
                key=lambda c: -len(found[c[0].seq_id].token_ids),
            )
        else:
            lags = {s.seq_id: proposer.lag(s) for s, _ in candidates}
            candidates.sort(key=lambda c: lags[c[0].seq_id])
            synced = [c for c in candidates if lags[c[0].seq_id] <= MAX_DRAFT_LAG]
            candidates = synced or candidates[:1]
        k = self.controller.choose(len(candidates), len(decoding), base_tokens, len(running))
        if k == 0:
            return
        candidates = candidates[: self.controller.num_rows]
        seqs = [s for s, _ in candidates]
        if not proposer.runs_forwards:
            for seq in seqs:
                seq.spec_token_ids = found[seq.seq_id].token_ids[:k]
            return
        for seq, draft in zip(seqs, proposer.propose(seqs, [min(k, cap) for _, cap in candidates])):
            seq.spec_token_ids, seq.spec_draft_probs = draft.token_ids, draft.probs
        self._proposal_costs = proposer.forward_costs

    @property
    def suffix_tree_nodes(self) -> int:
        """The size of suffix decoding's tree of finished outputs (0 for other methods)."""
        return self.proposer.global_trees.num_nodes if isinstance(self.proposer, SuffixProposer) else 0

    def observe(self, batch: StepBatch, result: StepResult, seconds: float) -> None:
        """Feeds the step's draft forwards and verifications to the controller (the step's own time
        reaches it through the shared step-cost model, which the scheduler feeds)."""
        for size, forward_seconds in self._proposal_costs:
            self.controller.record_proposal(size, forward_seconds)
        for r in result.seqs:
            if r.num_draft_tokens:
                self.controller.record_acceptance(r.num_draft_tokens, r.num_accepted)
