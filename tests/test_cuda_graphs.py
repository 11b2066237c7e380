"""CUDA graphs' bucketing and padding (runner/cuda_graphs.py), on the CPU: the padded forward runs
eagerly (DecodeGraphs(capture=False)), so what graphs replay on a GPU — a decode-only step padded to
its batch-size bucket — is checked here to give the same tokens as the unpadded step. Capture and
replay themselves are tested in tests/test_cuda.py."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from helpers.hf_reference import mixed_prompts

from tachyllm import LLM, SamplingParams
from tachyllm.backends.base import AttentionMetadata
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.engine_args import add_engine_args, engine_config
from tachyllm.runner.cuda_graphs import DecodeGraphs, _copy_into, dummy_decodes, graph_buckets
from tachyllm.speculative_config import SpeculativeConfig
from tachyllm.step import ScheduledSeq, StepBatch


def test_graph_buckets():
    assert graph_buckets(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert graph_buckets(10) == [1, 2, 4, 8, 10]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(3) == [1, 2, 3]
    assert graph_buckets(1) == [1]
    with pytest.raises(ValueError, match="at least 1"):
        graph_buckets(0)


def _seq(start: int, tokens: int, drafts: int = 0) -> ScheduledSeq:
    return ScheduledSeq(
        seq_id=start, request_id="r", start=start, token_ids=[1] * tokens, num_draft_tokens=drafts,
        block_table=[0, 1], seq_len=start + tokens - drafts, completes=True,
    )  # fmt: skip


def test_bucket_choice():
    allocated = []
    builder = SimpleNamespace(allocate_graph_buffers=lambda *sizes: allocated.append(sizes))
    graphs = DecodeGraphs(None, builder, [], max_num_seqs=20, max_blocks=4, query_counts=(1, 3), capture=False)
    assert allocated == [(20, 4, 3)]  # one set of persistent buffers, for the most queries per sequence
    assert graphs.bucket(StepBatch([_seq(5, 1)])) == (1, 1)
    assert graphs.bucket(StepBatch([_seq(5, 1)] * 3)) == (4, 1)
    assert graphs.bucket(StepBatch([_seq(5, 1)] * 9)) == (16, 1)
    assert graphs.bucket(StepBatch([_seq(5, 1)] * 20)) == (20, 1)
    assert graphs.bucket(StepBatch([_seq(5, 3, drafts=2)] * 5)) == (8, 3)
    # Eager: more sequences than the largest bucket, a prefill chunk, mixed or uncaptured query counts, nothing.
    assert graphs.bucket(StepBatch([_seq(5, 1)] * 21)) is None
    assert graphs.bucket(StepBatch([_seq(5, 1), _seq(0, 4)])) is None
    assert graphs.bucket(StepBatch([_seq(5, 1), _seq(5, 3, drafts=2)])) is None
    assert graphs.bucket(StepBatch([_seq(5, 2, drafts=1)])) is None
    assert graphs.bucket(StepBatch([])) is None
    capture = dummy_decodes(4, 3, block_size=2)
    assert len(capture.seqs) == 4 and all(s.is_decode and s.num_draft_tokens == 2 for s in capture.seqs)
    assert capture.seqs[0].block_table == [0, 0]  # every position of the capture in block 0


@dataclass(kw_only=True, eq=False)
class _Meta(AttentionMetadata):
    max_len: int = 0


def test_copy_into_captured_buffers():
    static = (torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long))
    static += (_Meta(backend=None, slot_mapping=torch.zeros(4, dtype=torch.long), max_len=8),)
    fresh = (torch.arange(4), static[1], _Meta(backend=None, slot_mapping=torch.full((4,), 7), max_len=8))
    _copy_into(static, fresh)
    assert static[0].tolist() == [0, 1, 2, 3] and static[2].slot_mapping.tolist() == [7] * 4
    with pytest.raises(RuntimeError, match="'slot_mapping'"):
        _copy_into(static, (*fresh[:2], _Meta(backend=None, slot_mapping=torch.zeros(5, dtype=torch.long), max_len=8)))
    with pytest.raises(RuntimeError, match="'max_len' \\(8 at capture, 9 now\\)"):
        _copy_into(static, (*fresh[:2], _Meta(backend=None, slot_mapping=fresh[2].slot_mapping, max_len=9)))


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_padded_decodes_match_unpadded(tiny_model_factory):
    """Batches of 1, 3 and 9 sequences, padded to 1, 4 and 16, give the eager steps' greedy tokens."""
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", backend="torch", block_size=4,
              kv_cache_memory=8 << 20, enable_prefix_caching=False, max_num_seqs=16)  # fmt: skip
    batches = [
        mixed_prompts(250, lengths=lengths, seed=3) for lengths in ((5,), (2, 9, 4), (3, 7, 1, 12, 6, 2, 9, 5, 4))
    ]
    eager = [_greedy(llm, prompts) for prompts in batches]
    runner = llm.engine.runner
    runner.use_graphs(16, 8, (1,), capture=False)
    assert [_greedy(llm, prompts) for prompts in batches] == eager
    assert runner.graphs.replays >= 3 * 5  # every decode step of the three batches
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_padded_verification_step_matches_unpadded(tiny_model_factory):
    """A verification step of 3 sequences with k = 2 drafts each, padded to 4: the same hidden states
    and greedy tokens at every position as the step run unpadded."""
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", backend="torch", block_size=4,
              kv_cache_memory=8 << 20)  # fmt: skip
    runner = llm.engine.runner
    prompts = mixed_prompts(250, lengths=(5, 9, 4), seed=4)
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]

    def seq(i: int, start: int, tokens: list[int], drafts: int) -> ScheduledSeq:
        return ScheduledSeq(
            seq_id=i, request_id=str(i), start=start, token_ids=tokens, num_draft_tokens=drafts,
            block_table=tables[i], seq_len=start + len(tokens) - drafts, completes=True,
        )  # fmt: skip

    runner.forward(StepBatch([seq(i, 0, p, 0) for i, p in enumerate(prompts)]))
    step = StepBatch([seq(i, len(p), [7 + i, 8, 9 + i], 2) for i, p in enumerate(prompts)])
    eager = runner.forward(step)
    runner.use_graphs(8, 8, (1, 3), capture=False)
    padded = runner.forward(step)
    assert runner.graphs.replays == 1 and padded.shape == eager.shape == (9, eager.shape[1])
    torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)
    logits = llm.engine.model.compute_logits
    assert torch.equal(logits(padded).argmax(-1), logits(eager).argmax(-1))


def test_enforce_eager_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args([])).enforce_eager is False
    assert engine_config(parser.parse_args(["--enforce-eager"])).enforce_eager is True


def test_cpu_engine_captures_nothing(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", kv_cache_memory=4 << 20)
    assert llm.engine.runner.graphs is None


def test_which_steps_the_engine_captures(caplog):
    """Graphs on a CUDA device with a capturable backend, unless --enforce-eager, tensor parallelism,
    sliding-window layers or the pooling runner (prefills only): decode steps, and verification steps of
    the speculator's k drafts."""

    def counts(device="cuda", eager=False, capturable=True, spec=None, executor=None, sliding=(), runner="generate"):
        config = SimpleNamespace(enforce_eager=eager, speculative_config=spec, enable_lora=False)
        backend = SimpleNamespace(graph_capturable=capturable, name="x")
        engine = SimpleNamespace(device=torch.device(device), config=config, backend=backend, executor=executor,
                                 model_config=SimpleNamespace(sliding_layers=sliding), runner_type=runner)  # fmt: skip
        return LLMEngine._graph_query_counts(engine)

    assert counts() == (1,)
    assert counts(runner="pooling") is None
    assert counts(spec=SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})) == (1, 4)
    assert counts(device="cpu") is None and counts(eager=True) is None
    assert counts(executor=object()) is None and counts(sliding=(0, 1)) is None
    with caplog.at_level(logging.INFO, logger="tachyllm"):
        assert counts(capturable=False) is None
    assert "CUDA graphs off: the x backend's steps cannot be captured" in caplog.text
