"""The token embedding looked up on a GGUF table's own blocks (GGUFEmbedding over quant_rows): rows
equal to the gguf package's dequantization bit for bit, the same model output as a dequantized table,
a tied head's tiles shared, the table never loaded dense; and where the lookup keeps a dense table."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from helpers.engine import gguf_engine
from helpers.gguf_files import Q4_K_M_LIKE, TYPES, random_blocks, write_mixed_gguf
from torch import nn

import tachyllm.quantization.apply as apply
from tachyllm.backends.cpu_backend import CpuBackend
from tachyllm.config import QuantConfig
from tachyllm.errors import ModelLoadError
from tachyllm.eval.quality import sequence_logprobs
from tachyllm.kernels import native
from tachyllm.loading import load_checkpoint
from tachyllm.quantization.gguf_packed import GGUFEmbedding, GGUFLinear
from tachyllm.runner.model_loader import build_model, lookup_only_table

ops = native.native_ops()
pytestmark = [
    pytest.mark.native,
    pytest.mark.skipif(
        ops is None or ops.quant_gemv_isa() == "scalar", reason="needs the C++ block kernels with AVX-512 VNNI or AVX2"
    ),
]
T = GGMLQuantizationType
IDS = [(i * 37) % 250 + 3 for i in range(40)]


def _table(kind: GGMLQuantizationType, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tiles, layout, the gguf package's dequantized float32 table) of random valid blocks."""
    raw = random_blocks(kind, rows, cols, np.random.default_rng(3))
    table = torch.from_numpy(dequantize(raw, kind).reshape(rows, cols))
    return ops.quant_pack_gguf(int(kind), torch.from_numpy(raw), cols), torch.tensor([[int(kind), rows]]), table


@pytest.mark.parametrize("kind", TYPES)
def test_rows_are_the_gguf_dequantization_bit_for_bit(kind):
    """Every row of every block type (37 rows: the last tile partial; 2 super-blocks a row), in every
    output dtype the model may have: exactly the package's float32 values, rounded once to the dtype."""
    rows, cols = 37, 512
    packed, layout, table = _table(kind, rows, cols)
    every = torch.arange(rows).reshape(37, 1)
    ids = torch.tensor([[0, 36, 5, 5], [17, 16, 15, 31]])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = ops.quant_rows(packed, layout, ids, cols, dtype)
        assert got.dtype == dtype and got.shape == (2, 4, cols)
        assert torch.equal(got, table[ids].to(dtype))
        assert torch.equal(ops.quant_rows(packed, layout, every, cols, dtype)[:, 0], table.to(dtype))
    assert torch.equal(ops.quant_rows(packed, layout, ids.int(), cols, torch.float32), table[ids])
    assert ops.quant_rows(packed, layout, torch.zeros(0, dtype=torch.long), cols, torch.float32).shape == (0, cols)


def test_bad_lookups_are_refused():
    packed, layout, _ = _table(T.Q4_K, 37, 512)
    for bad in (37, -1):
        with pytest.raises(RuntimeError, match=f"row id {bad} is outside the matrix's 37 rows"):
            ops.quant_rows(packed, layout, torch.tensor([0, bad]), 512, torch.float32)
    with pytest.raises(RuntimeError, match="the layout must name one matrix"):
        ops.quant_rows(packed, torch.cat([layout, layout]), torch.tensor([0]), 512, torch.float32)
    with pytest.raises(RuntimeError, match="packed weights do not match"):
        ops.quant_rows(packed, layout, torch.tensor([0]), 768, torch.float32)
    with pytest.raises(RuntimeError, match="ids must be int64 or int32"):
        ops.quant_rows(packed, layout, torch.tensor([0.0]), 512, torch.float32)
    with pytest.raises(RuntimeError, match="dtype must be"):
        ops.quant_rows(packed, layout, torch.tensor([0]), 512, torch.int8)


def _dense_table(monkeypatch) -> None:
    """Builds from here on look up a dequantized table, as before GGUFEmbedding."""
    monkeypatch.setattr(apply, "_packs_embedding", lambda *args: False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_untied_table_is_looked_up_on_its_blocks(tmp_path, monkeypatch, caplog, dtype):
    """The Q4_K table of a file with its own head: the lookup's own tiles (~0.6 bytes a weight instead
    of the dtype's 2 or 4), never streamed by a step, and the model's output identical to a dense table's."""
    path = write_mixed_gguf(tmp_path / "untied.gguf", Q4_K_M_LIKE, head=T.Q6_K)
    with caplog.at_level(logging.INFO, logger="tachyllm"):
        packed = gguf_engine(path, quantization="gguf", dtype=dtype)
    model = packed.model
    assert "embed_tokens: the file's Q4_K blocks, rows dequantized as looked up" in caplog.text
    assert isinstance(model.embed_tokens, GGUFEmbedding) and isinstance(model.lm_head, GGUFLinear)
    assert lookup_only_table(model) is model.embed_tokens.packed
    _dense_table(monkeypatch)
    dense = gguf_engine(path, quantization="gguf", dtype=dtype)
    table = dense.model.embed_tokens
    assert type(table) is nn.Embedding
    every = torch.arange(table.num_embeddings)
    assert torch.equal(model.embed_tokens(every), table(every))
    assert torch.equal(sequence_logprobs(packed, IDS), sequence_logprobs(dense, IDS))
    assert packed.weight_bytes == dense.weight_bytes  # a step streams neither table
    dense_bytes = table.weight.numel() * table.weight.element_size()
    assert model.embed_tokens.packed.numel() < dense_bytes / (3 if dtype == "bfloat16" else 6)


def test_tied_head_and_lookup_share_one_copy(tmp_path, monkeypatch, caplog):
    """A tied model (no output.weight): the head's tiles are the lookup's, so the table is held once,
    at the file's bytes, and the output is the dense table's."""
    path = write_mixed_gguf(tmp_path / "tied.gguf", Q4_K_M_LIKE, head=None, table=T.Q6_K)
    with caplog.at_level(logging.INFO, logger="tachyllm"):
        packed = gguf_engine(path, quantization="gguf", dtype="bfloat16")
    model = packed.model
    assert model.config.tie_word_embeddings
    assert "embed_tokens: the file's Q6_K blocks, the tied LM head's tiles (one copy)" in caplog.text
    assert model.embed_tokens.packed is model.lm_head.packed
    assert lookup_only_table(model) is None
    _dense_table(monkeypatch)
    dense = gguf_engine(path, quantization="gguf", dtype="bfloat16")
    assert type(dense.model.embed_tokens) is nn.Embedding and isinstance(dense.model.lm_head, GGUFLinear)
    assert torch.equal(sequence_logprobs(packed, IDS), sequence_logprobs(dense, IDS))
    assert packed.weight_bytes == dense.weight_bytes  # the head's tiles, streamed either way


def test_tied_head_cut_to_a_shortlist_keeps_the_whole_table_for_the_lookup(tmp_path):
    """A draft's shortlist head holds some rows of the tied table; the lookup still needs every row,
    from tiles of its own (the table is still never loaded dense)."""
    path = write_mixed_gguf(tmp_path / "tied.gguf", Q4_K_M_LIKE, head=None, table=T.Q8_0)
    ckpt = load_checkpoint(str(path))
    kept = torch.tensor([3, 7, 100, 5])
    backend = CpuBackend(torch.device("cpu"))
    model, _ = build_model(ckpt, torch.float32, backend, 128, QuantConfig(method="gguf"), head_token_ids=kept)
    full, _ = build_model(load_checkpoint(str(path)), torch.float32, backend, 128, QuantConfig(method="gguf"))
    assert isinstance(model.embed_tokens, GGUFEmbedding) and model.embed_tokens.num_embeddings == ckpt.config.vocab_size
    assert model.embed_tokens.packed is not model.lm_head.packed
    every = torch.arange(ckpt.config.vocab_size)
    assert torch.equal(model.embed_tokens(every), full.embed_tokens(every))
    hidden = torch.randn(2, ckpt.config.hidden_size)
    assert torch.equal(model.compute_logits(hidden), full.compute_logits(hidden)[:, kept])


def test_a_table_without_a_kernel_stays_dense(tmp_path, caplog):
    """An F16 table (no block kernel): loaded and looked up dense, as before; nothing logged about it."""
    path = write_mixed_gguf(tmp_path / "f16.gguf", Q4_K_M_LIKE, head=T.Q6_K, table=T.F16)
    with caplog.at_level(logging.INFO, logger="tachyllm"):
        model = gguf_engine(path, quantization="gguf").model
    assert type(model.embed_tokens) is nn.Embedding and isinstance(model.lm_head, GGUFLinear)
    assert "embed_tokens:" not in caplog.text


def test_a_table_of_another_size_than_the_vocabulary_is_refused(tmp_path):
    """A malformed file: the packed lookup refuses it as loading a dense table does."""
    path = write_mixed_gguf(tmp_path / "bad.gguf", Q4_K_M_LIKE, head=None, table_rows=16 * 30)
    with pytest.raises(ModelLoadError, match=r"'model.embed_tokens.weight' has 480 rows, expected the vocabulary's"):
        gguf_engine(path, quantization="gguf")
    with pytest.raises(ModelLoadError, match=r"embed_tokens.weight. has shape \(480, 256\)"):
        gguf_engine(path)


def test_without_gguf_quantization_the_table_is_dequantized(tmp_path):
    path = write_mixed_gguf(tmp_path / "plain.gguf", Q4_K_M_LIKE, head=T.Q6_K)
    assert type(gguf_engine(path).model.embed_tokens) is nn.Embedding
