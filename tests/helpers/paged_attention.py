"""The Triton paged-attention kernel against a naive reference: random batches over shuffled cache
blocks, the reference, the tolerances per dtype, and the split-KV invariance check."""

from __future__ import annotations

import torch

from tachyllm.kernels.kv_quant import QuantizedKV
from tachyllm.kernels.triton.paged_attention import paged_attention

# Where the kernels run: compiled on a GPU, else in Triton's interpreter on the CPU (tests/conftest.py).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def make_batch(specs, block_size, kv_heads, head_dim, heads, dtype, cache_dtype=None, seed=0):
    """specs: (cached positions, queries) per sequence. Random K/V fill every sequence's context in a
    cache whose blocks are shuffled between sequences. Returns q, caches, metadata, scales."""
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    need = [-(-(c + n) // block_size) for c, n in specs]
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for k in need:
        tables.append(order[at : at + k])
        at += k
    width = max(need)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    quant = cache_dtype in (torch.int8, *FP8)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    scales = (torch.rand(kv_heads, generator=gen) * 0.02 + 0.01, torch.rand(kv_heads, generator=gen) * 0.02 + 0.01)
    for (c, n), t in zip(specs, tables):
        slots = torch.tensor([t[p // block_size] * block_size + p % block_size for p in range(c + n)])
        k = torch.randn(c + n, kv_heads, head_dim, generator=gen)
        v = torch.randn(c + n, kv_heads, head_dim, generator=gen)
        for cache, x, sc in ((k_cache, k, scales[0]), (v_cache, v, scales[1])):
            if quant:
                QuantizedKV(cache.view(-1, kv_heads, head_dim), sc.view(-1, 1)).write(slots, x)
            else:
                cache.view(-1, kv_heads, head_dim)[slots] = x.to(cache_dtype)
    counts = [n for _, n in specs]
    query_start = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in specs], dtype=torch.int32)
    q = torch.randn(sum(counts), heads, head_dim, generator=gen).to(dtype)
    k_scale, v_scale = scales if quant else (None, None)
    tensors = q, k_cache, v_cache, block_tables, query_start, seq_lens, k_scale, v_scale
    return tuple(None if t is None else t.to(DEVICE) for t in tensors)


def reference(q, k_cache, v_cache, block_tables, query_start, seq_lens, scale, window=None, k_scale=None, v_scale=None):
    """Per query, in float64 over the dequantized cache (read as the PyTorch path reads it), on the CPU."""
    q, k_cache, v_cache, block_tables, query_start, seq_lens, k_scale, v_scale = (
        None if t is None else t.cpu()
        for t in (q, k_cache, v_cache, block_tables, query_start, seq_lens, k_scale, v_scale)
    )
    tokens, heads, head_dim = q.shape
    bs, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)

    def read(cache, sc, slots):
        x = cache.view(-1, kv_heads, head_dim)[slots]
        if sc is not None:
            x = x.float() * sc.view(-1, 1)
        return x.to(q.dtype).double()

    for s in range(seq_lens.shape[0]):
        first, last = int(query_start[s]), int(query_start[s + 1])
        n, length = last - first, int(seq_lens[s])
        table = block_tables[s].tolist()
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(length)], dtype=torch.long)
        k, v = read(k_cache, k_scale, slots), read(v_cache, v_scale, slots)
        for i in range(n):
            pos = length - n + i
            lo = 0 if window is None else max(0, pos - window + 1)
            for h in range(heads):
                scores = (k[lo : pos + 1, h // group] @ q[first + i, h].double()) * scale
                out[first + i, h] = torch.softmax(scores, 0) @ v[lo : pos + 1, h // group]
    return out


TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def check(specs, *, block_size=4, kv_heads=2, heads=4, head_dim=64, dtype=torch.float32, cache_dtype=None,
          window=None, segment=512, seed=0):  # fmt: skip
    args = make_batch(specs, block_size, kv_heads, head_dim, heads, dtype, cache_dtype, seed)
    q, kc, vc, bt, qs, sl, ks, vs = args
    scale = head_dim**-0.5
    got = paged_attention(q, kc, vc, bt, qs, sl, scale, window=window, k_scale=ks, v_scale=vs, segment=segment)
    want = reference(q, kc, vc, bt, qs, sl, scale, window, ks, vs)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.double().cpu(), want, atol=TOL[dtype], rtol=TOL[dtype])
    # Long contexts average many values into small outputs: the error relative to the whole output too.
    assert (got.double().cpu() - want).norm() / want.norm() < REL_TOL[dtype]
    return args, got


def check_split_invariance(args, split: torch.Tensor, window: int | None, segment: int) -> None:
    """`split` (the batch's output with split-KV programs) equals the single-program path's bits, and
    each sequence's rows equal those of the sequence computed alone (with a table of its own width)."""
    q, kc, vc, bt, qs, sl, ks, vs = args
    kw = dict(window=window, k_scale=ks, v_scale=vs, segment=segment)
    scale = q.shape[2] ** -0.5
    from tachyllm.kernels.triton import paged_attention as pa

    limit = pa.SPLIT_PARTIALS_BYTES
    pa.SPLIT_PARTIALS_BYTES = 0  # every tile's segments in one program
    try:
        looped = paged_attention(q, kc, vc, bt, qs, sl, scale, **kw)
    finally:
        pa.SPLIT_PARTIALS_BYTES = limit
    assert torch.equal(split, looped)
    block_size = kc.shape[1]
    for s in range(len(sl)):
        a, b = int(qs[s]), int(qs[s + 1])
        one_seq = torch.tensor([0, b - a], dtype=torch.int32, device=q.device)
        table = bt[s : s + 1, : -(-int(sl[s]) // block_size)]
        alone = paged_attention(q[a:b], kc, vc, table, one_seq, sl[s : s + 1], scale, **kw)
        assert torch.equal(alone, split[a:b]), f"sequence {s}"
