"""Suffix decoding: the suffix trees (insertion, incremental extension, scoring, the adaptive draft
length, the global tree's bound and eviction), the proposer in the engine (greedy identity with
speculating and non-speculating rows, chunked prefill, preemption, drafts from finished requests),
and its configuration."""

from __future__ import annotations

import pytest
import torch
from helpers.engine import GREEDY, random_prompts, run, tiny_llm, token_ids
from helpers.spec_decode import SUFFIX

from tachyllm import SamplingParams
from tachyllm.errors import ConfigError
from tachyllm.runner import kv_cache
from tachyllm.server.metrics import ServerMetrics
from tachyllm.spec_decode.suffix import SuffixProposer
from tachyllm.spec_decode.suffix_tree import GlobalSuffixTree, SuffixNode, SuffixTree
from tachyllm.speculative_config import SpeculativeConfig


def shape(node: SuffixNode) -> tuple:
    """A tree's content, comparable between trees."""
    return node.count, node.continued, sorted((t, shape(c)) for t, c in node.children.items())


def node_at(tree: SuffixTree, path: list[int]) -> SuffixNode:
    node = tree.root
    for token in path:
        node = node.children[token]
    return node


# -- the trees ------------------------------------------------------------------------------------


def test_insertion_counts_every_substring_up_to_the_depth():
    tree = SuffixTree(max_depth=3)
    tree.extend([1, 2, 1, 2, 3])
    assert node_at(tree, [1]).count == 2 and node_at(tree, [2]).count == 2
    assert node_at(tree, [1, 2]).count == 2 and node_at(tree, [1, 2]).continued == 2
    assert node_at(tree, [1, 2, 1]).count == 1 and node_at(tree, [1, 2, 3]).count == 1
    assert not node_at(tree, [1, 2, 1]).children  # depth 3: nothing deeper
    assert 3 not in node_at(tree, [3]).children and node_at(tree, [3]).continued == 0
    assert tree.num_tokens == 5
    # 1, 2, 3 / 12, 21, 23 / 121, 212, 123
    assert tree.num_nodes == 1 + 3 + 3 + 3


def test_extending_in_pieces_builds_the_tree_built_at_once():
    tokens = [4, 5, 6, 4, 5, 7, 4, 5, 6, 6, 4]
    whole = SuffixTree(max_depth=4)
    whole.extend(tokens)
    pieces = SuffixTree(max_depth=4)
    for start in range(0, len(tokens), 3):
        pieces.extend(tokens[start : start + 3])
    assert shape(pieces.root) == shape(whole.root) and pieces.num_nodes == whole.num_nodes


def test_draft_follows_the_most_frequent_continuation_of_the_longest_match():
    tree = SuffixTree(max_depth=8)
    tree.extend([1, 2, 3, 9, 1, 2, 3, 9, 7, 2, 3, 5, 1, 2, 3])
    # "1 2 3" (length 3) continued by 9 twice; "2 3" alone would also see 5 once.
    candidate = tree.speculate([0, 1, 2, 3], max_tokens=8, max_spec_factor=2.0, min_token_prob=0.1)
    assert candidate.match_length == 3
    assert candidate.token_ids[:2] == [9, 1]
    # Each token's probability given the match: 9 after "1 2 3" in 2 of 2 continuations; then
    # "1 2 3 9" is followed by 1 once and 7 once.
    assert candidate.score == pytest.approx(1.0 + 0.5 + 0.5 * sum([1.0] * (len(candidate.token_ids) - 2)))
    assert tree.speculate([42], 8, 2.0, 0.1).token_ids == []  # no match: no draft


def test_min_token_prob_stops_an_unlikely_draft():
    tree = SuffixTree(max_depth=8)
    tree.extend([1, 2, 5, 6, 1, 2, 7, 8, 1, 2, 9, 9, 1, 2])
    # After "1 2": 5, 7 and 9 once each, so the first draft token has probability 1/3.
    assert tree.speculate([1, 2], 8, 4.0, min_token_prob=0.3).token_ids[:1] in ([5], [7], [9])
    assert tree.speculate([1, 2], 8, 4.0, min_token_prob=0.4).token_ids == []


def test_draft_length_adapts_to_the_match_length():
    tree = SuffixTree(max_depth=16)
    text = list(range(10, 22))
    tree.extend(text + [0] + text)
    # A match of 1 token allows factor * 1 tokens; a longer match allows more, up to max_tokens.
    assert len(tree.speculate([10], 16, 1.0, 0.1).token_ids) == 1
    assert len(tree.speculate([10], 16, 2.5, 0.1).token_ids) == 2
    assert tree.speculate([10, 11, 12, 13], 16, 1.0, 0.1).token_ids == [14, 15, 16, 17]
    assert tree.speculate([10, 11, 12, 13], 3, 1.0, 0.1).token_ids == [14, 15, 16]
    # Match and draft together stay within the tree's depth (16): a 4-token match leaves 12 levels,
    # a 2-token match 14, each token certain (the text's end is no continuation), so 14 score higher.
    candidate = tree.speculate([10, 11, 12, 13], 32, 8.0, 0.1)
    assert candidate.token_ids == [*range(14, 22), 0, *range(10, 15)] and candidate.match_length == 2
    assert candidate.score == pytest.approx(14)


def test_global_tree_keeps_the_last_outputs_and_removes_the_oldest():
    outputs = [[1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 7, 8], [1, 2, 5, 9]]
    tree = GlobalSuffixTree(max_depth=4, max_sequences=2)
    for seq_id, output in enumerate(outputs):
        tree.add(seq_id, output)
    assert tree.num_sequences == 2
    # Exactly the tree of the last two outputs, the evicted counts and nodes gone.
    fresh = GlobalSuffixTree(max_depth=4, max_sequences=2)
    fresh.add(2, outputs[2]), fresh.add(3, outputs[3])
    assert shape(tree.tree.root) == shape(fresh.tree.root) and tree.num_nodes == fresh.num_nodes
    assert tree.speculate([1, 2], 4, 2.0, 0.1).token_ids == [5, 9]  # not 3 4 nor 5 6: evicted
    # No substring spans two outputs: 8 is never followed by 1.
    assert 1 not in node_at(tree.tree, [8]).children


def test_global_tree_size_is_bounded_by_the_cached_outputs():
    tree = GlobalSuffixTree(max_depth=6, max_sequences=3)
    sizes = []
    for seq_id in range(40):
        tree.add(seq_id, [(seq_id * 7 + i) % 50 for i in range(20)])
        sizes.append(tree.num_nodes)
    assert max(sizes) <= 1 + 3 * 20 * 6
    assert sizes[-1] == sizes[-10]  # steady: every new output replaces an old one of the same size
    empty = GlobalSuffixTree(max_depth=6, max_sequences=0)
    empty.add(0, [1, 2, 3])
    assert empty.num_nodes == 1


def test_proposer_prefers_the_better_scored_tree():
    config = SpeculativeConfig.from_dict({**SUFFIX, "suffix_decoding_max_spec_factor": 4.0})
    proposer = SuffixProposer(config)
    proposer.global_tree.add(0, [3, 4, 5, 6, 7, 8])
    proposer.global_tree.add(1, [3, 4, 5, 6, 7, 8])

    class Seq:  # what the proposer reads of a Sequence
        def __init__(self, seq_id, token_ids):
            self.seq_id, self.token_ids = seq_id, token_ids

    # Its own text followed "3 4" by 9 once and 5 once; the global tree by 5 6 7 8 every time.
    assert proposer.draft(Seq(1, [3, 4, 9, 3, 4, 5, 0, 3, 4]), 8) == [5, 6, 7, 8]
    # Its own text repeats a longer span exactly: its candidate scores higher.
    assert proposer.draft(Seq(2, [3, 4, 1, 1, 1, 1, 1, 2, 0, 3, 4]), 8) == [1, 1, 1, 1, 1, 2, 0, 3]


# -- in the engine ---------------------------------------------------------------------------------


def repetitive_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts that repeat a span, so that a sequence's own tree has continuations to propose."""
    return [p + p[2:] for p in random_prompts(seed, count, shared=0, tail=(6, 12))]


@pytest.mark.parametrize(
    "spec",
    [
        SUFFIX,
        {
            **SUFFIX,
            "num_speculative_tokens": 32,
            "suffix_decoding_max_tree_depth": 40,
            "suffix_decoding_max_spec_factor": 4.0,
        },
    ],
    ids=["k8", "k32"],
)
def test_greedy_output_is_identical_with_suffix_decoding(tiny_model_factory, spec):
    path = tiny_model_factory("llama")
    prompts = repetitive_prompts(2, 5)
    params = SamplingParams(max_tokens=64, **GREEDY)
    expected = token_ids(run(tiny_llm(path), prompts, params))
    llm = tiny_llm(path, speculative_config=spec)
    # The second wave repeats the first: the global tree of finished outputs drafts whole answers.
    first = run(llm, prompts, params)
    drafted_first = llm.engine.stats.spec_num_draft_tokens
    second = run(llm, prompts, params, prefix="b")
    assert token_ids(first) == expected and token_ids(second) == expected
    stats = llm.engine.stats
    assert drafted_first > 0
    accepted_second = sum(o.metrics.spec_num_accepted_tokens for o in second)
    drafted_second = sum(o.metrics.spec_num_draft_tokens for o in second)
    assert accepted_second > 0.8 * drafted_second
    assert sum(o.metrics.spec_num_drafts for o in second) < 0.5 * sum(len(e) for e in expected)
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # rejections rolled back too
    # A finished sequence's output joins the global tree at the next step's proposals.
    global_tree = llm.engine.speculator.proposer.global_tree
    assert global_tree.num_sequences >= len(prompts)
    # Its size is a metric, on /metrics as a gauge.
    assert stats.spec_suffix_tree_nodes == global_tree.num_nodes > 1
    exported = ServerMetrics("m", 256).render(llm.engine.snapshot()).decode()
    assert f'tachy:spec_decode_suffix_tree_nodes{{model_name="m"}} {float(global_tree.num_nodes)}' in exported
    # Drafts as long as the configuration allows were verified and accepted to their end: a match
    # of m tokens drafts at most factor * m tokens, and m + draft fit in the tree's depth.
    depth, factor = spec["suffix_decoding_max_tree_depth"], spec.get("suffix_decoding_max_spec_factor", 1.0)
    longest = max(min(spec["num_speculative_tokens"], int(factor * m), depth - m) for m in range(1, depth))
    per_position = llm.engine.stats.spec_accepted_per_pos
    assert len(per_position) == longest and per_position[-1] > 0


def test_mixed_batch_chunked_prefill_and_sampling_rows(tiny_model_factory):
    """Greedy rows next to penalised, logprob and sampled rows, long prompts prefilled in chunks
    beside speculating decodes, a request of n = 2 (a tree per sample): the greedy rows' tokens are
    those of a run without speculation."""
    path = tiny_model_factory("llama")
    prompts = repetitive_prompts(3, 6)
    prompts[4] = prompts[4] * 6  # a long prompt, chunked under the small token budget
    params = [
        SamplingParams(max_tokens=24, **GREEDY),
        SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.3, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=24, temperature=0, min_tokens=5),
        SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=24, **GREEDY),
        SamplingParams(n=2, max_tokens=24, **GREEDY),
    ]
    options = {"max_num_batched_tokens": 16, "enable_chunked_prefill": True}
    base = run(tiny_llm(path, **options), prompts, params)
    llm = tiny_llm(path, speculative_config=SUFFIX, **options)
    run(llm, prompts, params)  # warms the global tree
    spec = run(llm, prompts, params, prefix="b")
    greedy = [0, 1, 2, 4]
    assert [token_ids(spec)[i] for i in greedy] == [token_ids(base)[i] for i in greedy]
    assert [c.token_ids for c in spec[5].outputs] == [c.token_ids for c in base[5].outputs]
    assert spec[5].metrics.spec_num_accepted_tokens > 0
    assert len(spec[3].outputs[0].token_ids) == 24
    for b, s in zip(base[1].outputs[0].logprobs, spec[1].outputs[0].logprobs):
        assert b.keys() == s.keys()
    assert spec[0].metrics.spec_num_accepted_tokens > 0 and spec[4].metrics.spec_num_accepted_tokens > 0


def test_greedy_identity_under_preemption(tiny_model_factory):
    path = tiny_model_factory("llama")
    max_len, block_size = 64, 4
    prompts = repetitive_prompts(4, 8)
    params = [SamplingParams(max_tokens=max_len - len(p), **GREEDY) for p in prompts]
    expected = token_ids(run(tiny_llm(path, max_model_len=max_len), prompts, params))
    block_bytes = kv_cache.bytes_per_block(tiny_llm(path).engine.model_config, block_size, torch.float32)
    small = tiny_llm(
        path, max_model_len=max_len, kv_cache_memory=3 * (max_len // block_size) * block_bytes,
        speculative_config=SUFFIX,
    )  # fmt: skip
    assert token_ids(run(small, prompts, params)) == expected
    assert token_ids(run(small, prompts, params, prefix="b")) == expected
    stats = small.engine.stats
    assert stats.num_preemptions > 0 and stats.spec_num_accepted_tokens > 0
    # Preempted sequences kept their trees; finished ones are released at the next step's proposals.
    proposer = small.engine.speculator.proposer
    assert all(seq.is_finished for seq, _ in proposer._trees.values())
    proposer.release_finished([])
    assert not proposer._trees and proposer.global_tree.num_sequences == 2 * len(prompts)


# -- configuration ----------------------------------------------------------------------------------


def test_config_takes_vllm_suffix_keys_and_defaults():
    config = SpeculativeConfig.from_dict('{"method": "suffix"}')
    assert config.num_speculative_tokens == config.suffix_decoding_max_tree_depth == 24
    assert (config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob) == (1.0, 0.1)
    config = SpeculativeConfig.from_dict(
        {"method": "suffix", "num_speculative_tokens": 32, "suffix_decoding_max_tree_depth": 64,
         "suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_spec_factor": 2,
         "suffix_decoding_min_token_prob": 0}
    )  # fmt: skip
    assert config.num_speculative_tokens == 32 and config.suffix_decoding_max_cached_requests == 0
    assert (
        SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_tree_depth": 64}).num_speculative_tokens
        == 32
    )


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_speculative_tokens": 33}, r"num_speculative_tokens must be an integer in \[1, 32\]"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"suffix_decoding_max_tree_depth": 1}, "suffix_decoding_max_tree_depth must be an integer >= 2"),
        ({"suffix_decoding_max_tree_depth": "24"}, "suffix_decoding_max_tree_depth"),
        ({"suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests"),
        ({"suffix_decoding_max_cached_requests": 1.5}, "suffix_decoding_max_cached_requests"),
        ({"suffix_decoding_max_spec_factor": 0}, "suffix_decoding_max_spec_factor must be a number > 0"),
        ({"suffix_decoding_max_spec_factor": float("inf")}, "suffix_decoding_max_spec_factor"),
        ({"suffix_decoding_min_token_prob": 1.5}, r"suffix_decoding_min_token_prob must be a number in \[0, 1\]"),
        ({"suffix_decoding_min_token_prob": True}, "suffix_decoding_min_token_prob"),
        ({"model": "x"}, "method 'suffix' takes no 'model'"),
        ({"suffix_decoding_max_depth": 3}, "unknown key"),
    ],
)
def test_config_rejects_bad_suffix_values(options, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.from_dict({"method": "suffix", **options})


def test_bad_suffix_config_is_refused_at_engine_start(tiny_model_factory):
    with pytest.raises(ConfigError, match="suffix_decoding_min_token_prob"):
        tiny_llm(
            tiny_model_factory("llama"), speculative_config={"method": "suffix", "suffix_decoding_min_token_prob": -1}
        )
