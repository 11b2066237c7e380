"""Suffix decoding (arXiv 2411.04975; vLLM's "suffix" method): drafts from suffix trees over the
sequence's own prompt and output and over the outputs of recently finished sequences, whichever
candidate scores higher. No model runs: a proposal is a walk down a tree, and its length adapts
to how long the match behind it is.

The tree of finished outputs is per engine (so per model) and per LoRA adapter, keyed by the
adapter's content digest: a request's drafts come only from its own text and from outputs of
requests that ran with the same weights. Drafts only propose; verification against the model
decides every emitted token, so another request's text can reach an output only where the model
itself would have produced it."""

from __future__ import annotations

from tachyllm.core.sequence import Sequence
from tachyllm.spec_decode.proposer import Draft, Proposer
from tachyllm.spec_decode.suffix_tree import GlobalSuffixTrees, SuffixTree, require_native_trees
from tachyllm.speculative_config import SpeculativeConfig


class SuffixProposer(Proposer):
    def __init__(self, config: SpeculativeConfig):
        require_native_trees()  # refused at engine start, not at the first proposal
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        # Outputs only: drafts from them merely propose, verification decides what is emitted, so
        # one request's text never reaches another's output through these trees.
        self.global_trees = GlobalSuffixTrees(self.max_depth, config.suffix_decoding_max_cached_requests)
        # Each sequence's tree and the sequence it follows; kept while the sequence is preempted,
        # since its tokens stay the same and only its KV is recomputed.
        self._trees: dict[int, tuple[Sequence, SuffixTree]] = {}

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        return [Draft(self.draft(seq, k)) for seq, k in zip(seqs, ks)]

    def draft(self, seq: Sequence, k: int) -> list[int]:
        tree = self._tree(seq)
        context = seq.token_ids[-self.max_depth :]
        own = tree.speculate_own(k, self.max_spec_factor, self.min_token_prob)
        shared = self.global_trees.speculate(
            context, k, self.max_spec_factor, self.min_token_prob, key=seq.request.lora_digest
        )
        return (own if own.score >= shared.score else shared).token_ids

    def _tree(self, seq: Sequence) -> SuffixTree:
        """seq's tree, extended by the tokens accepted since the last proposal."""
        entry = self._trees.get(seq.seq_id)
        if entry is None:
            entry = self._trees[seq.seq_id] = (seq, SuffixTree(self.max_depth))
        tree = entry[1]
        tree.extend(seq.token_ids[tree.num_tokens :])
        return tree

    def release_finished(self, running: list[Sequence]) -> None:
        """Finished sequences' outputs go into the global tree and their own trees are dropped."""
        live = {s.seq_id for s in running}
        for seq_id, (seq, _) in list(self._trees.items()):
            if seq_id not in live and seq.is_finished:
                del self._trees[seq_id]
                self.global_trees.add(seq_id, seq.output_token_ids, key=seq.request.lora_digest)
