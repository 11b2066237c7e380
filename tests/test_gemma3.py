"""Gemma 3: greedy output token for token equal to transformers (fp32) on tiny random models with
sliding-window layers whose window (16) prompts exceed, chunked prefill, prefix caching and
preemption included, the sliding-window layers holding only their window's blocks in a pool of their
own; its GGUF form; and the sliding window of both backends' attention against a plain reference."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from helpers.gguf_files import finish
from helpers.hf_reference import hf_greedy
from helpers.models import make_tiny_model

from tachyllm import LLM, SamplingParams
from tachyllm.backends.cuda_backend import CudaBackend
from tachyllm.backends.torch_backend import TorchBackend, TorchMetadataBuilder, paged_attention
from tachyllm.core.block_manager import NULL_BLOCK
from tachyllm.errors import ModelLoadError
from tachyllm.kernels import native
from tachyllm.loading import load_checkpoint
from tachyllm.model_config import ModelConfig
from tachyllm.runner import kv_cache
from tachyllm.step import ScheduledSeq, StepBatch

WINDOW = 16
NEW_TOKENS = 10
# Layers 0, 2 and 3 see the last 16 positions; layer 1 everything.
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
PROMPT_LENGTHS = (1, 5, 17, 40, 70)

ops = native.native_ops()


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory) -> Path:
    # query_pre_attn_scalar differs from head_dim (16) so that the attention scale is checked too.
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-gemma3"), "gemma3", tie=True, num_hidden_layers=4, num_key_value_heads=1,
        sliding_window=WINDOW, layer_types=LAYER_TYPES, query_pre_attn_scalar=24,
    )  # fmt: skip


def _hf(path: Path, **overrides):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **overrides).eval()


def _prompts(vocab: int, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.error is None for o in outputs)
    return [o.outputs[0].token_ids for o in outputs]


def test_config_reads_the_layer_types_window_and_rope(gemma_path):
    config = load_checkpoint(str(gemma_path)).config
    assert config.architecture == "gemma3"
    assert (config.sliding_window, config.sliding_layers) == (WINDOW, (0, 2, 3))
    assert [config.layer_window(i) for i in range(4)] == [WINDOW, None, WINDOW, WINDOW]
    assert (config.rope_theta, config.rope_local_theta, config.query_pre_attn_scalar) == (1_000_000.0, 10_000.0, 24)
    assert config.qk_norm and config.tie_word_embeddings and config.num_kv_heads == 1


def test_older_config_keys():
    """Configs written before transformers 5 (rope_theta, rope_local_base_freq, rope_scaling for the
    global layers, sliding_window_pattern instead of layer_types), as the larger Gemma 3 checkpoints are."""
    from tachyllm.loading.hf import _gemma3_fields

    fields = _gemma3_fields({
        "num_hidden_layers": 6, "sliding_window": 1024, "sliding_window_pattern": 3, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "query_pre_attn_scalar": 168, "final_logit_softcapping": None,
    })  # fmt: skip
    assert fields["rope"] == (1_000_000.0, {"rope_type": "linear", "factor": 8.0})
    assert fields["sliding_layers"] == (0, 1, 3, 4) and fields["sliding_window"] == 1024
    assert (fields["rope_local_theta"], fields["query_pre_attn_scalar"]) == (10_000.0, 168)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_matches_transformers(gemma_path, backend):
    """Prompts up to 70 tokens (4x the window) in 64-token chunks, decodes running past the window."""
    if backend == "cpu" and ops is None:
        pytest.skip("C++ kernels could not be built here")
    hf = _hf(gemma_path)
    prompts = _prompts(hf.config.vocab_size)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    # The window matters for these prompts: the same weights seeing every position answer otherwise.
    unwindowed = _hf(gemma_path, layer_types=["full_attention"] * 4)
    assert [hf_greedy(unwindowed, p, NEW_TOKENS) for p in prompts[-2:]] != expected[-2:]
    llm = LLM(str(gemma_path), dtype="float32", block_size=4, kv_cache_memory=4 << 20, max_num_batched_tokens=64,
              backend=backend)  # fmt: skip
    assert _greedy(llm, prompts) == expected
    assert llm.engine.block_manager.window_pool is not None
    _assert_all_free(llm)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_chunked_prefill_and_prefix_cache_keep_the_output(gemma_path, backend):
    """7-token chunks, and prompts that share a 48-token prefix computed by an earlier request (a warm
    prefix cache, its blocks partly outside the window), give the output of one whole-prompt step."""
    if backend == "cpu" and ops is None:
        pytest.skip("C++ kernels could not be built here")
    hf = _hf(gemma_path)
    vocab = hf.config.vocab_size
    prefix = _prompts(vocab, (48,), seed=3)[0]
    prompts = [prefix + tail for tail in _prompts(vocab, (1, 9, 30), seed=4)]
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    chunked = LLM(str(gemma_path), dtype="float32", block_size=4, kv_cache_memory=4 << 20, max_num_batched_tokens=7,
                  backend=backend)  # fmt: skip
    assert _greedy(chunked, prompts) == expected
    cached = LLM(str(gemma_path), dtype="float32", block_size=4, kv_cache_memory=4 << 20, backend=backend)
    _greedy(cached, [prefix])
    hits_before = cached.engine.stats.prefix_cache_hits
    assert [_greedy(cached, [p])[0] for p in prompts] == expected
    assert cached.engine.stats.prefix_cache_hits >= hits_before + 3 * 44  # 11 blocks of 4 per prompt


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_speculative_decoding_keeps_the_output(gemma_path, backend):
    """Verification rows (a decode's few queries) with sliding windows: n-gram drafts on prompts that
    repeat themselves past the window, and a 2-layer self-draft, give transformers' greedy output."""
    if backend == "cpu" and ops is None:
        pytest.skip("C++ kernels could not be built here")
    hf = _hf(gemma_path)
    prompts = [p * 3 for p in _prompts(hf.config.vocab_size, (9, 13), seed=5)]
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    for spec in ({"method": "ngram", "num_speculative_tokens": 3}, {"method": "draft_model", "model": "self:layers=2"}):
        llm = LLM(str(gemma_path), dtype="float32", block_size=4, kv_cache_memory=4 << 20, backend=backend,
                  speculative_config={"num_speculative_tokens": 3, **spec})  # fmt: skip
        assert _greedy(llm, prompts) == expected, spec
        assert llm.engine.stats.spec_num_draft_tokens > 0, spec


# -- the sliding-window layers' own KV pool ------------------------------------------------------------

# Window blocks a sequence holds between steps at most: its next query's window, straddling a block more.
WINDOW_HELD = -(-WINDOW // 4) + 1


def _assert_all_free(llm: LLM) -> None:
    """Every block of both pools is back, and nothing was written to the window pool's NULL_BLOCK."""
    bm = llm.engine.block_manager
    bm.check_invariants([])
    assert (bm.num_free_blocks, bm.num_free_window_blocks) == (bm.num_blocks, bm.num_window_blocks)
    if bm.window_pool is not None:
        for layer in llm.engine.model_config.sliding_layers:
            k_cache, v_cache = llm.engine.runner.kv_caches[layer]
            assert k_cache.shape[0] == bm.num_window_blocks + 1
            assert not k_cache[NULL_BLOCK].any() and not v_cache[NULL_BLOCK].any()


def _run_checked(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], int, int]:
    """Greedy tokens of each prompt, stepping the engine and checking after every step both pools'
    bookkeeping and that no sequence holds more window blocks than WINDOW_HELD; with the most window
    blocks one sequence held and the most sequences that ran at once."""
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done, most_held, most_running = {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.error is None
                done[out.request_id] = out.outputs[0].token_ids
        live = engine.scheduler.running + engine.scheduler.waiting
        engine.block_manager.check_invariants(live)
        for seq in live:
            held = len(seq.window_block_table) - seq.window_block_table.count(NULL_BLOCK)
            assert held <= WINDOW_HELD, (seq.num_computed_tokens, seq.window_block_table)
            most_held = max(most_held, held)
        most_running = max(most_running, len(engine.scheduler.running))
    _assert_all_free(llm)
    return [done[str(i)] for i in range(len(prompts))], most_held, most_running


# cuda in Triton's interpreter takes ~25 s on 2 cores; the kernel's window alone is test_triton_attention's.
@pytest.mark.parametrize("backend", ["torch", "cpu", pytest.param("cuda", marks=pytest.mark.slow)])
def test_window_layers_hold_only_their_window(gemma_path, backend):
    """Prompts up to 4x the window in 7-token chunks: the sliding-window layers' pool releases the blocks
    before every later query's window as sequences advance, and the output stays transformers'. (cuda: the
    Triton kernels, in Triton's interpreter where no GPU is present.)"""
    if backend == "cpu" and ops is None:
        pytest.skip("C++ kernels could not be built here")
    if backend == "cuda" and (reason := CudaBackend.unavailable_reason(torch.device("cpu"))) is not None:
        pytest.skip(reason)
    hf = _hf(gemma_path)
    prompts = _prompts(hf.config.vocab_size)
    llm = LLM(str(gemma_path), dtype="float32", block_size=4, kv_cache_memory=4 << 20, max_num_batched_tokens=7,
              max_num_seqs=4, backend=backend)  # fmt: skip
    tokens, most_held, _ = _run_checked(llm, prompts)
    assert tokens == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert most_held == WINDOW_HELD  # the bound is reached, never passed: 80 positions, 5 blocks held


def test_preemption_frees_both_pools(gemma_path):
    """A full-attention pool of 40 blocks for four 50-token sequences (13 blocks each): preemptions, and
    recomputed sequences end as transformers' do."""
    hf = _hf(gemma_path)
    prompts = _prompts(hf.config.vocab_size, (40, 40, 40, 40), seed=6)
    one_pool = 40 * kv_cache.bytes_per_block(load_checkpoint(str(gemma_path)).config, 4, torch.float32)
    llm = LLM(str(gemma_path), dtype="float32", block_size=4, kv_cache_memory=one_pool, max_num_seqs=4,
              max_num_batched_tokens=64, backend="torch")  # fmt: skip
    assert llm.engine.block_manager.num_blocks == 40
    tokens, _, _ = _run_checked(llm, prompts)
    assert tokens == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert llm.engine.stats.num_preemptions > 0


def test_prefix_hit_needs_the_window_blocks(gemma_path):
    """A 48-token prefix cached by an earlier request: reused whole while the window pool still holds
    its last window's blocks; once other requests took those blocks over, only the full-attention
    blocks are still cached, and the prefix is recomputed (a shorter hit at most). Cold, warm and
    evicted runs give the same tokens."""
    hf = _hf(gemma_path)
    vocab = hf.config.vocab_size
    prefix = _prompts(vocab, (48,), seed=3)[0]
    prompt = prefix + _prompts(vocab, (9,), seed=4)[0]
    expected = hf_greedy(hf, prompt, NEW_TOKENS)
    # One sequence at a time: a window pool of 1 + 6 + 16 blocks, which a 64-token prompt turns over.
    llm = LLM(str(gemma_path), dtype="float32", block_size=4, kv_cache_memory=4 << 20, max_num_seqs=1,
              max_num_batched_tokens=64, backend="torch")  # fmt: skip
    bm, stats = llm.engine.block_manager, llm.engine.stats
    assert bm.num_window_blocks == 22
    assert _greedy(llm, [prefix]) == [hf_greedy(hf, prefix, NEW_TOKENS)]
    hits = stats.prefix_cache_hits
    assert _greedy(llm, [prompt]) == [expected]
    assert stats.prefix_cache_hits - hits == 48  # 12 blocks: all the prefix
    hits = stats.prefix_cache_hits
    _greedy(llm, _prompts(vocab, (64,), seed=7))  # takes every window block over
    assert _greedy(llm, [prompt]) == [expected]
    assert stats.prefix_cache_hits - hits < 48


def test_capacity_for_long_contexts(gemma_path, monkeypatch):
    """At the same cache memory (120 blocks of every layer), eight 100-token prompts: with one pool for
    every layer at most four run at once; with the window layers' own pool all eight do, and the
    tokens are the same."""
    prompts = _prompts(load_checkpoint(str(gemma_path)).config.vocab_size, (100,) * 8, seed=8)
    memory = 120 * kv_cache.bytes_per_block(load_checkpoint(str(gemma_path)).config, 4, torch.float32)
    options = dict(dtype="float32", block_size=4, kv_cache_memory=memory, max_num_seqs=8, max_num_batched_tokens=128,
                   backend="torch")  # fmt: skip
    split = LLM(str(gemma_path), **options)
    tokens, _, running = _run_checked(split, prompts)
    assert running == 8
    monkeypatch.setattr(kv_cache, "window_pool_blocks", lambda *args: 0)
    one_pool = LLM(str(gemma_path), **options)
    assert one_pool.engine.block_manager.window_pool is None and one_pool.engine.block_manager.num_blocks == 120
    assert _run_checked(one_pool, prompts)[::2] == (tokens, 4)


def _gguf_from_hf(hf_dir: Path, path: Path) -> None:
    """The tiny HF Gemma 3 written as llama.cpp's converter writes it: its names, norms stored as 1 + w,
    F32 tensors, the HF byte-level BPE vocabulary as a gpt2 tokenizer."""
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer = GGUFWriter(path, "gemma3")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_sliding_window(cfg["sliding_window"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([1] * len(vocab))
    writer.add_token_merges(merges)
    writer.add_eos_token_id(cfg["eos_token_id"])
    names = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        data = tensor.float().numpy()
        if name.endswith("norm.weight"):
            data = data + np.float32(1)
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            layer, part = name.removeprefix("model.layers.").removesuffix(".weight").split(".", 1)
            gguf_name = f"blk.{layer}.{names[part]}.weight"
        writer.add_tensor(gguf_name, data)
    finish(writer)


def test_gguf_gemma3_matches_the_hf_directory(tiny_model_factory, tmp_path):
    """llama.cpp's Gemma 3 layout (every 6th layer global, local rope theta 10,000, attention scale
    1 / sqrt(head_dim), norms stored as 1 + w): the GGUF of a tiny model greedy-decodes as transformers
    does on its HF directory."""
    hf_dir = tiny_model_factory(
        "gemma3", tie=True, num_hidden_layers=6, num_key_value_heads=1, sliding_window=WINDOW, query_pre_attn_scalar=16
    )
    path = tmp_path / "gemma3.gguf"
    _gguf_from_hf(hf_dir, path)
    config = load_checkpoint(str(path)).config
    assert (config.architecture, config.sliding_window, config.sliding_layers) == ("gemma3", WINDOW, (0, 1, 2, 3, 4))
    hf = _hf(hf_dir)
    prompts = _prompts(hf.config.vocab_size, (3, 40))
    llm = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory=4 << 20)
    assert _greedy(llm, prompts) == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


def test_unsupported_gemma3_configs_are_refused(gemma_path, tmp_path):
    source = gemma_path
    for key, value in (("attn_logit_softcapping", 50.0), ("hidden_activation", "silu")):
        directory = tmp_path / key
        directory.mkdir()
        for f in source.iterdir():
            (directory / f.name).write_bytes(f.read_bytes())
        cfg = json.loads((source / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ModelLoadError, match=key):
            load_checkpoint(str(directory))


# -- the attention kernels' window ----------------------------------------------------------------


def _reference(q, k, v, positions, window, scale):
    """Plain attention of queries at `positions` over keys 0 .. len(k) - 1 of one sequence, fp64."""
    heads, kv_heads = q.shape[1], k.shape[1]
    kk = k.double().repeat_interleave(heads // kv_heads, dim=1)
    vv = v.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    key_pos = torch.arange(k.shape[0])
    hidden = (key_pos[None] > positions[:, None]) | (key_pos[None] <= positions[:, None] - window)
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vv)


def _poisoned_cache(context: int, block_size: int, kv_heads: int, head_dim: int, first_read: int):
    """K/V of positions 0 .. context - 1 in shuffled blocks; the blocks wholly before position `first_read`
    hold NaN, which poisons any output that reads them (0 * NaN is NaN)."""
    blocks = -(-context // block_size)
    k = torch.randn(blocks * block_size, kv_heads, head_dim)
    v = torch.randn(blocks * block_size, kv_heads, head_dim)
    table = torch.randperm(blocks)
    k_cache, v_cache = torch.empty_like(k), torch.empty_like(v)
    for logical, physical in enumerate(table.tolist()):
        rows = slice(logical * block_size, (logical + 1) * block_size)
        unread = (logical + 1) * block_size <= first_read
        k_cache[physical * block_size : (physical + 1) * block_size] = float("nan") if unread else k[rows]
        v_cache[physical * block_size : (physical + 1) * block_size] = float("nan") if unread else v[rows]
    shape = (blocks, block_size, kv_heads, head_dim)
    return k[:context], v[:context], k_cache.view(shape), v_cache.view(shape), table


@pytest.mark.native
@pytest.mark.parametrize("window", [1, 40, 600])
def test_native_attention_window_matches_reference_and_skips_old_blocks(window):
    """A 1,300-position context (crossing the 512-position segments) read by a prefill chunk of 300
    queries and a decode: the window's result, with every block before the chunk's first window NaN."""
    torch.manual_seed(0)
    context, block_size, kv_heads, heads, head_dim = 1300, 16, 1, 4, 64
    start = 1000
    k, v, k_cache, v_cache, table = _poisoned_cache(context, block_size, kv_heads, head_dim, start - window + 1)
    q = torch.randn(context - start, heads, head_dim)
    out = torch.empty_like(q)
    info = torch.tensor([[0, context - start - 1, start], [context - start - 1, 1, context - 1]], dtype=torch.int32)
    tables = table.to(torch.int32).unsqueeze(0).repeat(2, 1)
    ops.paged_attention(out, q, k_cache, v_cache, tables, info, head_dim**-0.5, window=window)
    expected = _reference(q, k, v, torch.arange(start, context), window, head_dim**-0.5)
    assert torch.allclose(out.double(), expected, atol=1e-5), (out.double() - expected).abs().max()


def test_torch_attention_window_matches_reference_and_skips_old_blocks():
    """The torch backend: a prefill chunk with cached context and a decode, through the metadata builder."""
    torch.manual_seed(0)
    context, block_size, kv_heads, heads, head_dim, window, start = 300, 4, 1, 4, 16, 24, 250
    k, v, k_cache, v_cache, table = _poisoned_cache(context, block_size, kv_heads, head_dim, start - window + 1)
    table_list = table.tolist()
    seqs = [
        ScheduledSeq(
            seq_id=0,
            request_id="decode",
            start=context - 1,
            token_ids=[0],
            num_draft_tokens=0,
            block_table=table_list,
            seq_len=context,
            completes=True,
        ),
        ScheduledSeq(
            seq_id=1,
            request_id="chunk",
            start=start,
            token_ids=[0] * (context - 1 - start),
            num_draft_tokens=0,
            block_table=table_list,
            seq_len=context - 1,
            completes=True,
        ),
    ]
    builder = TorchMetadataBuilder(TorchBackend(torch.device("cpu")), [(k_cache, v_cache)], block_size)
    _, positions, meta = builder.prepare(StepBatch(seqs=seqs))
    q = torch.randn(len(positions), heads, head_dim)
    # The step's own K/V, written over the cache by the call.
    out = paged_attention(q, k[positions], v[positions], k_cache, v_cache, meta, head_dim**-0.5, window=window)
    expected = _reference(q, k, v, positions, window, head_dim**-0.5)
    assert torch.allclose(out.double(), expected, atol=1e-5), (out.double() - expected).abs().max()


# -- sizing the two pools ------------------------------------------------------------------------------

# Gemma-3-270M's KV shape: 18 layers, every 6th global, window 512, one KV head of 256 dims.
GEMMA3_270M = ModelConfig(
    architecture="gemma3", vocab_size=262_144, hidden_size=640, intermediate_size=2048, num_layers=18, num_heads=4,
    num_kv_heads=1, head_dim=256, sliding_window=512, sliding_layers=tuple(i for i in range(18) if (i + 1) % 6),
)  # fmt: skip


def test_kv_cache_without_a_window_pool_is_one_pool_as_before():
    """No sliding layers, only sliding layers, or a window no sequence outgrows by a block: one pool of
    every layer, the numbers the engine always had."""
    limits = (256, 2048, 32_768)
    for cfg, max_model_len in (
        (dataclasses.replace(GEMMA3_270M, sliding_window=None, sliding_layers=()), 32_768),
        (dataclasses.replace(GEMMA3_270M, sliding_layers=tuple(range(18))), 32_768),
        (GEMMA3_270M, 512 + 15),
    ):
        limits = (256, 2048, max_model_len)
        block = 2 * 18 * 16 * 256 * 2
        assert kv_cache.window_pool_blocks(cfg, 16, *limits) == 0
        assert kv_cache.kv_cache_layout(cfg, 16, torch.bfloat16, 4 << 30, *limits) == kv_cache.KVCacheLayout(
            (4 << 30) // block, block
        )
        assert kv_cache.wanted_bytes(cfg, 16, torch.bfloat16, *limits) == 256 * -(-max_model_len // 16) * block
    assert kv_cache.window_pool_blocks(GEMMA3_270M, 16, 256, 2048, 512 + 16) > 0


def test_window_pool_sizing_rule():
    """The window pool holds cdiv(window, block) + 2 blocks per sequence the scheduler may run, plus the
    step's token budget in blocks, plus NULL_BLOCK; never more than one pool of every layer would have
    had (but what one sequence alone needs); the full-attention pool gets the rest of the memory."""
    per_layer = 2 * 16 * 256 * 2  # one bf16 block of one layer
    assert kv_cache.window_pool_blocks(GEMMA3_270M, 16, 256, 2048, 32_768) == 1 + 256 * (32 + 2) + 128
    layout = kv_cache.kv_cache_layout(GEMMA3_270M, 16, torch.bfloat16, 4 << 30, 256, 2048, 32_768)
    one_pool = (4 << 30) // (18 * per_layer)
    assert (layout.window_blocks, layout.window_block_bytes, layout.block_bytes) == (
        8833,
        15 * per_layer,
        3 * per_layer,
    )
    assert layout.num_blocks == ((4 << 30) - 8833 * 15 * per_layer) // (3 * per_layer) > 2.9 * one_pool
    assert layout.total_bytes <= 4 << 30
    # A small budget: the window pool is capped at the one pool's blocks, the full pool is not below it.
    small = kv_cache.kv_cache_layout(GEMMA3_270M, 16, torch.bfloat16, 1000 * 18 * per_layer, 256, 2048, 32_768)
    assert small.window_blocks == 1000 and small.num_blocks == 1000
    # Smaller still: a one pool of fewer blocks than one sequence alone needs in the window pool (1 + 34 +
    # 128) stays one pool.
    tiny = kv_cache.kv_cache_layout(GEMMA3_270M, 16, torch.bfloat16, 162 * 18 * per_layer, 256, 2048, 32_768)
    assert tiny == kv_cache.KVCacheLayout(162, 18 * per_layer)
    assert kv_cache.kv_cache_layout(GEMMA3_270M, 16, torch.bfloat16, 163 * 18 * per_layer, 256, 2048, 32_768) == (
        kv_cache.KVCacheLayout(163, 3 * per_layer, 163, 15 * per_layer)
    )
    assert kv_cache.wanted_bytes(GEMMA3_270M, 16, torch.bfloat16, 256, 2048, 32_768) == (
        256 * 2048 * 3 * per_layer + 8833 * 15 * per_layer
    )
