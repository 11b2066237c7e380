"""Suffix trees for suffix decoding (arXiv 2411.04975): every substring of at most max_depth
tokens of the text put in, as a trie whose nodes count their occurrences. A draft follows a
suffix of the context found in a tree, then the most frequent continuation token by token; every
suffix length is tried and the draft with the most expected accepted tokens is taken.

`SuffixTree` is one request's prompt and output, extended as tokens are accepted: appending a
token extends the at most max_depth suffixes that end at the previous token, O(max_depth) work,
never a rebuild. `GlobalSuffixTree` holds the outputs of the last N finished sequences and
removes the oldest one's counts when a newer one comes in, which bounds its size.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)  # slots: a tree holds up to max_depth nodes per token put in
class SuffixNode:
    count: int = 0  # occurrences of the path from the root to here
    continued: int = 0  # of those, how many are followed by another token (the children's counts)
    children: dict[int, SuffixNode] = field(default_factory=dict)


@dataclass
class Candidate:
    """A draft and what the paper ranks drafts by: score is the expected number of accepted
    tokens, the sum over the draft of the probability of reaching and matching each token."""

    token_ids: list[int]
    match_length: int
    score: float


NO_CANDIDATE = Candidate([], 0, 0.0)


class SuffixTree:
    """One token stream's substrings of up to max_depth tokens, appended to in place."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = SuffixNode()
        self.num_nodes = 1
        self.num_tokens = 0
        # The nodes of the suffixes of the text so far that are shorter than max_depth (the ones
        # the next token extends), longest first.
        self._open: list[SuffixNode] = []

    def start_text(self) -> None:
        """Begins another text in the same tree: no substring spans the texts' boundary."""
        self._open = []

    def extend(self, token_ids: list[int]) -> None:
        for token in token_ids:
            extended = []
            for node in [*self._open, self.root]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = SuffixNode()
                    self.num_nodes += 1
                child.count += 1
                node.continued += 1
                extended.append(child)
            self.num_tokens += 1
            # Suffixes that reached max_depth are extended no further.
            self._open = extended[-(self.max_depth - 1) :] if self.max_depth > 1 else []

    def remove(self, token_ids: list[int]) -> None:
        """Takes away the counts that extend(token_ids) added as a text of its own; nodes left
        with no occurrences are deleted."""
        for start in range(len(token_ids)):
            node = self.root
            for token in token_ids[start : start + self.max_depth]:
                child = node.children[token]
                child.count -= 1
                node.continued -= 1
                if child.count == 0:
                    self.num_nodes -= self._subtree_size(child)
                    del node.children[token]
                    break
                node = child

    def _subtree_size(self, node: SuffixNode) -> int:
        return 1 + sum(self._subtree_size(c) for c in node.children.values())

    def _find(self, tokens: list[int]) -> SuffixNode | None:
        """The node that `tokens` lead to from the root, or None where the tree does not hold them."""
        node = self.root
        for token in tokens:
            child = node.children.get(token)
            if child is None:
                return None
            node = child
        return node

    def speculate(
        self, context: list[int], max_tokens: int, max_spec_factor: float, min_token_prob: float
    ) -> Candidate:
        """The best-scored draft to follow context over every match length: for each suffix of
        context found in the tree (at most max_depth - 1 tokens, so that a token can follow), the
        most frequent child token by token while the probability of the draft so far stays at
        least min_token_prob, at most max_spec_factor times the match length (the paper's
        adaptive length: a long match is evidence that the text repeats) and within the tree's
        depth. A long match leaves few levels to draft from, a short one is weaker evidence: the
        score settles it (the longer match on a tie)."""
        best = NO_CANDIDATE
        for length in range(1, min(self.max_depth - 1, len(context)) + 1):
            node = self._find(context[len(context) - length :])
            if node is None:
                break  # a longer suffix contains this one, so it is not in the tree either
            limit = min(max_tokens, int(max_spec_factor * length))
            candidate = self._follow(node, length, limit, min_token_prob)
            if candidate.token_ids and candidate.score >= best.score:
                best = candidate
        return best

    @staticmethod
    def _follow(node: SuffixNode, match_length: int, limit: int, min_token_prob: float) -> Candidate:
        draft: list[int] = []
        reach, score = 1.0, 0.0
        while len(draft) < limit and node.continued:
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            reach *= child.count / node.continued
            if reach < min_token_prob:
                break
            draft.append(token)
            score += reach
            node = child
        return Candidate(draft, match_length, score)


class GlobalSuffixTree:
    """The outputs of the last max_sequences finished sequences in one tree."""

    def __init__(self, max_depth: int, max_sequences: int):
        self.tree = SuffixTree(max_depth)
        self.max_sequences = max_sequences
        self._outputs: OrderedDict[int, list[int]] = OrderedDict()

    def add(self, seq_id: int, output_token_ids: list[int]) -> None:
        if not output_token_ids or self.max_sequences == 0:
            return
        while len(self._outputs) >= self.max_sequences:
            _, oldest = self._outputs.popitem(last=False)
            self.tree.remove(oldest)
        self._outputs[seq_id] = list(output_token_ids)
        self.tree.start_text()
        self.tree.extend(self._outputs[seq_id])

    @property
    def num_sequences(self) -> int:
        return len(self._outputs)

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes

    def speculate(
        self, context: list[int], max_tokens: int, max_spec_factor: float, min_token_prob: float
    ) -> Candidate:
        return self.tree.speculate(context, max_tokens, max_spec_factor, min_token_prob)
