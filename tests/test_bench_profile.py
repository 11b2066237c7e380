"""`tachy bench latency --profile`: the decode-step breakdown on a tiny model."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest

from tachyllm import tracing
from tachyllm.bench.datasets import random_token_ids
from tachyllm.bench.profile import CATEGORIES, format_profile, instrumented, is_matmul, profile_decode
from tachyllm.config import EngineConfig
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.entrypoints.cli import main
from tachyllm.kernels.native import native_ops


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def engine(model_path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_path, dtype="float32", kv_cache_memory=4 << 20, threads=1))


def tracer_installed() -> bool:
    return not isinstance(tracing.span("forward"), contextlib.nullcontext)


def test_profile_adds_up_and_restores(engine):
    rng = np.random.default_rng(0)
    prompts = [random_token_ids(engine.tokenizer, 12, rng) for _ in range(3)]
    p = profile_decode(engine, prompts, num_steps=3, warmup_steps=2)

    assert not tracer_installed()
    assert not engine.has_unfinished_requests()

    assert (p.batch_size, p.num_steps, p.warmup_steps) == (3, 3, 2)
    assert set(p.categories_ms) == set(CATEGORIES)
    assert all(v >= 0 for v in p.categories_ms.values()), p.categories_ms
    assert all(v >= 0 for v in p.attention_ms.values()), p.attention_ms
    assert sum(p.categories_ms.values()) == pytest.approx(p.step_ms, rel=1e-6)
    assert sum(p.attention_ms.values()) == pytest.approx(p.categories_ms["attention"], rel=1e-6)
    # Every phase was seen: each step schedules, prepares, runs matmuls and attention, samples.
    for key in ("matmul", "attention", "other_ops", "sampling", "scheduling", "prepare_inputs"):
        assert p.categories_ms[key] > 0, key
    if native_ops() is None:
        assert p.attention_ms["matmul"] > 0 and p.attention_ms["softmax"] > 0
    else:  # the decode attention is one C++ kernel
        assert p.attention_ms["other_ops"] > 0
    assert p.step_ms > 0 and p.unprofiled_step_ms > 0
    assert p.ops_per_step >= p.top_level_ops_per_step > 0
    assert 0 < len(p.top_ops) <= 15
    selfs = [o.self_ms_per_step for o in p.top_ops]
    assert selfs == sorted(selfs, reverse=True)
    assert not any(o.name.startswith("tachy::") for o in p.top_ops)
    text = format_profile(p)
    assert "attention" in text and "Top" in text and "total" in text

    # The engine still works normally afterwards.
    from tachyllm.sampling_params import SamplingParams

    engine.add_request("after", prompts[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def test_instrumentation_is_undone_on_error():
    assert not tracer_installed()
    with pytest.raises(RuntimeError, match="boom"), instrumented():
        assert tracer_installed()
        raise RuntimeError("boom")
    assert not tracer_installed()


def test_matmul_names():
    for name in ("aten::linear", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "mkldnn::_linear_pointwise",
                 "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm", "native::bf16_gemv"):  # fmt: skip
        assert is_matmul(name), name
    for name in (
        "aten::softmax",
        "aten::add",
        "aten::index_select",
        "aten::copy_",
        "aten::mul",
        "native::paged_attention",
    ):
        assert not is_matmul(name), name


def test_latency_profile_flag(tmp_path, model_path, capsys):
    out = tmp_path / "lat.json"
    flags = ["--batch-size", "2", "--input-len", "8", "--output-len", "3", "--num-iters", "1"]
    flags += ["--num-iters-warmup", "0"]
    profile = ["--profile", "--profile-steps", "2", "--profile-warmup-steps", "1"]
    engine = ["--model", model_path, "--dtype", "float32", "--kv-cache-memory", "4M", "--bandwidth-gbs", "10"]
    assert main(["bench", "latency", *flags, *profile, *engine, "--result-json", str(out)]) == 0
    doc = json.loads(out.read_text())
    prof = doc["profile"]
    assert prof["batch_size"] == 2 and prof["num_steps"] == 2
    assert sum(prof["categories_ms"].values()) == pytest.approx(prof["step_ms"], rel=1e-6)
    assert doc["settings"]["profile"] is True
    assert "Decode-step profile" in capsys.readouterr().out


def test_cli_uses_one_interop_thread():
    """`tachy` sets inter-op threads to 1 before any work; it can only be done in a fresh process."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from tachyllm.entrypoints.cli import main\n"
        "try:\n    main(['bench', 'latency', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(torch.get_num_interop_threads())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "1"
