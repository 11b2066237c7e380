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
from tachyllm.spec_decode.suffix_tree import GlobalSuffixTrees, SuffixTree, propose_drafts, require_native_trees
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
        """Each sequence's tree is brought up to date with the tokens accepted since its last
        proposal (never rebuilt) and drafts from it or from the tree of finished outputs, all rows
        in one native call."""
        trees, new_tokens = [], []
        for seq in seqs:
            entry = self._trees.get(seq.seq_id)
            if entry is None:
                entry = self._trees[seq.seq_id] = (seq, SuffixTree(self.max_depth))
            trees.append(entry[1])
            new_tokens.append(seq.token_ids[entry[1].num_tokens :])
        shared = [self.global_trees.trees.get(seq.request.lora_digest) for seq in seqs]
        drafts = propose_drafts(trees, new_tokens, shared, ks, self.max_spec_factor, self.min_token_prob)
        return [Draft(draft) for draft in drafts]

    def release_finished(self, running: list[Sequence]) -> None:
        """Finished sequences' outputs go into the global tree and their own trees are dropped."""
        live = {s.seq_id for s in running}
        for seq_id, (seq, _) in list(self._trees.items()):
            if seq_id not in live and seq.is_finished:
                del self._trees[seq_id]
                self.global_trees.add(seq_id, seq.output_token_ids, key=seq.request.lora_digest)
