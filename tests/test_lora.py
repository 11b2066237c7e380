"""LoRA adapters (docs/lora.md): PEFT files read and checked, applied unmerged in the continuous batch
(token for token the merged model's greedy output), many adapters and the base model in one step, the
prefix cache keyed by adapter, max_loras admission, and every bad adapter refused with a clear error."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.engine import assert_all_free, tiny_llm, token_ids
from helpers.lora_files import ALL_TARGETS, adapter_key, merge_adapter, write_adapter
from helpers.lora_kernels import seqs

from tachyllm import LLM, SamplingParams
from tachyllm.config import EngineConfig
from tachyllm.errors import AdapterError, ConfigError
from tachyllm.kernels import native
from tachyllm.lora.request import LoRARequest

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 120, 7, 33], [200, 11, 8, 64, 150], [9, 9, 300, 71, 4, 18, 250, 31, 77]]


def assert_all_blocks_free(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert_all_free(llm)


@pytest.fixture(scope="module")
def base(tiny_model_factory):
    return tiny_model_factory()


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """Three adapters of different target sets, ranks and scalings."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "qv": write_adapter(root / "qv", base, ["q_proj", "v_proj"], rank=4, alpha=8, seed=1),
        "all-rslora": write_adapter(root / "all", base, ALL_TARGETS, rank=8, alpha=4, use_rslora=True, seed=2),
        "mlp-o": write_adapter(root / "mlpo", base, ["o_proj", "gate_proj", "down_proj"], rank=2, alpha=16, seed=3),
    }


@pytest.fixture(scope="module")
def lora_llm(base):
    return tiny_llm(base, enable_lora=True, max_loras=3, max_lora_rank=8, max_cpu_loras=4)


def request(adapters, name: str) -> LoRARequest:
    return LoRARequest(name, list(adapters).index(name) + 1, str(adapters[name]))


@pytest.mark.parametrize("name", ["qv", "all-rslora", "mlp-o"])
def test_adapter_output_equals_merged_weights(name, base, adapters, lora_llm, tmp_path):
    merged = tiny_llm(merge_adapter(base, adapters[name], tmp_path / "merged"))
    expected = token_ids(merged.generate(PROMPTS, GREEDY, use_tqdm=False))
    got = token_ids(lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=request(adapters, name)))
    assert got == expected
    base_ids = token_ids(lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert base_ids != got  # the adapter changes the output, so the comparison means something
    assert_all_blocks_free(lora_llm)


def test_mixed_batch_equals_each_alone(adapters, lora_llm):
    """Three adapters and the base model in one continuous batch: each row as it is alone."""
    names = [None, "qv", "all-rslora", "mlp-o"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    loras = [None if n is None else request(adapters, n) for n in names]
    alone = [
        token_ids(lora_llm.generate([p], GREEDY, use_tqdm=False, lora_request=lora))[0]
        for p, lora in zip(prompts, loras)
    ]
    steps = record_step_slots(lora_llm)
    mixed = token_ids(lora_llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    assert mixed == alone
    assert max(len(slots - {0}) for slots in steps) == 3 and any(0 in slots for slots in steps if len(slots) == 4)
    assert_all_blocks_free(lora_llm)


def record_step_slots(llm: LLM) -> list[set[int]]:
    """The adapter slots of every step the runner executes from now on."""
    steps: list[set[int]] = []
    runner = llm.engine.runner
    execute = runner.execute

    def recording(batch):
        steps.append({s.lora_slot for s in batch.seqs})
        return execute(batch)

    runner.execute = recording
    return steps


def test_max_loras_limits_distinct_adapters_per_step(base, adapters):
    llm = tiny_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3)
    names = ["qv", "all-rslora", "mlp-o", "qv", None]
    loras = [None if n is None else request(adapters, n) for n in names]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    alone = [token_ids(llm.generate([p], GREEDY, use_tqdm=False, lora_request=r))[0] for p, r in zip(prompts, loras)]
    steps = record_step_slots(llm)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)) == alone
    assert max(len(slots - {0}) for slots in steps) == 2  # the third adapter waited for a slot in the step
    assert len({slot for slots in steps for slot in slots} - {0}) == 3
    assert_all_blocks_free(llm)


def test_prefix_cache_keyed_by_adapter(base, adapters, lora_llm):
    prompt = list(range(10, 30))  # five full blocks of 4
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eng = lora_llm.engine

    def run(lora: LoRARequest | None, request_id: str) -> tuple[int, list[int]]:
        """(prompt tokens served from the prefix cache, output tokens)."""
        req = eng.add_request(request_id, prompt, params, lora_request=lora)
        while eng.has_unfinished_requests():
            eng.step()
        return req.num_cached_tokens, req.seqs[0].output_token_ids

    qv, mlp = request(adapters, "qv"), request(adapters, "mlp-o")
    cached, qv_tokens = run(qv, "qv-1")
    assert cached == 0
    assert run(mlp, "mlp-1")[0] == 0  # same prompt, another adapter: no shared block
    cached, base_tokens = run(None, "base-1")
    assert cached == 0  # nor with the base model
    assert run(qv, "qv-2") == (16, qv_tokens)  # the same adapter shares as usual, with the same output
    assert run(None, "base-2") == (16, base_tokens)
    assert qv_tokens != base_tokens
    assert_all_blocks_free(lora_llm)


def test_reloaded_changed_adapter_does_not_reuse_blocks(base, tmp_path):
    """The cache key is the adapter's content: a changed adapter under the same name gets fresh blocks."""
    llm = tiny_llm(base, enable_lora=True, max_loras=1, max_cpu_loras=1)
    path = write_adapter(tmp_path / "a", base, ["q_proj"], seed=5)
    prompt, params = list(range(40, 60)), SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("a", 1, str(path)))
    # Another adapter evicts it (max_cpu_loras=1); the file changes before "a" is named again.
    other = write_adapter(tmp_path / "b", base, ["k_proj"], seed=6)
    llm.generate([[7, 8, 9]], params, use_tqdm=False, lora_request=LoRARequest("b", 2, str(other)))
    write_adapter(tmp_path / "a", base, ["q_proj"], seed=7)
    eng = llm.engine
    req = eng.add_request("again", prompt, params, lora_request=LoRARequest("a", 1, str(path)))
    while eng.has_unfinished_requests():
        eng.step()
    assert first[0].error is None and req.num_cached_tokens == 0
    assert_all_blocks_free(llm)


def test_lru_eviction_keeps_outputs(base, adapters):
    """max_cpu_loras=1: each adapter loads again after the other evicted it, with the same output."""
    llm = tiny_llm(base, enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=1)
    qv, rs = request(adapters, "qv"), request(adapters, "all-rslora")
    first = [token_ids(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=r)) for r in (qv, rs)]
    again = [token_ids(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=r)) for r in (qv, rs)]
    assert first == again and first[0] != first[1]
    assert [r.lora_name for r in llm.engine.lora.loaded] == ["all-rslora"]
    # Both at once: the first is in use, so the second is loaded beside it, beyond max_cpu_loras ...
    assert token_ids(llm.generate(PROMPTS[:1] * 2, GREEDY, use_tqdm=False, lora_request=[qv, rs])) == [
        first[0][0],
        first[1][0],
    ]
    assert len(llm.engine.lora.loaded) == 2
    # ... and the next load, with none in use, shrinks the cache back to max_cpu_loras.
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=request(adapters, "mlp-o"))
    assert [r.lora_name for r in llm.engine.lora.loaded] == ["mlp-o"]
    assert_all_blocks_free(llm)


def _rank_key(layer=0, proj="q_proj", half="A"):
    return adapter_key(layer, proj, half)


BAD_ADAPTERS = {
    "dora": ({"config_overrides": {"use_dora": True}}, "use_dora=True"),
    "modules_to_save": ({"config_overrides": {"modules_to_save": ["lm_head"]}}, "modules_to_save=['lm_head']"),
    "embedding target": (
        {"config_overrides": {"target_modules": ["q_proj", "embed_tokens"]}},
        "target_modules contains 'embed_tokens', which is not supported",
    ),
    "lm_head target": (
        {"config_overrides": {"target_modules": ["lm_head"]}},
        "target_modules contains 'lm_head', which is not supported",
    ),
    "unknown target": (
        {"config_overrides": {"target_modules": ["q_proj", "fc1"]}},
        "target_modules contains 'fc1', which is not supported",
    ),
    "embedding tensor": (
        {"tensor_overrides": {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}},
        "adapts the embedding or LM head",
    ),
    "untargeted tensor": (
        {"tensor_overrides": {_rank_key(proj="o_proj"): torch.zeros(4, 64)}},
        "adapts o_proj, which target_modules does not list",
    ),
    "target regex": ({"config_overrides": {"target_modules": ".*proj"}}, "'.*proj'"),
    "rank above max": ({"rank": 16}, "r=16 is above max_lora_rank=8"),
    "bias": ({"config_overrides": {"bias": "lora_only"}}, "bias='lora_only'"),
    "rank pattern": ({"config_overrides": {"rank_pattern": {"q_proj": 2}}}, "rank_pattern={'q_proj': 2}"),
    "not lora": ({"config_overrides": {"peft_type": "IA3"}}, "peft_type='IA3'"),
    "bad rank": ({"config_overrides": {"r": 0}}, "r=0"),
    "shape": (
        {"tensor_overrides": {_rank_key(): torch.zeros(4, 32)}},
        "has shape (4, 32); the base model's q_proj with r=4 needs (4, 64)",
    ),
    "missing B": ({"tensor_overrides": {_rank_key(half="B"): None}}, "layer 0's q_proj has no lora_B weight"),
    "dora magnitude": (
        {"tensor_overrides": {_rank_key().replace("lora_A.weight", "lora_magnitude_vector"): torch.ones(64)}},
        "DoRA magnitude",
    ),
    "layer out of range": (
        {"tensor_overrides": {_rank_key(layer=5): torch.zeros(4, 64)}},
        "is for layer 5; the base model has 2",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS))
def test_bad_adapter_fails_with_clear_error(case, base, adapters, lora_llm, tmp_path):
    kwargs, message = BAD_ADAPTERS[case]
    kwargs = {"targets": ["q_proj", "v_proj"], **kwargs}
    path = write_adapter(tmp_path / "bad", base, kwargs.pop("targets"), **kwargs)
    good = request(adapters, "qv")
    outputs = lora_llm.generate(
        PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=[LoRARequest(f"bad-{case}", 91, str(path)), good]
    )
    assert outputs[0].error is not None and message in outputs[0].error, outputs[0].error
    assert str(path) in outputs[0].error
    assert outputs[1].error is None and len(outputs[1].outputs[0].token_ids) == GREEDY.max_tokens
    assert f"bad-{case}" not in {r.lora_name for r in lora_llm.engine.lora.loaded}
    assert_all_blocks_free(lora_llm)


def test_bad_adapter_files(base, lora_llm, tmp_path):
    eng = lora_llm.engine
    with pytest.raises(AdapterError, match="has no adapter_config.json"):
        eng.add_request("x", [1, 2, 3], GREEDY, lora_request=LoRARequest("missing", 1, str(tmp_path / "nowhere")))
    path = write_adapter(tmp_path / "broken", base, ["q_proj"])
    (path / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="adapter_config.json is not valid JSON"):
        eng.add_request("x", [1, 2, 3], GREEDY, lora_request=LoRARequest("broken", 2, str(path)))
    path = write_adapter(tmp_path / "garbled", base, ["q_proj"])
    (path / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(AdapterError, match="adapter_model.safetensors cannot be read"):
        eng.add_request("x", [1, 2, 3], GREEDY, lora_request=LoRARequest("garbled", 3, str(path)))
    assert not eng.has_unfinished_requests()


def test_adapter_identity_is_the_whole_request(base, adapters, lora_llm):
    """A LoRARequest that differs in its path (or id) is another adapter, even under a known name."""
    qv = request(adapters, "qv")
    other = LoRARequest("qv", 1, str(adapters["mlp-o"]))
    alone = token_ids(lora_llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=request(adapters, "mlp-o")))
    outputs = lora_llm.generate(PROMPTS[:1] * 2, GREEDY, use_tqdm=False, lora_request=[qv, other])
    assert token_ids(outputs)[1] == alone[0] != token_ids(outputs)[0]


def test_lora_request_needs_enable_lora(base, adapters):
    llm = tiny_llm(base)
    [out] = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("qv", 1, str(adapters["qv"])))
    assert "enable_lora" in out.error
    with pytest.raises(ValueError, match="2 lora_request for 1 prompts"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=[None, None])


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_loras": 0}, "max_loras must be >= 1, got 0"),
        ({"max_lora_rank": 0}, "max_lora_rank must be >= 1, got 0"),
        ({"max_loras": 4, "max_cpu_loras": 2}, r"max_cpu_loras \(2\) must be >= max_loras \(4\)"),
    ],
)
def test_lora_options_checked(options, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**options)


def test_tensor_parallelism_refused_at_start(base):
    with pytest.raises(ConfigError, match="enable_lora does not run with tensor_parallel_size > 1"):
        tiny_llm(base, enable_lora=True, tensor_parallel_size=2)


def test_lora_request_fields_checked():
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "x")
    with pytest.raises(ValueError, match="lora_int_id must be >= 1, got 0"):
        LoRARequest("a", 0, "x")


def test_adapter_config_target_string_forms(base, lora_llm, tmp_path):
    """PEFT's 'all-linear' means the seven projections; a single name may be a string."""
    path = write_adapter(tmp_path / "all", base, ALL_TARGETS, config_overrides={"target_modules": "all-linear"})
    single = write_adapter(tmp_path / "one", base, ["q_proj"], config_overrides={"target_modules": "q_proj"})
    outs = lora_llm.generate(
        PROMPTS[:2], GREEDY, use_tqdm=False,
        lora_request=[LoRARequest("all-linear", 50, str(path)), LoRARequest("single", 51, str(single))],
    )  # fmt: skip
    assert [o.error for o in outs] == [None, None]
    assert json.loads((path / "adapter_config.json").read_text())["target_modules"] == "all-linear"


@pytest.mark.parametrize("weights", ["int8", "int4", "bf16", "gguf-q4_1"])
def test_adapter_over_any_base_linear(weights, base, adapters, tmp_path):
    """The wrapper adds the adapter on top of the base module's own output, which keeps its kernel
    (quantized blocks, a GGUF file's Q4_1 blocks, packed bf16): each wrapped linear's result is the
    base's plus scale · (x Aᵀ) Bᵀ on the adapter's rows only, and generation with the adapter runs."""
    options = {"enable_lora": True, "max_lora_rank": 8}
    if weights == "gguf-q4_1":
        from gguf import GGMLQuantizationType
        from helpers.gguf_files import write_tiny_q4_1_gguf  # the same shapes as the tiny HF model

        path = write_tiny_q4_1_gguf(tmp_path / "tiny.gguf", GGMLQuantizationType.Q4_1)
        llm = tiny_llm(path, quantization="gguf", **options)
    elif weights == "bf16":
        llm = tiny_llm(base, dtype="bfloat16", **options)
    else:
        llm = tiny_llm(base, quantization=weights, **options)
    name, prompts = "all-rslora", [[5, 17, 42, 99, 120, 7, 33], [20, 11, 8, 64, 150]]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[request(adapters, name), None])
    with_adapter, base_only = token_ids(outputs)
    assert with_adapter != token_ids(llm.generate(prompts[:1], GREEDY, use_tqdm=False))[0]
    assert base_only == token_ids(llm.generate(prompts[1:], GREEDY, use_tqdm=False))[0]
    manager = llm.engine.lora
    loaded = manager.loaded[request(adapters, name)]
    wrapper = llm.engine.model.layers[1].mlp.gate_up_proj
    if weights != "bf16":
        assert type(wrapper.base).__module__.startswith("tachyllm.quantization")
    dtype = torch.bfloat16 if weights == "bf16" else torch.float32
    x = torch.randn(5, 64).to(dtype)
    manager.segments.set_step(seqs([(0, 1), (loaded.slot, 1), (0, 1), (loaded.slot, 1), (0, 1)]))
    with torch.inference_mode():
        got, plain = wrapper(x), wrapper.base(x)
    manager.segments.set_step([])
    a_gate, b_gate = loaded.adapter.weights[(1, "gate_proj")]
    a_up, b_up = loaded.adapter.weights[(1, "up_proj")]
    xf = x.float()
    delta = torch.cat([xf @ a_gate.T @ b_gate.T, xf @ a_up.T @ b_up.T], dim=1) * loaded.adapter.scale
    if weights != "bf16":
        # Over quantized linears the adapter is stored int8 with a scale per rank (lora_dtype auto): the
        # stored codes give the result to fp32 rounding, within a percent of the fp32 adapter's.
        assert wrapper.weight_dtype == torch.int8
        stored = wrapper.slots[loaded.slot]
        shrunk = (xf @ stored.stacked_a.float().T) * stored.rank_scale
        stored_delta = torch.cat([shrunk[:, ranks] @ bt.float() for _, ranks, bt in stored.expands], dim=1)
        assert (stored_delta - delta).norm() <= 0.01 * delta.norm()
        delta = stored_delta
    expected = plain.float().clone()
    expected[[1, 3]] += delta[[1, 3]]
    tolerance = 2e-2 if weights == "bf16" else 1e-5
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)
    assert torch.equal(got[[0, 2, 4]], plain[[0, 2, 4]])  # base rows untouched
    assert_all_blocks_free(llm)


def test_ngram_speculation_verifies_with_the_adapter(base, adapters, lora_llm):
    """Drafts are verified by the model with the request's adapter: the greedy output is the same as
    without speculation, for adapter rows and base rows in one batch."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = tiny_llm(base, enable_lora=True, max_loras=3, max_lora_rank=8, speculative_config={**spec, "adaptive": False})
    repetitive = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10, 11, 9, 10], PROMPTS[0]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    loras = [request(adapters, "qv"), None, request(adapters, "all-rslora")]
    expected = token_ids(lora_llm.generate(repetitive, params, use_tqdm=False, lora_request=loras))
    assert token_ids(llm.generate(repetitive, params, use_tqdm=False, lora_request=loras)) == expected
    assert llm.engine.stats.spec_num_draft_tokens > 0
    assert_all_blocks_free(llm)


def test_preempted_adapter_rows_resume_identically(base, adapters, lora_llm):
    """A KV cache too small for every sequence at once: preempted adapter sequences recompute (their
    own prefix blocks only) and end with the tokens they have alone."""
    names = ["qv", "mlp-o", None, "all-rslora"]
    loras = [None if n is None else request(adapters, n) for n in names]
    prompts = [list(range(10 + i, 40 + i)) for i in range(len(names))]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    alone = [
        token_ids(lora_llm.generate([p], params, use_tqdm=False, lora_request=r))[0] for p, r in zip(prompts, loras)
    ]
    small = tiny_llm(base, enable_lora=True, max_loras=3, max_lora_rank=8, max_cpu_loras=3, kv_cache_memory=96 << 10)
    outputs = small.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert token_ids(outputs) == alone
    assert small.engine.stats.num_preemptions > 0
    assert_all_blocks_free(small)


def assert_fused_layers_match_modules(path, options: dict, prompts, loras, alone: int) -> None:
    """An engine on the fused decoder layers and one running its layers as modules give the same
    tokens and logprobs, bit for bit, for the whole batch and for row `alone` by itself (a single
    stream), and row `alone`'s adapter changes its tokens."""
    fused, modules = tiny_llm(path, **options), tiny_llm(path, **options)
    assert all(layer.fused is not None for layer in fused.engine.model.layers)
    for layer in modules.engine.model.layers:
        layer.fused = None
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    for batch in (slice(None), slice(alone, alone + 1)):
        got = fused.generate(prompts[batch], params, use_tqdm=False, lora_request=loras[batch])
        want = modules.generate(prompts[batch], params, use_tqdm=False, lora_request=loras[batch])
        assert token_ids(got) == token_ids(want)
        assert [o.outputs[0].logprobs for o in got] == [o.outputs[0].logprobs for o in want]
    assert token_ids(got) != token_ids(fused.generate(prompts[batch], GREEDY, use_tqdm=False))  # the adapter acts
    assert_all_blocks_free(fused)


@pytest.mark.parametrize("weights", ["bf16", "int4", "gguf-q4_1"])
def test_fused_decoder_layers_run_the_adapters(weights, base, adapters, tmp_path):
    """With the C++ kernels, the fused decoder layers stay on and apply the adapters with each of their
    linears (over quantized blocks inside the linear's own parallel region, each thread expanding the
    columns it computed): a batch of three adapters and base rows, and one adapter row alone (a
    single stream), give the tokens and logprobs of the same engine running its layers as modules
    (the same kernels, called one by one), bit for bit."""
    if native.native_ops() is None:
        pytest.skip("the C++ kernels did not build")
    options = {"dtype": "bfloat16", "enable_lora": True, "max_loras": 3, "max_lora_rank": 8, "backend": "cpu"}
    path = base
    if weights == "gguf-q4_1":
        from gguf import GGMLQuantizationType
        from helpers.gguf_files import write_tiny_q4_1_gguf

        path = write_tiny_q4_1_gguf(tmp_path / "tiny.gguf", GGMLQuantizationType.Q4_1)
        options["quantization"] = "gguf"
    elif weights == "int4":
        options["quantization"] = "int4"
    names = [None, "qv", "all-rslora", "mlp-o"]
    prompts = [[t % 250 for t in PROMPTS[i % len(PROMPTS)]] for i in range(len(names))]  # the GGUF's vocabulary
    loras = [None if n is None else request(adapters, n) for n in names]
    assert_fused_layers_match_modules(path, options, prompts, loras, alone=2)


def test_adapters_inside_a_quantized_linears_threads(tiny_model_factory, tmp_path):
    """Linears wide enough for the quantized kernel to split over two threads: the threads share the
    adapters' shrink and each expands the output columns it computed, at one row (a single stream)
    and at several, giving the module path's tokens and logprobs bit for bit."""
    if native.native_ops() is None:
        pytest.skip("the C++ kernels did not build")
    path = tiny_model_factory("llama", hidden_size=256, intermediate_size=1024)
    adapters = [
        LoRARequest(name, i + 1, str(write_adapter(tmp_path / name, path, targets, rank=8, seed=i)))
        for i, (name, targets) in enumerate([("all", ALL_TARGETS), ("qv", ["q_proj", "v_proj"])])
    ]
    options = {"dtype": "bfloat16", "enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "backend": "cpu"}
    options |= {"quantization": "int4", "threads": 2}
    prompts = [[t % 250 for t in p] for p in PROMPTS]
    assert_fused_layers_match_modules(path, options, prompts, [adapters[0], None, adapters[1]], alone=0)


def test_unknown_lora_dtype_refused_at_start(base):
    with pytest.raises(ConfigError, match="lora_dtype must be one of auto, int8, bfloat16, float32, got 'fp8'"):
        tiny_llm(base, enable_lora=True, lora_dtype="fp8")
