"""Tensor parallelism (docs/tensor_parallel.md): a model split over 2 CPU processes (1 thread each)
gives the same greedy tokens as one process in fp32, with the engine's features on; a dead worker
fails the requests cleanly, and a server whose worker died says so and exits; nothing outlives the
engine.

Each TP engine spawns a worker that imports torch (seconds on this machine): engines are shared by
module-scoped fixtures where the cases allow."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import httpx
import numpy as np
import psutil
import pytest
import torch
import uvicorn
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize
from helpers.gguf_files import (
    Q4_K_M_LIKE,
    add_byte_level_tokenizer,
    add_layer_tensors,
    add_llama_shape,
    finish,
    random_blocks,
    write_mixed_gguf,
)
from helpers.server import ENGINE_FLAGS, error_of, server_process, serving, sse_events

from tachyllm.config import EngineConfig
from tachyllm.distributed import executor as tp_executor
from tachyllm.distributed.executor import TensorParallelExecutor, rank_cpus
from tachyllm.distributed.sharding import ShardPlan
from tachyllm.distributed.worker import UNGUARDED_MAIN
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.engine_args import engine_config
from tachyllm.entrypoints.cli import build_parser
from tachyllm.entrypoints.llm import LLM
from tachyllm.errors import ConfigError, EngineCorruptedError, WorkerError
from tachyllm.kernels.native import native_ops
from tachyllm.loading import load_checkpoint
from tachyllm.loading.weights import select_part
from tachyllm.model_config import ModelConfig
from tachyllm.quantization.apply import rank_blocks
from tachyllm.quantization.gguf_packed import GGUFLinear, gguf_matrices
from tachyllm.quantization.int4 import Int4Linear
from tachyllm.quantization.int8 import Int8Linear
from tachyllm.sampling_params import SamplingParams
from tachyllm.server.app import build_app
from tachyllm.server.async_engine import AsyncEngine

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# The ranks' sums go through shared memory by default where the C++ kernels built (else gloo's).
SHM = native_ops() is not None


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = (1, 3, 7, 17, 40)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths] + [[7, 8, 9, 10] * 6]


def greedy(llm: LLM, batch: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def spawned() -> set[int]:
    """Pids of this process's live spawned interpreters (tensor-parallel workers; not multiprocessing's
    resource tracker, which lives as long as this process)."""
    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if "spawn_main" in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                found.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def worker_pids(llm_or_engine) -> set[int]:
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    return {w.process.pid for w in engine.executor.workers}


# The three families' layouts: KV heads split (2 over 2 ranks), replicated (1 KV head, tied
# embeddings, q/k/v bias), and split with per-head q/k norms.
MODELS = {
    "llama-kv2": ("llama", False, {}),
    "qwen2-kv1-tied": ("qwen2", True, {"num_key_value_heads": 1}),
    "qwen3-kv2": ("qwen3", False, {}),
}


@pytest.fixture(scope="module", params=list(MODELS))
def tiny_pair(request, tiny_model_factory):
    """(model path, TP=1 greedy tokens, TP=2 LLM) in fp32."""
    arch, tie, overrides = MODELS[request.param]
    path = tiny_model_factory(arch, tie, **overrides)
    single = LLM(str(path), dtype="float32", threads=1)
    batch = prompts(single.engine.model_config.vocab_size)
    expected = greedy(single, batch)
    tp = LLM(str(path), dtype="float32", tensor_parallel_size=2, threads=2)
    yield path, batch, expected, tp
    tp.engine.shutdown()


def test_tp2_greedy_identical_to_tp1_fp32(tiny_pair):
    path, batch, expected, tp = tiny_pair
    assert tp.engine.executor.size == 2
    assert (tp.engine.executor.group.shm is not None) == SHM
    assert greedy(tp, batch) == expected
    # Per request too (a batch of one), and again once the prompts are in the prefix cache.
    assert greedy(tp, batch[3:4]) == expected[3:4]
    hits = tp.engine.stats.prefix_cache_hits
    assert greedy(tp, batch) == expected
    assert tp.engine.stats.prefix_cache_hits > hits


def test_tp2_gloo_all_reduce_identical_to_tp1_fp32(tiny_model_factory):
    """--tp-all-reduce gloo: the sums over gloo, not shared memory; the same tokens."""
    path = tiny_model_factory("llama")
    single = LLM(str(path), dtype="float32", threads=1)
    batch = prompts(single.engine.model_config.vocab_size)
    tp = LLM(str(path), dtype="float32", tensor_parallel_size=2, threads=2, tp_all_reduce="gloo")
    try:
        assert tp.engine.executor.group.shm is None
        assert greedy(tp, batch) == greedy(single, batch)
    finally:
        tp.engine.shutdown()


def test_tp2_features_chunked_prefill_preemption_ngram_prefix_cache(tiny_model_factory):
    """Chunked prefill (8-token budget), preemption (a KV cache too small for the batch), n-gram
    speculation and prefix caching, all under TP=2: still TP=1's greedy tokens."""
    path = tiny_model_factory("llama")
    single = LLM(str(path), dtype="float32", threads=1)
    batch = prompts(single.engine.model_config.vocab_size)
    params = replace(GREEDY, max_tokens=24)
    expected = greedy(single, batch, params)
    tp = LLM(
        str(path), dtype="float32", tensor_parallel_size=2, threads=2, block_size=4, max_num_batched_tokens=8,
        kv_cache_memory=2 * 2 * 4 * 1 * 16 * 4 * 40,  # 40 blocks of 4 tokens at this rank's size (2 layers, 1 KV head)
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )  # fmt: skip
    pids = worker_pids(tp)
    try:
        assert greedy(tp, batch, params) == expected
        assert greedy(tp, batch, params) == expected  # again: prefix-cache hits
        stats = tp.engine.stats
        assert stats.num_preemptions > 0
        assert stats.spec_num_accepted_tokens > 0
        assert stats.prefix_cache_hits > 0
    finally:
        tp.engine.shutdown()
    assert not pids & spawned()


def test_tp2_draft_model_runs_unsharded_in_the_driver(tiny_model_factory):
    path = tiny_model_factory("llama")
    single = LLM(str(path), dtype="float32", threads=1)
    batch = prompts(single.engine.model_config.vocab_size)[:3]
    expected = greedy(single, batch)
    spec = {"method": "draft_model", "model": "self:int4", "num_speculative_tokens": 2}
    tp = LLM(str(path), dtype="float32", tensor_parallel_size=2, threads=2, speculative_config=spec)
    try:
        assert greedy(tp, batch) == expected
        assert tp.engine.stats.spec_num_draft_tokens > 0
    finally:
        tp.engine.shutdown()


def test_tp2_bf16_within_near_tie_tolerance(tiny_model_factory):
    """bf16: the all-reduce sums partial products in another order; a divergence is accepted only
    where TP=1's own top two logprobs were nearly tied."""
    path = tiny_model_factory("qwen3")
    single = LLM(str(path), dtype="bfloat16", threads=1)
    batch = prompts(single.engine.model_config.vocab_size)
    params = replace(GREEDY, logprobs=2)
    reference = single.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    tp = LLM(str(path), dtype="bfloat16", tensor_parallel_size=2, threads=2)
    try:
        ours = greedy(tp, batch, params)
    finally:
        tp.engine.shutdown()
    assert_within_near_ties(reference, ours)


def assert_within_near_ties(reference, ours: list[list[int]]) -> None:
    """Each sequence equals TP=1's (`reference`, with logprobs=2) up to a divergence where TP=1's own
    top two were nearly tied; at most half of them diverge."""
    diverged = 0
    for out, tokens in zip(reference, ours):
        ref = out.outputs[0]
        for i, (a, b) in enumerate(zip(ref.token_ids, tokens)):
            if a != b:
                top2 = sorted(ref.logprobs[i].values(), key=lambda lp: -lp.logprob)[:2]
                margin = top2[0].logprob - top2[1].logprob
                assert margin < 0.1, f"diverged at token {i} ({a} vs {b}) with a TP=1 top-2 margin of {margin:.3f}"
                diverged += 1
                break
    assert diverged <= len(reference) // 2


def test_killed_worker_fails_requests_and_shuts_down(tiny_model_factory):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory("llama")), dtype="float32", tensor_parallel_size=2))
    try:
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        for i in range(3):
            engine.add_request(str(i), [5, 6, 7, 8, 9, 10 + i], params)
        for _ in range(3):
            assert not any(out.finished for out in engine.step())
        worker = engine.executor.workers[0].process
        shm_path = engine.executor.shm_path
        assert (shm_path is not None) == SHM and not (shm_path and os.path.exists(shm_path))  # removed at start
        os.kill(worker.pid, signal.SIGKILL)
        outputs, t0 = [], time.monotonic()
        while engine.has_unfinished_requests():
            outputs += engine.step()
        # The shared-memory wait (or gloo) sees the peer gone: no collective timeout (120 s).
        assert time.monotonic() - t0 < 60
        assert sorted(o.request_id for o in outputs) == ["0", "1", "2"]
        for out in outputs:
            assert out.finished and out.outputs[0].finish_reason == "error"
            assert f"tensor-parallel rank 1 (pid {worker.pid}) died" in out.error
        with pytest.raises(EngineCorruptedError, match="the engine has shut down: tensor-parallel rank 1"):
            engine.add_request("late", [5, 6], params)
        assert not worker_pids(engine) & spawned()  # the group was stopped with the failed step
        assert engine.block_manager.usage == 0
    finally:
        engine.shutdown()


def killed(worker: psutil.Process) -> str:
    """Kills a worker; returns how the engine names its death."""
    worker.kill()
    return f"tensor-parallel rank 1 (pid {worker.pid}) died"


def test_server_with_a_dead_worker_is_unhealthy_and_refuses_requests(tiny_model_factory):
    """A worker that dies while no request runs: /health turns 503 with the reason without a request
    arriving, and every later request is a 503 engine_failed (a plain uvicorn server: no watchdog
    exits it meanwhile)."""
    path = str(tiny_model_factory("llama"))
    args = build_parser().parse_args(["serve", path, "--port", "0", "--tensor-parallel-size", "2", *ENGINE_FLAGS])
    before = spawned()
    app = build_app(AsyncEngine(lambda: LLMEngine(engine_config(args))), args)
    (worker,) = [psutil.Process(pid) for pid in spawned() - before]
    plain = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None))
    with serving(plain) as base, httpx.Client(base_url=base, timeout=30) as http:
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        assert http.get("/health").status_code == 200
        reason = killed(worker)
        deadline = time.monotonic() + 30
        while (health := http.get("/health")).status_code == 200:
            assert time.monotonic() < deadline, "/health did not notice the dead worker"
            time.sleep(0.05)
        assert reason in error_of(health, 503)["message"]
        refused = [
            http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}),
            http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True}),
            http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": True}),
            http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2}),
            http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}),
        ]
        for response in refused:
            error = error_of(response, 503)
            assert error["code"] == "engine_failed" and reason in error["message"]
        assert error_of(http.get("/health"), 503)["code"] == "engine_unhealthy"
    assert not worker.is_running() and not spawned() - before  # the other ranks were stopped too


@pytest.mark.slow
@pytest.mark.parametrize("when", ["mid-stream", "idle"])
def test_tachy_serve_exits_nonzero_once_a_worker_dies(tiny_model_factory, when):
    """`tachy serve --tensor-parallel-size 2` whose worker is SIGKILLed, in a stream or with nothing
    running: the stream ends with an engine_failed error event, and the server exits with status 1."""
    model = str(tiny_model_factory("llama", max_position_embeddings=32768))
    flags = ["--tensor-parallel-size", "2", "--dtype", "float32", "--kv-cache-memory", "64M"]
    events = []
    with server_process(model, *flags, "--log-stats-interval", "0") as (proc, base):
        (worker,) = [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        if when == "idle":
            reason = killed(worker)
        else:
            body = {"prompt": "The quick brown fox", "max_tokens": 30_000, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                stream = sse_events(r)
                events.append(next(stream))  # a token: the request runs
                reason = killed(worker)
                events += stream
        assert proc.wait(timeout=60) == 1
        log = proc.stderr.read()
    assert reason in log and "shutting down with exit status 1 so that a supervisor restarts the server" in log
    if when == "mid-stream":
        assert events[-1] == "[DONE]" and "choices" in events[0]
        error = events[-2]["error"]
        assert error["code"] == "engine_failed" and reason in error["message"]


def test_a_script_without_a_main_guard_is_told_to_add_one(tiny_model_factory, tmp_path):
    """Each worker imports the driver's main module again: a script that starts a TP engine at its
    top level would start one in every worker. The driver says in one line what to do."""
    script = tmp_path / "unguarded.py"
    path = tiny_model_factory("llama")
    script.write_text(
        "from tachyllm.entrypoints.llm import LLM\n"
        f"llm = LLM({str(path)!r}, dtype='float32', tensor_parallel_size=2)\n"
        "print('started', flush=True)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=os.environ, timeout=120)
    assert done.returncode == 1 and "started" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last == f"tachyllm.errors.WorkerError: tensor-parallel rank 1 failed to start: {UNGUARDED_MAIN}"
    assert 'under `if __name__ == "__main__":`' in last
    assert "bootstrapping phase" not in done.stderr  # multiprocessing's page of advice stays out of it


def test_no_orphans_after_shutdown_or_driver_death(tiny_model_factory, tmp_path):
    """shutdown() stops the workers; a driver killed with SIGKILL takes its workers along (their
    pipe to it closes)."""
    path = tiny_model_factory("llama")
    script = (
        "import sys, time\n"
        "from tachyllm.entrypoints.llm import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({str(path)!r}, dtype='float32', tensor_parallel_size=2)\n"
        "    print(llm.engine.executor.workers[0].process.pid, llm.engine.executor.shm_path, flush=True)\n"
        "    time.sleep(600)\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=os.environ)
    try:
        pid, shm_path = driver.stdout.readline().split()
        worker = psutil.Process(int(pid))
        driver.kill()
        driver.wait()
        worker.wait(timeout=10)  # psutil.TimeoutExpired: an orphan
        assert not os.path.exists(shm_path)  # removed once the group formed: never left behind
    finally:
        driver.kill()


def test_worker_start_failure_is_one_line(tiny_model_factory):
    """A rank that cannot start (here: its model path is gone) fails the engine's start in one line,
    and leaves no process behind."""
    path = tiny_model_factory("llama")
    ckpt = load_checkpoint(str(path))
    config = EngineConfig(model=str(path / "missing"), dtype="float32", tensor_parallel_size=2)
    from tachyllm.backends import create_backend

    before = spawned()
    with pytest.raises(WorkerError) as info:
        TensorParallelExecutor(config, ckpt, create_backend("auto", torch.device("cpu")), 64)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("tensor-parallel rank 1 failed to start: ModelLoadError: model path does not exist")
    assert spawned() <= before


def test_refused_before_any_process_starts(tiny_model_factory):
    before = spawned()
    path = str(tiny_model_factory("llama"))  # 4 heads, 2 KV heads, intermediate 128
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 does not divide the model's MLP intermediate size"):
        LLMEngine(EngineConfig(model=path, tensor_parallel_size=3))
    with pytest.raises(ConfigError, match="does not support quantization 'awq' .* accepted under TP: int4, int8, gguf"):
        LLMEngine(EngineConfig(model=path, tensor_parallel_size=2, quantization="awq"))
    with pytest.raises(ConfigError, match="does not support kv_cache_dtype 'int8'"):
        LLMEngine(EngineConfig(model=path, tensor_parallel_size=2, kv_cache_dtype="int8"))
    spec = {"method": "draft_model", "model": "self:layers=1", "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="self:layers=N"):
        LLMEngine(EngineConfig(model=path, tensor_parallel_size=2, speculative_config=spec))
    with pytest.raises(ConfigError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    assert spawned() <= before


# -- quantized layers: each rank holds exactly the whole model's groups / blocks for its slices -----
def quantized_layers(tp: LLM) -> list[torch.nn.Module]:
    """Rank 0's quantized linears (the row-parallel ones inside their collective wrappers)."""
    out = []
    for layer in tp.engine.model.layers:
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            out.append(getattr(m, "inner", m))
    return out


def test_tp2_int4_identical_to_tp1_fp32(tiny_model_factory):
    """int4 groups of 32 (the llama's o_proj inputs split at 32, down_proj's at 64): every rank
    quantizes its slices into the whole model's groups, and greedy tokens are TP=1's in fp32."""
    path = str(tiny_model_factory("llama"))
    quant = dict(dtype="float32", threads=1, quantization="int4", quant_group_size=32)
    single = LLM(path, **quant)
    batch = prompts(single.engine.model_config.vocab_size)
    expected = greedy(single, batch)
    tp = LLM(path, tensor_parallel_size=2, **{**quant, "threads": 2})
    try:
        assert all(isinstance(m, Int4Linear) and m.group_size == 32 for m in quantized_layers(tp))
        assert greedy(tp, batch) == expected
    finally:
        tp.engine.shutdown()


def test_tp2_int8_whole_row_scales_tp1_tokens_within_near_ties(tiny_model_factory):
    """int8's per-channel scales: rank 0's row-parallel o/down parts carry the whole rows' scales (their
    maxima over the ranks), so its codes and scales are exactly TP=1's columns. Tokens: within the
    near-tie tolerance, not equal, even in fp32: the CPU int8 kernel (aten's, up to 16 rows) takes
    and returns bf16, so each rank's partial sum is rounded to bf16 before the all-reduce adds them."""
    path = str(tiny_model_factory("llama"))
    quant = dict(dtype="float32", threads=1, quantization="int8")
    single = LLM(path, **quant)
    batch = prompts(single.engine.model_config.vocab_size)
    params = replace(GREEDY, logprobs=2)
    reference = single.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    tp = LLM(path, tensor_parallel_size=2, **{**quant, "threads": 2})
    try:
        for whole, part in zip(quantized_layers(single), quantized_layers(tp)):
            assert isinstance(part, Int8Linear)
            if part.out_features == whole.out_features:  # o, down: all rows, the first half of the columns
                assert torch.equal(part.scales, whole.scales)
                assert torch.equal(part.codes, whole.codes[:, : part.in_features])
        assert_within_near_ties(reference, greedy(tp, batch, params))
    finally:
        tp.engine.shutdown()


def test_int4_default_group_cutting_a_split_is_refused(tiny_model_factory):
    """Unset, the group is TP=1's choice for the whole layer (64 for the 64-wide o_proj), which a
    split at 32 would cut: refused by name (the worker started is stopped)."""
    before = spawned()
    path = str(tiny_model_factory("llama"))
    expected = (
        r"tensor_parallel_size=2 would split model.layers.0.self_attn.o_proj.weight \(int4 groups of 64 inputs\) "
        r"at input columns 0:32 of 64, cutting a group; accepted: .* multiples of 64, or a smaller quant_group_size"
    )
    with pytest.raises(ConfigError, match=expected):
        LLMEngine(EngineConfig(model=path, dtype="float32", threads=2, tensor_parallel_size=2, quantization="int4"))
    assert spawned() <= before


# Every block type the kernels take, as test_kquants' Q4_K_M-like model has them, but o_proj (256
# inputs, 128 per rank) in 32-wide blocks: K-quants' 256 would be cut there; down_proj's 512 inputs
# split at 256 keep them. The Q6_K head is split by vocabulary (258 -> 2 x 129, one zero row padded).
Q_SPLITTABLE = [
    {**Q4_K_M_LIKE[0], "attn_output": GGMLQuantizationType.Q8_0},
    {**Q4_K_M_LIKE[1], "attn_output": GGMLQuantizationType.Q4_0},
]
K_QUANTS = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)


def test_gguf_rank_blocks_are_the_whole_files_blocks(tmp_path):
    """Each rank's blocks of every matrix (q/k rows in the model's order, o/down columns on block
    boundaries, the vocabulary shard padded with zero blocks) dequantize to exactly its slice of the
    whole matrix; a K-quant o_proj of 256 inputs split at 128 is refused by name."""
    path = str(write_mixed_gguf(tmp_path / "q4_k_m.gguf", Q4_K_M_LIKE, head=GGMLQuantizationType.Q6_K))
    full = load_checkpoint(path).config
    matrices = gguf_matrices(path, full)
    checked = 0
    for rank in (0, 1):
        plan = ShardPlan(full, rank, 2)
        for name, blocks in matrices.items():
            whole = torch.from_numpy(dequantize(blocks.rows().numpy(), blocks.qtype))
            want = whole[plan.index(name, tuple(whole.shape)) or (slice(None),)]
            if "o_proj" in name and blocks.qtype in K_QUANTS:
                with pytest.raises(ConfigError, match=rf"split {name} \({blocks.qtype.name} blocks of 256 inputs\)"):
                    rank_blocks(blocks, plan)
                continue
            part = rank_blocks(blocks, plan)
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                want = plan.pad(want)
            assert part.in_features == want.shape[1]
            assert torch.equal(torch.from_numpy(dequantize(part.raw, part.qtype)), want), name
            checked += 1
    assert checked == 2 * (len(matrices) - 2)


def test_tp2_gguf_identical_to_tp1_fp32(tmp_path):
    """gguf at TP=2: every rank cuts its layers from the file's blocks (GGUFLinear on the block
    kernels, AVX-512 VNNI or AVX2; without them Q4_0/Q4_1 on aten's int4 kernel and the other types
    dequantized): greedy tokens are TP=1's in fp32."""
    path = str(write_mixed_gguf(tmp_path / "split.gguf", Q_SPLITTABLE, head=GGMLQuantizationType.Q6_K))
    quant = dict(dtype="float32", threads=1, quantization="gguf", max_model_len=128)
    single = LLM(path, **quant, quant_activation_bits=16)
    batch = prompts(single.engine.model_config.vocab_size)
    expected = greedy(single, batch)
    tp = LLM(path, tensor_parallel_size=2, **{**quant, "threads": 2})
    try:
        layers = quantized_layers(tp)
        if tp.engine.backend.block_kernels() is not None:
            assert all(isinstance(m, GGUFLinear) for m in layers)
            assert [m.block_types for m in layers[:4]] == ["Q4_K+Q4_K+Q6_K", "Q8_0", "Q4_K+Q4_K", "Q6_K"]
            assert (layers[1].in_features, layers[3].in_features) == (128, 256)
            assert tp.engine.model.lm_head.inner.out_features == 129
            # Ranks keep 16 bits unless told (no load-time check): so does this TP=1 reference.
            assert {m.activation_bits for m in layers} == {16}
        else:  # layer 1's Q4_0 o_proj and Q4_0+Q4_1 gate_up
            assert [type(m) for m in layers[5:7]] == [Int4Linear, Int4Linear]
            assert (layers[5].in_features, layers[6].out_features) == (128, 512)
        assert greedy(tp, batch) == expected
    finally:
        tp.engine.shutdown()


def test_tp2_gguf_ranks_do_not_load_their_packed_layers_dense(tmp_path, monkeypatch):
    """As at TP=1, a rank leaves the tensors of its layers on the file's blocks out of its weight
    stream (rank 0 builds in this process, so what it dequantizes is seen here)."""
    import tachyllm.loading.gguf as gguf_loading

    monkeypatch.setenv("TACHY_CACHE_DIR", "off")
    path = str(write_mixed_gguf(tmp_path / "split.gguf", Q_SPLITTABLE, head=GGMLQuantizationType.Q6_K))
    dequantized = []
    to_torch = gguf_loading._to_torch
    monkeypatch.setattr(gguf_loading, "_to_torch", lambda t, name, c: dequantized.append(name) or to_torch(t, name, c))
    tp = LLM(path, tensor_parallel_size=2, dtype="float32", threads=2, quantization="gguf", max_model_len=128)
    try:
        if tp.engine.backend.block_kernels() is None:
            pytest.skip("without the block kernels only Q4_0/Q4_1 run packed")
        assert all(isinstance(m, GGUFLinear) for m in quantized_layers(tp))
        assert not [n for n in dequantized if n.endswith("_proj.weight") or n == "lm_head.weight"]
        assert "model.embed_tokens.weight" in dequantized
    finally:
        tp.engine.shutdown()


def test_gguf_split_cutting_a_block_is_refused(tmp_path):
    """Q4_0 down_proj of 96 inputs (48 per rank) cannot be split in 32-wide blocks: one error
    naming the tensor, the block and the split, on any machine (aten's kernel takes Q4_0 too)."""
    before = spawned()
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(tmp_path / "ffn96.gguf"), "llama")
    add_llama_shape(writer, layers=1, hidden=64, ffn=96, heads=4, kv_heads=2, context=64)
    writer.add_layer_norm_rms_eps(1e-5)
    vocab = add_byte_level_tokenizer(writer)

    def add(name: str, *shape: int, quantize: bool = True) -> None:
        if quantize:
            blocks = random_blocks(GGMLQuantizationType.Q4_0, *shape, rng)
            writer.add_tensor(name, blocks, raw_dtype=GGMLQuantizationType.Q4_0)
        else:
            writer.add_tensor(name, np.ones(shape, dtype=np.float32))

    add("token_embd.weight", vocab, 64)
    add("output_norm.weight", 64, quantize=False)
    add_layer_tensors(add, 0, 64, 4, 2, 16, 96)
    finish(writer)
    expected = (
        r"tensor_parallel_size=2 would split model.layers.0.mlp.down_proj.weight \(Q4_0 blocks of 32 inputs\) "
        r"at input columns 0:48 of 96, cutting a group"
    )
    with pytest.raises(ConfigError, match=expected):
        LLMEngine(
            EngineConfig(
                model=str(tmp_path / "ffn96.gguf"), dtype="float32", threads=2, tensor_parallel_size=2,
                quantization="gguf", quant_skip="none",
            )
        )  # fmt: skip
    assert spawned() <= before


def test_safetensors_rank_reads_only_its_slices(tiny_model_factory, monkeypatch):
    """A rank's weights come from safetensors slices (get_slice), equal to the slices of the whole tensors."""
    from safetensors import safe_open

    ckpt = load_checkpoint(str(tiny_model_factory("qwen2", True, num_key_value_heads=1)))
    whole = dict(ckpt.weights())
    plan = ShardPlan(ckpt.config, 1, 2)
    handle_type = type(safe_open(str(next(tiny_model_factory("llama").glob("*.safetensors"))), framework="pt"))
    sliced = []
    real_get_slice = handle_type.get_slice
    monkeypatch.setattr(handle_type, "get_slice", lambda self, name: sliced.append(name) or real_get_slice(self, name))
    parts = dict(plan.weights(ckpt.weights))
    assert set(parts) == set(whole) and set(sliced) == set(whole)
    for name, tensor in whole.items():
        index = plan.index(name, tuple(tensor.shape))
        expected = tensor if index is None else tensor[index]
        if name.endswith("embed_tokens.weight"):
            expected = plan.pad(expected)
        assert torch.equal(parts[name], expected), name
    assert parts["model.embed_tokens.weight"].shape[0] == plan.vocab_per_rank
    assert parts["model.layers.0.self_attn.k_proj.weight"].shape[0] == ckpt.config.head_dim  # the replicated KV head


def _config(heads: int, kv: int, vocab: int = 10) -> ModelConfig:
    return ModelConfig("llama", vocab, hidden_size=8, intermediate_size=12, num_layers=1, num_heads=heads,
                       num_kv_heads=kv, head_dim=2)  # fmt: skip


# Even splits, replicated KV heads (1 over 2 and 4 ranks), and 3 KV groups over 2 ranks (2 + 1, as SmolLM2's).
@pytest.mark.parametrize(("heads", "kv", "size"), [(4, 2, 2), (4, 1, 2), (4, 1, 4), (4, 2, 4), (6, 3, 3), (6, 3, 2)])
def test_shards_put_together_give_the_whole_tensor(heads, kv, size):
    cfg = _config(heads, kv)
    d, hidden, inter = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    full = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(heads * d, hidden),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(kv * d, hidden),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(hidden, heads * d),
        "model.layers.0.mlp.up_proj.weight": torch.randn(inter, hidden),
        "model.layers.0.mlp.down_proj.weight": torch.randn(hidden, inter),
        "model.embed_tokens.weight": torch.randn(cfg.vocab_size, hidden),
        "model.norm.weight": torch.randn(hidden),
    }
    plans = [ShardPlan(cfg, r, size) for r in range(size)]

    def source(select=None, leave_out=frozenset()):
        return ((name, select_part(select, name, t)) for name, t in full.items())

    parts = [dict(p.weights(source)) for p in plans]
    shards = {name: [part[name] for part in parts] for name in full}
    cat = lambda name, dim: torch.cat(shards[name], dim)  # noqa: E731
    assert torch.equal(cat("model.layers.0.self_attn.q_proj.weight", 0), full["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(cat("model.layers.0.self_attn.o_proj.weight", 1), full["model.layers.0.self_attn.o_proj.weight"])
    assert torch.equal(cat("model.layers.0.mlp.up_proj.weight", 0), full["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(cat("model.layers.0.mlp.down_proj.weight", 1), full["model.layers.0.mlp.down_proj.weight"])
    vocab = cat("model.embed_tokens.weight", 0)
    assert vocab.shape[0] == -(-cfg.vocab_size // size) * size  # padded to a multiple of the ranks
    assert torch.equal(vocab[: cfg.vocab_size], full["model.embed_tokens.weight"])
    assert not vocab[cfg.vocab_size :].any()
    assert all(torch.equal(s, full["model.norm.weight"]) for s in shards["model.norm.weight"])
    # Each rank's KV heads are those its query heads read (GQA group = heads / kv).
    k = full["model.layers.0.self_attn.k_proj.weight"].view(kv, d, hidden)
    for plan, shard in zip(plans, shards["model.layers.0.self_attn.k_proj.weight"]):
        wanted = sorted({h * kv // heads for h in range(plan.first_head, plan.first_head + plan.heads)})
        assert torch.equal(shard.view(-1, d, hidden), k[wanted])
        # The rank's own GQA layout: its query heads in order, each group reading its KV head.
        local = plan.config
        assert local.num_kv_heads == len(wanted) and local.num_heads == plan.heads
        assert local.num_heads % local.num_kv_heads == 0


@pytest.mark.parametrize(("heads", "kv", "size", "what"), [
    (4, 2, 3, "does not split the model's 4 attention heads over 2 KV heads"),
    (2, 1, 4, "does not split the model's 2 attention heads over 1 KV heads"),
    (8, 8, 8, "does not divide the model's MLP intermediate size"),
])  # fmt: skip
def test_shard_plan_refuses_splits_that_do_not_fit(heads, kv, size, what):
    with pytest.raises(ConfigError, match=what):
        ShardPlan(_config(heads, kv), 0, size)


def test_cpu_binding_one_numa_node_per_rank_else_equal_shares(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(tp_executor, "NUMA_ROOT", tmp_path)
    for node, cpus in (("node0", "0-3\n"), ("node1", "4-5,7\n")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus)
    assert rank_cpus(2) == [[0, 1, 2, 3], [4, 5, 7]]
    assert rank_cpus(4) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # not one node per rank: equal shares
    with pytest.raises(ConfigError, match="9 ranks"):
        rank_cpus(9)


@pytest.mark.slow
def test_default_model_tp2_greedy_identical_fp32():
    """SmolLM2-135M: 9 query heads over 3 KV heads, split 6 + 3 over the two ranks."""
    single = LLM(dtype="float32", threads=1, kv_cache_memory=64 << 20)
    tok = single.get_tokenizer()
    questions = ["What is the capital of France?", "Write a Python function that reverses a string."]
    batch = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
             for q in questions]  # fmt: skip
    params = replace(GREEDY, max_tokens=24)
    expected = greedy(single, batch, params)
    del single
    tp = LLM(dtype="float32", tensor_parallel_size=2, threads=2, kv_cache_memory=64 << 20)
    try:
        assert greedy(tp, batch, params) == expected
    finally:
        tp.engine.shutdown()
