"""Engine-level scheduling: prefix-cache reuse, preemption, chunked prefill, abort, priority,
admission, and the periodic stats log. Every engine run here checks the block manager's
invariants after each step and ends with every block free."""

from __future__ import annotations

import logging
import random
import time

import pytest
import torch
from helpers.engine import GREEDY, assert_all_free, check_blocks, random_prompts, run, tiny_llm, token_ids

from tachyllm import LLM, SamplingParams
from tachyllm.core import block_manager as bm_module
from tachyllm.core.sequence import SequenceStatus
from tachyllm.engine.stats_logger import StatsLogger
from tachyllm.errors import RequestError
from tachyllm.outputs import StepStats
from tachyllm.runner import kv_cache
from tachyllm.step import StepBatch

# -- prefix caching ------------------------------------------------------------------------------


def test_warm_prefix_cache_matches_cold_run(tiny_model_factory):
    path = tiny_model_factory("llama")
    prompts = random_prompts(0, 8, shared=26, tail=(1, 9))
    prompts.append(list(prompts[0]))  # an exact repeat
    params = SamplingParams(max_tokens=12, **GREEDY)
    cold = token_ids(run(tiny_llm(path, enable_prefix_caching=False), prompts, params))

    llm = tiny_llm(path)
    warm = token_ids(run(llm, prompts[:1], params, "a") + run(llm, prompts[1:], params, "b"))
    assert warm == cold
    stats = llm.engine.stats
    assert stats.prefix_cache_hits >= 24 * (len(prompts) - 1)  # 6 shared blocks per later request
    assert stats.prefix_cache_queries == sum(map(len, prompts))
    # Everything again in one batch, now from a warm cache.
    again = run(llm, prompts, params, "c")
    assert token_ids(again) == cold
    assert all(o.num_cached_tokens >= 24 for o in again)
    # A follow-up turn reuses the blocks of the first turn's prompt and generated tokens.
    follow_up = prompts[0] + cold[0] + [7, 8, 9]
    cold_follow = run(tiny_llm(path, enable_prefix_caching=False), [follow_up], params)
    warm_follow = run(llm, [follow_up], params, "d")
    assert token_ids(warm_follow) == token_ids(cold_follow)
    assert warm_follow[0].num_cached_tokens >= len(prompts[0]) + len(cold[0]) - 4


def parent_blind_hash(parent, tokens, extra) -> bytes:
    """Ignores the prefix: one block's tokens collide at every position and after any prefix."""
    return repr(tuple(tokens)).encode()


def one_bit_hash(parent, tokens, extra) -> bytes:
    return bytes([sum(tokens) % 2])


@pytest.mark.parametrize("weak_hash", [parent_blind_hash, one_bit_hash])
def test_colliding_hashes_do_not_corrupt_output(tiny_model_factory, monkeypatch, weak_hash):
    """Prompts built from three repeated 4-token blocks: under a weak hash, lookups keep finding
    blocks with the right tokens computed at other positions or after other prefixes. Tokens and
    parent links are verified, so outputs still equal a cold run."""
    path = tiny_model_factory("llama")
    rng = random.Random(11)
    pieces = [[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]]
    prompts = []
    for _ in range(12):
        blocks = [token for _ in range(rng.randint(2, 5)) for token in rng.choice(pieces)]
        prompts.append(blocks + [rng.randrange(5, 300)])
    params = SamplingParams(max_tokens=10, **GREEDY)
    cold = token_ids(run(tiny_llm(path, enable_prefix_caching=False), prompts, params))
    monkeypatch.setattr(bm_module, "hash_block", weak_hash)
    llm = tiny_llm(path)
    warm = [token_ids(run(llm, [p], params, f"s{i}-"))[0] for i, p in enumerate(prompts)]
    assert warm == cold
    assert token_ids(run(llm, prompts, params, "batch")) == cold
    if weak_hash is parent_blind_hash:
        assert llm.engine.stats.prefix_cache_hits > 0  # genuine hits still happen


@pytest.mark.slow
def test_warm_prefix_cache_matches_cold_run_real_model():
    llm = LLM(dtype="float32", kv_cache_memory=64 << 20, max_model_len=512)
    tok = llm.get_tokenizer()
    system = (
        "You are a careful assistant for a hardware store. Answer in one short sentence, mention the aisle "
        "number when you know it, and never invent prices. Aisles: 1 paint, 2 plumbing, 3 garden, 4 tools."
    )
    questions = ["Where are the hammers?", "Do you sell hoses?", "Where is the white paint?"]
    prompts = [tok.encode(f"{system}\nQuestion: {q}\nAnswer:") for q in questions]
    params = SamplingParams(max_tokens=8, **GREEDY)
    # One engine for both runs (loading the model twice would double the cost); with caching off
    # the block manager neither registers nor looks up blocks.
    llm.engine.block_manager.enable_prefix_caching = False
    cold = token_ids(run(llm, prompts, params, "cold"))
    llm.engine.block_manager.enable_prefix_caching = True
    warm = run(llm, prompts[:1], params, "w0") + run(llm, prompts[1:], params, "w1")
    assert token_ids(warm) == cold
    assert all(o.num_cached_tokens >= 32 for o in warm[1:])


# -- preemption and chunked prefill ------------------------------------------------------------------


def test_32_requests_with_preemption_match_a_large_cache(tiny_model_factory):
    path = tiny_model_factory("llama")
    max_len, block_size = 64, 4
    big = tiny_llm(path, max_model_len=max_len)
    prompts = random_prompts(3, 32, shared=0, tail=(8, 40))
    params = [SamplingParams(max_tokens=max_len - len(p), **GREEDY) for p in prompts]
    expected = token_ids(run(big, prompts, params))
    assert big.engine.stats.num_preemptions == 0

    # Room for about four max-length sequences.
    block_bytes = kv_cache.bytes_per_block(big.engine.model_config, block_size, torch.float32)
    small = tiny_llm(path, max_model_len=max_len, kv_cache_memory=4 * (max_len // block_size) * block_bytes)
    assert small.engine.block_manager.num_blocks == 4 * max_len // block_size
    outputs = run(small, prompts, params)
    assert token_ids(outputs) == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert small.engine.stats.num_preemptions > 0


def test_chunked_prefill_matches_unchunked(tiny_model_factory):
    path = tiny_model_factory("llama")
    prompts = random_prompts(4, 6, shared=0, tail=(20, 90))
    params = SamplingParams(max_tokens=8, **GREEDY)
    unchunked = tiny_llm(path, enable_chunked_prefill=False, enable_prefix_caching=False)
    expected = token_ids(run(unchunked, prompts, params))
    chunked = tiny_llm(path, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert token_ids(run(chunked, prompts, params)) == expected
    assert chunked.engine.stats.num_steps > unchunked.engine.stats.num_steps
    # Chunks that start on cached blocks too.
    warm = tiny_llm(path, max_num_batched_tokens=8)
    run(warm, prompts[:1], params, "w")
    assert token_ids(run(warm, prompts, params)) == expected


def test_long_chunked_prompts_use_a_contiguous_kv_copy(tiny_model_factory, monkeypatch):
    """Prompts above CHUNK_BUFFER_MIN_TOKENS are prefilled through a per-sequence K/V buffer: same
    output as unchunked, also when the first chunk starts on cached blocks or after preemption.
    That is the PyTorch attention path (off the CPU, or without the C++ kernels, which read every
    chunk's context from the paged cache themselves)."""
    from tachyllm.backends import torch_backend
    from tachyllm.kernels import native

    monkeypatch.setattr(native, "native_ops", lambda: None)
    monkeypatch.setattr(torch_backend, "CHUNK_BUFFER_MIN_TOKENS", 40)
    path = tiny_model_factory("llama")
    prompts = random_prompts(6, 5, shared=24, tail=(30, 90))
    params = SamplingParams(max_tokens=12, **GREEDY)
    expected = token_ids(
        run(tiny_llm(path, enable_chunked_prefill=False, enable_prefix_caching=False), prompts, params)
    )
    chunked = tiny_llm(path, max_num_batched_tokens=16)
    created = []
    builder = chunked.engine.runner.builder
    real = builder._chunk_buffer

    def spy(s):
        buffer = real(s)
        if buffer is not None and buffer not in created:
            created.append(buffer)
        return buffer

    monkeypatch.setattr(builder, "_chunk_buffer", spy)
    run(chunked, prompts[:1], params, "w")  # later prompts start on its cached blocks
    assert token_ids(run(chunked, prompts, params)) == expected
    assert len(created) >= len(prompts) and not builder.chunk_buffers
    # Preemption mid-prefill: the buffer is rebuilt from the recomputed chunks.
    block_bytes = kv_cache.bytes_per_block(chunked.engine.model_config, 4, torch.float32)
    small = tiny_llm(path, max_num_batched_tokens=16, kv_cache_memory=2 * (128 // 4) * block_bytes)
    assert token_ids(run(small, prompts, params)) == expected
    assert small.engine.stats.num_preemptions > 0 and not small.engine.runner.builder.chunk_buffers


# -- abort -------------------------------------------------------------------------------------------


def referenced_blocks(llm: LLM) -> set[int]:
    return {b for s in llm.engine.scheduler.running for b in s.block_table}


def test_abort_at_each_stage_frees_blocks_at_once(tiny_model_factory):
    llm = tiny_llm(tiny_model_factory("llama"), max_num_batched_tokens=8, max_num_seqs=2)
    eng, bm = llm.engine, llm.engine.block_manager
    params = SamplingParams(max_tokens=20, **GREEDY)
    eng.add_request("decoding", list(range(10, 15)), params)
    eng.step()
    eng.add_request("prefilling", list(range(20, 50)), params)
    eng.add_request("waiting", list(range(60, 66)), params)
    eng.step()
    stage = {rid: eng.requests[rid].seqs[0] for rid in ("decoding", "prefilling", "waiting")}
    assert stage["decoding"].num_output_tokens >= 1 and stage["decoding"].status is SequenceStatus.RUNNING
    assert 0 < stage["prefilling"].num_computed_tokens < 30
    assert stage["waiting"].status is SequenceStatus.WAITING

    for request_id in ("prefilling", "waiting", "decoding"):
        seq = stage[request_id]
        held = set(seq.block_table)
        out = eng.abort_request(request_id)
        assert out.finished and out.outputs[0].finish_reason == "abort"
        assert seq.block_table == [] and not held & referenced_blocks(llm)
        assert bm.num_free_blocks == bm.num_blocks - len(referenced_blocks(llm))
        check_blocks(llm)
    assert eng.abort_request("decoding") is None  # already gone
    assert not eng.has_unfinished_requests() and not eng.step()
    assert_all_free(llm)


def test_abort_of_a_request_sharing_cached_blocks(tiny_model_factory):
    path = tiny_model_factory("llama")
    prompts = random_prompts(5, 2, shared=16, tail=(3, 3))
    params = SamplingParams(max_tokens=10, **GREEDY)
    expected = token_ids(run(tiny_llm(path, enable_prefix_caching=False), prompts[1:], params))
    llm = tiny_llm(path)
    eng = llm.engine
    run(llm, prompts[:1], params, "warm")
    eng.add_request("a", prompts[0], params)
    eng.add_request("b", prompts[1], params)
    eng.step()
    a, b = eng.requests["a"].seqs[0], eng.requests["b"].seqs[0]
    shared = set(a.block_table) & set(b.block_table)
    assert len(shared) == 4
    eng.abort_request("a")
    assert all(eng.block_manager.blocks[i].ref_count == 1 for i in shared)
    check_blocks(llm)
    while eng.has_unfinished_requests():
        outs = eng.step()
        check_blocks(llm)
    assert outs[0].outputs[0].token_ids == expected[0]
    assert_all_free(llm)


# -- policy and admission ---------------------------------------------------------------------------


def test_priority_then_arrival_order(tiny_model_factory):
    llm = tiny_llm(tiny_model_factory("llama"), max_num_seqs=1)
    eng = llm.engine
    for i, priority in enumerate([2, 0, 1, 0]):
        eng.add_request(f"p{priority}-{i}", [5 + i] * 6, SamplingParams(max_tokens=2, **GREEDY), priority=priority)
    order = []
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step() if o.finished]
        check_blocks(llm)
    assert order == ["p0-1", "p0-3", "p1-2", "p2-0"]


def test_admission_rejects_what_can_never_run_and_queues_the_rest(tiny_model_factory):
    path = tiny_model_factory("llama")
    llm = tiny_llm(path, max_model_len=64, kv_cache_memory=16 * 2048)  # 16 blocks of 4 tokens
    eng = llm.engine
    assert eng.block_manager.num_blocks == 16
    with pytest.raises(RequestError, match="max_model_len"):
        eng.add_request("long", [5] * 60, SamplingParams(max_tokens=8))
    big = tiny_llm(path, max_model_len=256, kv_cache_memory=16 * 2048)
    with pytest.raises(RequestError, match="KV blocks"):
        big.engine.add_request("huge", [5] * 60, SamplingParams(max_tokens=8))
    assert not eng.has_unfinished_requests() and not big.engine.has_unfinished_requests()
    # Each fits alone but not both at once: the second waits (or is preempted), then completes.
    prompts = random_prompts(6, 2, shared=0, tail=(30, 30))
    params = SamplingParams(max_tokens=20, **GREEDY)
    alone = [token_ids(run(llm, [p], params, f"alone{i}"))[0] for i, p in enumerate(prompts)]
    assert token_ids(run(llm, prompts, params, "both")) == alone


# -- stats logging ----------------------------------------------------------------------------------


def test_stats_line_at_most_once_per_interval(tiny_model_factory, caplog):
    llm = tiny_llm(tiny_model_factory("llama"))
    eng = llm.engine
    prompts = random_prompts(7, 4, shared=12, tail=(2, 5))
    run(llm, prompts[:1], SamplingParams(max_tokens=3, **GREEDY), "w")
    eng.stats_logger.interval_s = 0.0  # a line after every step
    steps_before = eng.stats.num_steps
    with caplog.at_level(logging.INFO, logger="tachyllm"):
        run(llm, prompts[1:], SamplingParams(max_tokens=3, **GREEDY))
    lines = [r.getMessage() for r in caplog.records if "prefix cache hit rate" in r.getMessage()]
    assert len(lines) == eng.stats.num_steps - steps_before
    for word in (
        "running 3, waiting 0",
        "KV usage",
        "prompt",
        "generation",
        "tok/s",
        "(interval)",
        "(total)",
        "preemptions 0",
    ):
        assert word in lines[0]
    assert "n/a (interval)" in lines[-1]  # no new queries in the last decode step

    logger = StatsLogger(block_size=4, prefix_caching=True, interval_s=5.0)
    t0 = time.monotonic()
    logged = [
        logger.maybe_log(StepStats(), eng.scheduler, eng.block_manager, StepBatch([]), [], now=t0 + t)
        for t in (1, 4, 6, 7, 10, 12)
    ]
    assert logged == [False, False, True, False, False, True]


def test_warns_once_about_shared_prefixes_shorter_than_a_block(tiny_model_factory, caplog):
    path = tiny_model_factory("llama")
    params = SamplingParams(max_tokens=2, **GREEDY)
    short_shared = random_prompts(8, 8, shared=10, tail=(4, 8))  # 10 shared tokens < a block of 16
    long_shared = random_prompts(9, 8, shared=40, tail=(4, 8))  # these hit: nothing to advise
    unrelated = random_prompts(10, 8, shared=0, tail=(6, 12))
    with caplog.at_level(logging.WARNING, logger="tachyllm"):
        for prompts, caching in ((long_shared, True), (unrelated, True), (short_shared, False)):
            llm = tiny_llm(path, block_size=16, enable_prefix_caching=caching)
            for i, p in enumerate(prompts):
                run(llm, [p], params, f"r{i}-")
        assert not [r for r in caplog.records if "block_size" in r.getMessage()]
        llm = tiny_llm(path, block_size=16)
        for i, p in enumerate(short_shared):
            run(llm, [p], params, f"r{i}-")
    warnings = [r.getMessage() for r in caplog.records if "block_size=16" in r.getMessage()]
    assert len(warnings) == 1 and "shorter than one block" in warnings[0]
