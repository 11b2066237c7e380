"""Suffix decoding: the suffix trees (insertion, incremental extension, scoring, the adaptive draft
length, the global tree's bound and eviction), the proposer in the engine (greedy identity with
speculating and non-speculating rows, chunked prefill, preemption, drafts from finished requests),
and per-adapter trees of finished outputs."""

from __future__ import annotations

import random
import statistics
from types import SimpleNamespace

import pytest
import torch
from helpers.call_counts import CallCounter
from helpers.engine import GREEDY, random_prompts, run, tiny_llm, token_ids
from helpers.lora_files import write_adapter
from helpers.spec_decode import SUFFIX

from tachyllm import SamplingParams
from tachyllm.lora.request import LoRARequest
from tachyllm.runner import kv_cache
from tachyllm.server.metrics import ServerMetrics
from tachyllm.spec_decode.suffix import SuffixProposer
from tachyllm.spec_decode.suffix_tree import Candidate, GlobalSuffixTrees, SuffixTree, propose_drafts
from tachyllm.speculative_config import SpeculativeConfig

# The trees are C++: every test here needs the kernels (tests/test_suffix_config.py does not).
pytestmark = pytest.mark.native


# -- the trees ------------------------------------------------------------------------------------


def test_insertion_counts_every_substring_up_to_the_depth():
    tree = SuffixTree(max_depth=3)
    tree.extend([1, 2, 1, 2, 3])
    assert tree.lookup([1]) == (2, 2) and tree.lookup([2]) == (2, 2)
    assert tree.lookup([1, 2]) == (2, 2)
    assert tree.lookup([1, 2, 1]) == (1, 0) and tree.lookup([1, 2, 3]) == (1, 0)  # depth 3: nothing deeper
    assert tree.lookup([1, 2, 1, 2]) is None and tree.lookup([3, 3]) is None and tree.lookup([3]) == (1, 0)
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
    assert pieces.entries() == whole.entries() and pieces.num_nodes == whole.num_nodes


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


def test_own_text_draft_is_the_draft_for_its_tail():
    """speculate_own (the proposer's path: no lookups) gives what speculate gives with the text's
    last tokens as the context, after every piece appended, as factor and depth vary."""
    rng = random.Random(7)
    for depth, factor in ((4, 1.0), (12, 2.0), (24, 0.5)):
        tree, text = SuffixTree(max_depth=depth), []
        for _ in range(30):
            piece = [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
            tree.extend(piece)
            text += piece
            expected = tree.speculate(text[-depth:], 16, factor, 0.05)
            assert tree.speculate_own(16, factor, 0.05) == expected


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
    tree = GlobalSuffixTrees(max_depth=4, max_sequences=2)
    for seq_id, output in enumerate(outputs):
        tree.add(seq_id, output)
    assert tree.num_sequences == 2
    # Exactly the tree of the last two outputs, the evicted counts and nodes gone.
    fresh = GlobalSuffixTrees(max_depth=4, max_sequences=2)
    fresh.add(2, outputs[2]), fresh.add(3, outputs[3])
    assert tree.trees[None].entries() == fresh.trees[None].entries() and tree.num_nodes == fresh.num_nodes
    assert shared_draft(tree, [1, 2], 4, 2.0, 0.1, None).token_ids == [5, 9]  # not 3 4 nor 5 6: evicted
    # No substring spans two outputs: 8 is never followed by 1.
    assert tree.trees[None].lookup([8, 1]) is None


def test_global_tree_size_is_bounded_by_the_cached_outputs():
    tree = GlobalSuffixTrees(max_depth=6, max_sequences=3)
    sizes = []
    for seq_id in range(40):
        tree.add(seq_id, [(seq_id * 7 + i) % 50 for i in range(20)])
        sizes.append(tree.num_nodes)
    assert max(sizes) <= 1 + 3 * 20 * 6
    assert sizes[-1] == sizes[-10]  # steady: every new output replaces an old one of the same size
    empty = GlobalSuffixTrees(max_depth=6, max_sequences=0)
    empty.add(0, [1, 2, 3])
    assert empty.num_nodes == 0 and shared_draft(empty, [1, 2], 4, 2.0, 0.1, None).token_ids == []


def test_removal_deletes_emptied_nodes_and_refuses_a_text_never_put_in():
    tree = SuffixTree(max_depth=4)
    tree.extend([1, 2, 3])
    tree.start_text()
    tree.extend([1, 2, 4])
    before = tree.entries()
    with pytest.raises(ValueError, match="never put in"):
        tree.remove([1, 2, 5])
    assert tree.entries() == before  # checked before anything changed
    tree.remove([1, 2, 3])
    only = SuffixTree(max_depth=4)
    only.extend([1, 2, 4])
    assert tree.entries() == only.entries() and tree.num_nodes == only.num_nodes
    tree.remove([1, 2, 4])
    assert tree.entries() == [] and tree.num_nodes == 1
    # Freed nodes are reused: putting the texts in again builds the same tree.
    tree.start_text()
    tree.extend([1, 2, 4])
    assert tree.entries() == only.entries()


def test_bad_tree_depth_and_token_ids_are_refused():
    with pytest.raises(ValueError, match="max_depth must be >= 1"):
        SuffixTree(max_depth=0)
    tree = SuffixTree(max_depth=4)
    for bad in (-1, 2**31):
        with pytest.raises(ValueError, match="bad token id"):
            tree.extend([bad])
    assert tree.num_tokens == 0 and tree.entries() == []


def test_a_tie_between_continuations_takes_the_smaller_token():
    tree = SuffixTree(max_depth=4)
    tree.extend([1, 9, 0, 1, 5])
    assert tree.speculate([1], 1, 1.0, 0.0).token_ids == [5]
    assert tree.speculate([1], 1, 1.0, 0.0).score == pytest.approx(0.5)


def shared_draft(trees: GlobalSuffixTrees, context: list[int], k: int, factor: float, prob: float, key) -> Candidate:
    """What the finished outputs' tree of `key` drafts after `context` (nothing without one)."""
    tree = trees.trees.get(key)
    return Candidate([], 0, 0.0) if tree is None else tree.speculate(context, k, factor, prob)


def test_global_trees_are_kept_apart_by_key_under_one_bound():
    trees = GlobalSuffixTrees(max_depth=4, max_sequences=3)
    trees.add(0, [1, 2, 3, 4], key=b"adapter-a")
    trees.add(1, [1, 2, 7, 8], key=b"")
    assert shared_draft(trees, [1, 2], 4, 2.0, 0.1, b"adapter-a").token_ids == [3, 4]
    assert shared_draft(trees, [1, 2], 4, 2.0, 0.1, b"").token_ids == [7, 8]
    assert shared_draft(trees, [1, 2], 4, 2.0, 0.1, b"adapter-b").token_ids == []
    trees.add(2, [5, 6], key=b"")
    trees.add(3, [5, 6], key=b"")  # the fourth output evicts the oldest, adapter a's only one
    assert trees.num_sequences == 3 and set(trees.trees) == {b""}
    assert shared_draft(trees, [1, 2], 4, 2.0, 0.1, b"adapter-a").token_ids == []
    assert trees.num_nodes == trees.trees[b""].num_nodes


def test_proposer_prefers_the_better_scored_tree():
    config = SpeculativeConfig.from_dict({**SUFFIX, "suffix_decoding_max_spec_factor": 4.0})
    proposer = SuffixProposer(config)
    proposer.global_trees.add(0, [3, 4, 5, 6, 7, 8], key=b"")
    proposer.global_trees.add(1, [3, 4, 5, 6, 7, 8], key=b"")

    class Seq:  # what the proposer reads of a Sequence
        def __init__(self, seq_id, token_ids):
            self.seq_id, self.token_ids = seq_id, token_ids
            self.request = SimpleNamespace(lora_digest=b"")

    # Its own text followed "3 4" by 9 once and 5 once; the global tree by 5 6 7 8 every time.
    # Its own text repeats a longer span exactly: its candidate scores higher.
    drafts = proposer.propose([Seq(1, [3, 4, 9, 3, 4, 5, 0, 3, 4]), Seq(2, [3, 4, 1, 1, 1, 1, 1, 2, 0, 3, 4])], [8, 8])
    assert [d.token_ids for d in drafts] == [[5, 6, 7, 8], [1, 1, 1, 1, 1, 2, 0, 3]]


def test_one_native_call_proposes_for_the_whole_batch_as_row_by_row():
    """The proposer extends every row's tree and drafts for every row in one call: the same drafts
    as extending each tree and taking the better scored of its own draft and the shared tree's for
    the text's last tokens, step after step as tokens are accepted, with and without a shared tree."""
    depth, factor, min_prob = 6, 2.0, 0.1
    config = SpeculativeConfig.from_dict(
        {**SUFFIX, "suffix_decoding_max_tree_depth": depth, "suffix_decoding_max_spec_factor": factor,
         "suffix_decoding_min_token_prob": min_prob}
    )  # fmt: skip
    proposer = SuffixProposer(config)
    rng = random.Random(11)
    for seq_id in range(4):  # finished outputs for the base model only
        proposer.global_trees.add(seq_id, [rng.randrange(5) for _ in range(20)], key=b"")

    class Seq:
        def __init__(self, seq_id, digest):
            self.seq_id, self.token_ids = seq_id, [rng.randrange(5) for _ in range(rng.randrange(1, 12))]
            self.request = SimpleNamespace(lora_digest=digest)

    seqs = [Seq(10 + i, b"" if i % 3 else b"adapter") for i in range(7)]
    references = {seq.seq_id: SuffixTree(depth) for seq in seqs}
    shared_drafts = 0
    for _ in range(12):
        ks = [rng.randrange(1, 9) for _ in seqs]
        drafts = proposer.propose(seqs, ks)
        for seq, k, draft in zip(seqs, ks, drafts):
            reference = references[seq.seq_id]
            reference.extend(seq.token_ids[reference.num_tokens :])
            assert reference.recent() == seq.token_ids[-depth:]
            own = reference.speculate_own(k, factor, min_prob)
            shared = shared_draft(
                proposer.global_trees, seq.token_ids[-depth:], k, factor, min_prob, seq.request.lora_digest
            )
            assert draft.token_ids == (own if own.score >= shared.score else shared).token_ids
            shared_drafts += shared.score > own.score
            seq.token_ids += [rng.randrange(5) for _ in range(rng.randrange(1, 4))]  # accepted this step
    assert shared_drafts > 0  # both kinds of draft were compared


def test_batched_proposal_refuses_mismatched_rows():
    own = SuffixTree(4)
    with pytest.raises(ValueError, match="one entry per row"):
        propose_drafts([own, SuffixTree(4)], [[1, 2]], [None, None], [4, 4], 2.0, 0.1)
    with pytest.raises(ValueError, match="bad token id"):
        propose_drafts([own], [[1, -2]], [None], [4], 2.0, 0.1)


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
    global_tree = llm.engine.speculator.proposer.global_trees
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
    assert not proposer._trees and proposer.global_trees.num_sequences == 2 * len(prompts)


def test_rows_the_switch_picks_are_those_with_the_longest_drafts(tiny_model_factory):
    """When the switch says only some of the rows with drafts pay, those speculate, longest draft
    first; the output stays the plain engine's."""
    path = tiny_model_factory("llama")
    prompts = repetitive_prompts(5, 8)
    params = SamplingParams(max_tokens=64, **GREEDY)
    expected = token_ids(run(tiny_llm(path), prompts, params))
    llm = tiny_llm(path, speculative_config=SUFFIX)
    speculator = llm.engine.speculator
    controller, proposer = speculator.controller, speculator.proposer
    choose, propose, execute = controller.choose, proposer.propose, llm.engine.runner.execute
    found: dict[int, int] = {}
    checked = []

    def two_rows(num_spec, *args):
        k = choose(num_spec, *args)
        controller.adaptive = False  # every step speculates...
        controller.num_rows = min(num_spec, 2)  # ...with two of its rows
        return k

    def recording_propose(seqs, ks):
        drafts = propose(seqs, ks)
        found.clear()
        found.update({seq.seq_id: len(d.token_ids) for seq, d in zip(seqs, drafts) if d.token_ids})
        return drafts

    def checking_execute(batch):
        speculating = {s.seq_id for s in batch.seqs if s.num_draft_tokens}
        if len(found) > 2:
            assert len(speculating) == 2
            others = [n for seq_id, n in found.items() if seq_id not in speculating]
            assert min(found[seq_id] for seq_id in speculating) >= max(others)
            checked.append(True)
        return execute(batch)

    controller.choose, proposer.propose, llm.engine.runner.execute = two_rows, recording_propose, checking_execute
    assert token_ids(run(llm, prompts, params)) == expected
    assert len(checked) > 5


def plain_decode_step_calls(llm, prompts: list[list[int]], params: SamplingParams) -> list[tuple[int, int]]:
    """For each engine step in which every prompt decoded one token and none had drafts: the Python
    calls it made, and how many of them the speculator made (0 without one)."""
    engine = llm.engine
    step, execute = engine._step, engine.runner.execute
    counter, plain_decode, in_speculator = CallCounter(), [], [0]

    def recording_execute(batch):
        plain_decode.append(batch.num_tokens == len(batch.seqs) == len(prompts))
        return execute(batch)

    def counted(method):
        def wrapper(*args):
            before = counter.calls
            result = method(*args)
            in_speculator[0] += counter.calls - before
            return result

        return wrapper

    if engine.speculator is not None:
        speculator = engine.speculator
        speculator.propose, speculator.observe = counted(speculator.propose), counted(speculator.observe)
    steps = []

    def counting_step():
        plain_decode.clear()
        in_speculator[0] = 0
        with counter:
            before = counter.calls
            outputs = step()
        if plain_decode == [True]:
            steps.append((counter.calls - before, in_speculator[0]))
        return outputs

    engine.runner.execute, engine._step = recording_execute, counting_step
    run(llm, prompts, params)
    return steps


def test_a_step_without_drafts_costs_what_a_plain_step_costs(tiny_model_factory):
    """Where no row has a draft the step runs the plain path, and what speculation adds to it (the
    switch's decision, and where it proposes, one native call for every row's tree update and draft)
    is bounded per row: counted, since counts do not move with load on the machine. Which of its
    paths the speculator takes depends on measured step times, so its count is bounded by its
    costliest path and the rest of the step is compared with the plain engine's."""
    path = tiny_model_factory("llama")
    prompts = random_prompts(21, 8, shared=0, tail=(6, 12))
    params = SamplingParams(max_tokens=40, **GREEDY)
    plain = plain_decode_step_calls(tiny_llm(path), prompts, params)
    suffix = plain_decode_step_calls(tiny_llm(path, speculative_config={"method": "suffix"}), prompts, params)
    assert len(plain) > 30 and len(suffix) > 10
    assert max(speculator for _, speculator in suffix) <= 60 * len(prompts)
    # The plain engine's own steps vary (a row filling a KV block hashes it, the last step emits).
    rest = statistics.median(calls - speculator for calls, speculator in suffix)
    assert rest <= statistics.median(calls for calls, _ in plain) + 50


# -- adapters ---------------------------------------------------------------------------------------


def test_an_adapters_outputs_never_seed_another_adapters_drafts(tiny_model_factory, tmp_path):
    """An adapter scaled down to almost nothing writes what the base model writes, so one shared
    tree of outputs would draft the base model's answers from the adapter's: the base model's
    requests draft exactly what they draft on an engine that never ran the adapter, while the
    adapter's own repeated requests draft from its tree."""
    path = tiny_model_factory("llama")
    adapter = LoRARequest("faint", 1, str(write_adapter(tmp_path / "faint", path, ["q_proj"], alpha=1e-6, seed=1)))
    prompts = repetitive_prompts(5, 4)
    params = SamplingParams(max_tokens=32, **GREEDY)
    options = {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8, "speculative_config": SUFFIX}

    def base_wave(llm) -> tuple[list[list[int]], list[int]]:
        outs = run(llm, prompts, params, prefix="base")
        return token_ids(outs), [o.metrics.spec_num_draft_tokens for o in outs]

    alone = base_wave(tiny_llm(path, **options))
    llm = tiny_llm(path, **options)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=adapter)
    assert token_ids(first) == alone[0]  # the same text: a shared tree would draft it
    assert base_wave(llm) == alone
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=adapter)
    assert sum(o.metrics.spec_num_accepted_tokens for o in again) > sum(alone[1])
    trees = llm.engine.speculator.proposer.global_trees
    assert len(trees.trees) == 2 and b"" in trees.trees  # the base model's and the adapter's
