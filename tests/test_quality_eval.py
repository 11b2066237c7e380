"""`tachy eval quality`: report metrics, the CLI (table and --json), and AWQ beating plain int4."""

from __future__ import annotations

import json

import pytest

from tachyllm.config import EngineConfig
from tachyllm.entrypoints.cli import main
from tachyllm.errors import ConfigError
from tachyllm.eval.quality import compare, eval_engine, format_report, heldout_windows, sequence_logprobs
from tachyllm.quantization.calibration import CALIBRATION_FILE, HELDOUT_FILE, load_text


def test_shipped_text_sets_are_disjoint_and_sizable():
    heldout, calibration = load_text(HELDOUT_FILE), load_text(CALIBRATION_FILE)
    assert len(heldout) > 8000 and len(calibration) > 6000
    assert "```python" in heldout  # code as well as prose
    paragraphs = {p for p in calibration.split("\n\n") if len(p) > 80}
    assert not any(p in heldout for p in paragraphs)


def test_tensor_parallel_engine_is_refused_before_it_starts(tiny_model_factory):
    # The eval scores windows through rank 0's runner alone; a tensor-parallel engine has none to lend.
    path = str(tiny_model_factory("llama"))
    with pytest.raises(ConfigError, match="tensor_parallel_size must be 1, got 2"):
        eval_engine(EngineConfig(model=path, threads=1, tensor_parallel_size=2), 32)


def test_engine_compared_with_itself_is_identical(tiny_model_factory):
    path = str(tiny_model_factory("llama"))
    engine = eval_engine(EngineConfig(model=path, threads=1), 32)
    report = compare(engine, engine, heldout_windows(engine, 32, 5), ("same", "same"), worst=2)
    assert report.num_sequences == 5 and report.num_tokens == 5 * 31
    assert report.top1_agreement == 1.0 and report.kl_max == pytest.approx(0.0, abs=1e-6)
    assert report.ppl_config == pytest.approx(report.ppl_reference)
    assert len(report.worst) == 2
    assert "perplexity" in format_report(report) and "worst sequences" in format_report(report)


def test_quantized_report_orders_tail_statistics(tiny_model_factory):
    path = str(tiny_model_factory("llama"))
    ref = eval_engine(EngineConfig(model=path, dtype="float32", threads=1), 32)
    engine = eval_engine(EngineConfig(model=path, threads=1, quantization="int4"), 32)
    r = compare(engine, ref, heldout_windows(ref, 32, 8), ("int4", "fp32"))
    assert 0 < r.kl_p50 <= r.kl_p99 <= r.kl_max
    assert r.worst[0].kl == pytest.approx(r.kl_max)
    assert r.top1_agreement < 1.0


def test_cli_eval_quality_json(tiny_model_factory, capsys):
    path = str(tiny_model_factory("llama"))
    argv = ["eval", "quality", "--model", path, "--quantization", "int8", "--kv-cache-dtype", "fp8"]
    assert main([*argv, "--seq-len", "32", "--max-sequences", "3", "--threads", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_sequences"] == 3
    assert (
        report["config"] == "bfloat16, weights int8, kv fp8"
        and report["reference"] == "float32, weights unquantized, kv auto"
    )
    assert set(report) >= {
        "ppl_reference",
        "ppl_config",
        "top1_agreement",
        "kl_mean",
        "kl_p50",
        "kl_p99",
        "kl_max",
        "worst",
    }


def test_cli_rejects_unknown_options(capsys):
    assert main(["eval", "quality", "--quantization", "int3"]) == 2
    assert "quantization must be one of int8, int4, awq, gguf" in capsys.readouterr().err
    assert main(["generate", "hi", "--kv-cache-dtype", "fp16"]) == 2
    assert "kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2, int8" in capsys.readouterr().err


@pytest.mark.slow
def test_awq_beats_plain_int4_on_the_default_model():
    ref = eval_engine(EngineConfig(dtype="float32", threads=1), 128)
    windows = heldout_windows(ref, 128, 8)
    int4 = compare(eval_engine(EngineConfig(quantization="int4", threads=1), 128), ref, windows, ("int4", "fp32"))
    awq = compare(eval_engine(EngineConfig(quantization="awq", threads=1), 128), ref, windows, ("awq", "fp32"))
    assert awq.kl_mean < int4.kl_mean
    assert awq.ppl_config < int4.ppl_config


def test_report_scores_what_the_engine_computes(tiny_model_factory):
    """The report's teacher-forced pass takes the engine's own path (in bf16 on the CPU: the C++
    attention kernel and fused layers), so its log-probs are the ones the engine samples from."""
    from tachyllm import LLM, SamplingParams

    path = str(tiny_model_factory("llama"))
    engine = eval_engine(EngineConfig(model=path, dtype="bfloat16", threads=1), 32)
    ids = heldout_windows(engine, 32, 1)[0]
    report_lp = sequence_logprobs(engine, ids)
    llm = LLM(model=path, dtype="bfloat16", threads=1, kv_cache_memory=1 << 22)
    for n in (7, 20):
        out = llm.generate([ids[:n]], SamplingParams(temperature=0, max_tokens=1, logprobs=3), use_tqdm=False)[
            0
        ].outputs[0]
        for token, lp in out.logprobs[0].items():
            assert lp.logprob == pytest.approx(report_lp[n - 1, token].item(), abs=1e-5), (n, token)
