"""An encoder's linears (BERT, the pooling runner): in bf16 they run on oneDNN's prepacked GEMM where
oneDNN packs bf16 (an encoder step is hundreds of rows, where the decode matrix-vector kernel is slow),
and an input's embedding stays the same alone and packed with inputs of other lengths."""

from __future__ import annotations

import pytest
import torch
from helpers.pooling_models import make_tiny_bert

from tachyllm.entrypoints.llm import LLM
from tachyllm.kernels.linear import PackedLinear, onednn_packing_available

TEXTS = ["a", "the quick brown fox jumps over the lazy dog", "hello world, again and again and again", "x y"]


@pytest.mark.skipif(not onednn_packing_available(torch.bfloat16), reason="oneDNN packs no bf16 on this CPU")
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_bf16_encoder_linears_are_onednn_packed_and_packing_invariant(tmp_path, backend):
    llm = LLM(str(make_tiny_bert(tmp_path)), dtype="bfloat16", backend=backend)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 4 * 2  # qkv, o, up, down in each of the tiny model's 2 layers
    assert all(m.packed_weight is not None and m.ops is None for m in linears)
    alone = [torch.tensor(llm.embed(text)[0].outputs.embedding) for text in TEXTS]
    packed = llm.embed(TEXTS + TEXTS[::-1])
    for i, vector in enumerate(alone):
        assert torch.equal(torch.tensor(packed[i].outputs.embedding), vector)
        assert torch.equal(torch.tensor(packed[-1 - i].outputs.embedding), vector)
