"""Suffix trees for suffix decoding (arXiv 2411.04975): every substring of at most max_depth
tokens of the text put in, as a trie whose nodes count their occurrences. A draft follows a
suffix of the context found in a tree, then the most frequent continuation token by token (the
smallest token id on a tie); every suffix length is tried and the draft with the most expected
accepted tokens is taken.

The trees are C++ (kernels/csrc/suffix_tree.cpp): a proposal walks up to max_depth suffixes of
every decoding row each step, which costs tens of microseconds per row in Python. This module is
their face: `SuffixTree` is one token stream (a request's prompt and output, extended in place as
tokens are accepted, never rebuilt), `GlobalSuffixTrees` the outputs of the last N finished
sequences, one tree per adapter, the oldest output's counts removed when a newer one comes in. Where
the C++ kernels are unavailable the suffix method is refused when the engine starts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from tachyllm.errors import ConfigError
from tachyllm.kernels.native import native_ops


@dataclass
class Candidate:
    """A draft and what the paper ranks drafts by: score is the expected number of accepted
    tokens, the sum over the draft of the probability of reaching and matching each token."""

    token_ids: list[int]
    match_length: int
    score: float


def require_native_trees() -> Any:
    """The C++ kernels module that holds the trees; ConfigError where it could not be built."""
    ops = native_ops()
    if ops is None:
        raise ConfigError(
            "speculative_config: method 'suffix' needs tachyllm's C++ kernels (its suffix trees), which are"
            " unavailable here (no C++ compiler, or TACHY_NATIVE=0; see the warning above)"
        )
    return ops


class SuffixTree:
    """One token stream's substrings of up to max_depth tokens, appended to in place."""

    def __init__(self, max_depth: int):
        self._tree = require_native_trees().SuffixTree(max_depth)

    @property
    def max_depth(self) -> int:
        return int(self._tree.max_depth)

    @property
    def num_nodes(self) -> int:
        return int(self._tree.num_nodes)

    @property
    def num_tokens(self) -> int:
        """Tokens put in, over every text."""
        return int(self._tree.num_tokens)

    def start_text(self) -> None:
        """Begins another text in the same tree: no substring spans the texts' boundary."""
        self._tree.start_text()

    def extend(self, token_ids: list[int]) -> None:
        self._tree.extend(token_ids)

    def remove(self, token_ids: list[int]) -> None:
        """Takes away the counts that extend(token_ids) added as a text of its own; nodes left with
        no occurrences are deleted. ValueError (the tree unchanged) for a text never put in."""
        self._tree.remove(token_ids)

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
        token_ids, match_length, score = self._tree.speculate(context, max_tokens, max_spec_factor, min_token_prob)
        return Candidate(token_ids, match_length, score)

    def speculate_own(self, max_tokens: int, max_spec_factor: float, min_token_prob: float) -> Candidate:
        """speculate() with the tree's own text (since start_text) as the context, without walking
        the tree: the nodes of the text's suffixes are kept for the next token to extend. A row's
        walks over its own tree, large and cold in cache, were most of a step's proposal cost."""
        token_ids, match_length, score = self._tree.speculate_own(max_tokens, max_spec_factor, min_token_prob)
        return Candidate(token_ids, match_length, score)

    def recent(self) -> list[int]:
        """The last max_depth tokens of the text since start_text(): what its drafts follow."""
        return list(self._tree.recent())

    def lookup(self, path: list[int]) -> tuple[int, int] | None:
        """(occurrences, occurrences followed by another token) of path, None where it is absent."""
        found = self._tree.lookup(path)
        return None if found is None else (int(found[0]), int(found[1]))

    def entries(self) -> list[tuple[list[int], int, int]]:
        """Every node but the root as (path, count, continued), in path order: the whole content."""
        return [(list(path), int(count), int(continued)) for path, count, continued in self._tree.entries()]


def propose_drafts(
    own: list[SuffixTree],
    new_tokens: list[list[int]],
    shared: list[SuffixTree | None],
    max_tokens: list[int],
    max_spec_factor: float,
    min_token_prob: float,
) -> list[list[int]]:
    """A step's drafts in one native call: own[i] extended by new_tokens[i], then the better scored
    of own[i].speculate_own() and shared[i].speculate(own[i].recent()) (own[i]'s on a tie; shared[i]
    None: its own). Per row and step the separate calls cost a share of a large batch's step
    (docs/design_measurements.md#adaptive-switch-cost)."""
    drafts: list[list[int]] = require_native_trees().suffix_propose(
        [tree._tree for tree in own],
        new_tokens,
        [None if tree is None else tree._tree for tree in shared],
        max_tokens,
        max_spec_factor,
        min_token_prob,
    )
    return drafts


class GlobalSuffixTrees:
    """The outputs of the last max_sequences finished sequences, in one tree per key (the adapter a
    sequence ran with: one adapter's outputs never draft for another's requests). The bound is over
    all keys together, the oldest output removed first, so memory stays bounded however many
    adapters come and go."""

    def __init__(self, max_depth: int, max_sequences: int):
        self.max_depth = max_depth
        self.max_sequences = max_sequences
        self.trees: dict[Hashable, SuffixTree] = {}
        self._outputs: OrderedDict[tuple[Hashable, int], list[int]] = OrderedDict()

    def add(self, seq_id: int, output_token_ids: list[int], key: Hashable = None) -> None:
        if not output_token_ids or self.max_sequences == 0:
            return
        while len(self._outputs) >= self.max_sequences:
            (oldest_key, _), oldest = self._outputs.popitem(last=False)
            oldest_tree = self.trees[oldest_key]
            oldest_tree.remove(oldest)
            if oldest_tree.num_nodes == 1:
                del self.trees[oldest_key]  # an adapter with no outputs left keeps no tree
        tree = self.trees.get(key)
        if tree is None:
            tree = self.trees[key] = SuffixTree(self.max_depth)
        self._outputs[key, seq_id] = list(output_token_ids)
        tree.start_text()
        tree.extend(output_token_ids)

    @property
    def num_sequences(self) -> int:
        return len(self._outputs)

    @property
    def num_nodes(self) -> int:
        """Nodes over every key's tree (each counts its root): the size gauge."""
        return sum(tree.num_nodes for tree in self.trees.values())
