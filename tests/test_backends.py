"""Execution backends (tachyllm/backends): the torch and cpu backends compute the same steps, the
choice is made once by the rules EngineConfig documents, and a third backend is one class."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from helpers.engine import backend_engine, scheduled_seq

from tachyllm import LLM, SamplingParams
from tachyllm.backends import AttentionMetadata, Backend, MetadataBuilder, register_backend, registry
from tachyllm.backends.base import LayerKV
from tachyllm.config import EngineConfig
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.entrypoints.cli import add_engine_args, engine_config
from tachyllm.errors import ConfigError
from tachyllm.eval.greedy import greedy_tokens
from tachyllm.kernels import native
from tachyllm.kernels.linear import pack_linears
from tachyllm.step import StepBatch

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}


@pytest.mark.native
def test_both_backends_compute_the_same_steps(tiny_model_factory):
    """Prefill chunks (a first one, then one on cached context), a decode with draft tokens next to a
    plain decode: the hidden states of every row agree between the C++ kernels and PyTorch."""
    path = tiny_model_factory("llama")
    engines = [backend_engine(path, "torch"), backend_engine(path, "cpu")]
    a, b = list(range(3, 23)), list(range(40, 70))  # 20 and 30 tokens
    ta, tb = list(range(0, 8)), list(range(8, 18))
    steps = [
        StepBatch([scheduled_seq(1, a, 0, 12, [], ta), scheduled_seq(2, b, 0, 10, [], tb)]),
        StepBatch([scheduled_seq(1, a, 12, 8, [], ta), scheduled_seq(2, b, 10, 20, [], tb)]),
        StepBatch([scheduled_seq(1, a + [5], 20, 1, [6, 7], ta), scheduled_seq(2, b + [9], 30, 1, [], tb)]),
    ]
    for batch in steps:
        plain, kernels = (e.runner.forward(batch) for e in engines)
        assert plain.shape == (batch.num_tokens, engines[0].model_config.hidden_size)
        torch.testing.assert_close(kernels, plain, rtol=1e-4, atol=1e-4)


@pytest.mark.native
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_both_backends_give_the_same_greedy_tokens(tiny_model_factory, kv_cache_dtype):
    """Chunked prefill, n-gram drafts, and a second pass whose prompts start on cached blocks."""
    path = tiny_model_factory("llama")
    prompts = ["hello hello hello hello", "def add(a, b): return a + b " * 3, "x"]
    runs = {}
    for backend in ("torch", "cpu"):
        llm = LLM(model=str(path), dtype="float32", backend=backend, max_num_batched_tokens=16, kv_cache_memory=4 << 20,
                  kv_cache_dtype=kv_cache_dtype, speculative_config=SPEC)  # fmt: skip
        hits = llm.engine.stats.prefix_cache_hits
        runs[backend] = [
            [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] for _ in range(2)
        ]
        assert llm.engine.stats.prefix_cache_hits > hits
    assert runs["cpu"] == runs["torch"]
    assert runs["torch"][0] == runs["torch"][1]


@pytest.mark.native
def test_fused_layers_run_where_every_part_has_a_kernel(tiny_model_factory):
    """With bf16 linears on the C++ kernel (forced here: the engine does not use its scalar loop),
    each layer becomes one DecodeLayer call; tokens and logprobs equal the module path's."""
    engine = backend_engine(tiny_model_factory("llama"), "cpu", dtype="bfloat16")
    backend, model = engine.backend, engine.model
    pack_linears(model, backend.kernels)
    model.fuse_layers(backend)
    assert all(layer.fused is not None for layer in model.layers)
    prompts = [[5, 6, 7, 8, 5, 6, 7], list(range(10, 40))]
    fused = greedy_tokens(engine, prompts, 8)
    for layer in model.layers:
        layer.fused = None
    assert greedy_tokens(engine, prompts, 8) == fused


def test_selection_rules(monkeypatch, caplog):
    cpu = torch.device("cpu")
    built = native.native_ops() is not None
    assert registry.resolve_backend_name("auto", cpu) == ("cpu" if built else "torch")
    assert registry.resolve_backend_name("auto", torch.device("meta")) == "torch"
    assert registry.resolve_backend_name("torch", torch.device("meta")) == "torch"
    with pytest.raises(ConfigError, match="backend must be one of auto, cpu, cuda, torch, got 'vulkan'"):
        registry.resolve_backend_name("vulkan", cpu)
    with pytest.raises(ConfigError, match="run on the CPU only, and the device is meta"):
        registry.resolve_backend_name("cpu", torch.device("meta"))
    monkeypatch.setenv("TACHY_NATIVE", "0")
    with pytest.raises(ConfigError, match="TACHY_NATIVE turns the C.. kernels off"):
        registry.resolve_backend_name("cpu", cpu)
    monkeypatch.delenv("TACHY_NATIVE")
    monkeypatch.setattr(native, "native_ops", lambda: None)
    with pytest.raises(ConfigError, match="could not be built"):
        registry.resolve_backend_name("cpu", cpu)
    assert registry.resolve_backend_name("auto", cpu) == "torch"
    with caplog.at_level(logging.INFO, logger="tachyllm"):
        backend = registry.create_backend("auto", cpu)
    assert backend.name == "torch" and "backend: torch (portable PyTorch ops), chosen by auto" in caplog.text


def test_a_backend_that_cannot_run_here_fails_before_the_checkpoint_is_read(tmp_path, monkeypatch):
    """The configuration takes any backend name it knows; whether that backend runs on this machine is
    checked where it is created, which the engine does first: the refusal names the backend, not the
    (here missing) model file."""
    missing = str(tmp_path / "missing.gguf")
    with pytest.raises(ConfigError, match="backend must be one of auto, cpu, cuda, torch, got 'vulkan'"):
        LLMEngine(EngineConfig(model=missing, backend="vulkan", threads=1))
    monkeypatch.setenv("TACHY_NATIVE", "0")
    config = EngineConfig(model=missing, backend="cpu", threads=1)
    assert config.backend_config.backend == "cpu"
    with pytest.raises(ConfigError, match="backend 'cpu' cannot run here: TACHY_NATIVE turns the C.. kernels off"):
        LLMEngine(config)
    with pytest.raises(ConfigError, match="backend 'cpu' cannot run here: the C.. kernels run on the CPU only"):
        LLM(missing, backend="cpu", device="meta", threads=1)


def test_cuda_selection_rules(monkeypatch):
    """auto picks cuda on a CUDA device where triton imports; elsewhere cuda cannot run, except on the
    CPU under Triton's interpreter (for the tests)."""
    import importlib.util

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert registry.resolve_backend_name("auto", cuda) == "cuda"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="needs a CUDA device .and triton., and the device is cpu"):
        registry.resolve_backend_name("cuda", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert registry.resolve_backend_name("cuda", cpu) == "cuda"
    assert registry.resolve_backend_name("auto", cpu) != "cuda"
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "triton" else find_spec(name))
    assert registry.resolve_backend_name("auto", cuda) == "torch"
    with pytest.raises(ConfigError, match="triton is not installed"):
        registry.resolve_backend_name("cuda", cuda)


def test_cli_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args([])).backend == "auto"
    assert engine_config(parser.parse_args(["--backend", "torch"])).backend == "torch"
    assert "cuda" in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--backend", "vulkan"])


def test_engine_logs_its_backend(tiny_model_factory, caplog):
    with caplog.at_level(logging.INFO, logger="tachyllm"):
        engine = backend_engine(tiny_model_factory("llama"), "auto")
    expected = "cpu (tachyllm's C++ CPU kernels)" if native.native_ops() is not None else "torch (portable PyTorch ops)"
    assert f"backend: {expected}, chosen by auto" in caplog.text
    assert engine.runner.backend is engine.backend


# -- a third backend: one class, registered; nothing else changes ----------------------------------
@dataclass(kw_only=True, eq=False)
class NaiveMetadata(AttentionMetadata):
    seqs: list[tuple[int, int, int, torch.Tensor]]  # (first row, queries, first position, context slots)


class NaiveBuilder(MetadataBuilder):
    def prepare(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, NaiveMetadata]:
        input_ids, positions, slot_mapping = self.token_inputs(batch)
        bs, row, seqs = self.block_size, 0, []
        for s in batch.seqs:
            n = len(s.token_ids)
            context = torch.tensor([s.block_table[p // bs] * bs + p % bs for p in range(s.start + n)])
            seqs.append((row, n, s.start, context))
            row += n
        return input_ids, positions, NaiveMetadata(backend=self.backend, slot_mapping=slot_mapping, seqs=seqs)


class NaiveBackend(Backend):
    """Per-sequence SDPA over K/V gathered from the paged cache."""

    name = "naive"
    description = "a test's per-sequence SDPA"

    def metadata_builder(self, kv_caches: list[LayerKV], block_size: int) -> NaiveBuilder:
        return NaiveBuilder(self, kv_caches, block_size)

    def attention(self, q, k, v, kv_cache, meta: NaiveMetadata, scale, layer, window=None):
        assert window is None  # the test's Llama model has no sliding-window layers
        k_flat, v_flat = (c.view(-1, *c.shape[2:]) for c in kv_cache)
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        for first, n, start, context in meta.seqs:
            keys, values = (c[context].repeat_interleave(group, dim=1).transpose(0, 1) for c in (k_flat, v_flat))
            visible = torch.arange(len(context)).unsqueeze(0) <= torch.arange(start, start + n).unsqueeze(1)
            o = F.scaled_dot_product_attention(q[first : first + n].transpose(0, 1), keys, values, visible, scale=scale)
            out[first : first + n] = o.transpose(0, 1)
        return out


def test_a_registered_backend_runs_the_engine(tiny_model_factory, monkeypatch):
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
    register_backend(NaiveBackend)
    path = str(tiny_model_factory("llama"))
    prompts = ["hello hello hello hello", "def add(a, b): return a + b " * 3, "x"]
    tokens = {}
    for backend in ("naive", "torch"):
        llm = LLM(model=path, dtype="float32", backend=backend, max_num_batched_tokens=16, kv_cache_memory=4 << 20,
                  speculative_config=SPEC)  # fmt: skip
        assert type(llm.engine.backend).__name__ == ("NaiveBackend" if backend == "naive" else "TorchBackend")
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert tokens["naive"] == tokens["torch"]
