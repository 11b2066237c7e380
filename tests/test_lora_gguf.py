"""llama.cpp's GGUF LoRA files (docs/lora.md): the same adapter as a PEFT directory and as a GGUF file
gives the same greedy tokens (and the merged model's), Q8_0 tensors are dequantized at load, and every
bad file is refused with one error naming the field or tensor."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from helpers.engine import tiny_llm, token_ids
from helpers.lora_files import ALL_TARGETS, merge_adapter, write_adapter, write_gguf_adapter

from tachyllm import SamplingParams
from tachyllm.errors import AdapterError
from tachyllm.lora.adapter_files import load_adapter
from tachyllm.lora.request import LoRARequest

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 120, 7, 33], [200, 11, 8, 64, 150]]


@pytest.fixture(scope="module")
def base(tiny_model_factory):
    return tiny_model_factory()


@pytest.fixture(scope="module")
def peft_dirs(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    return {
        "qk": write_adapter(root / "qk", base, ["q_proj", "k_proj"], rank=4, alpha=8, seed=21),
        "all": write_adapter(root / "all", base, ALL_TARGETS, rank=8, alpha=16, seed=22),
    }


@pytest.fixture(scope="module")
def lora_llm(base):
    return tiny_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=4)


def test_gguf_adapter_equals_peft_adapter_and_merged_weights(base, peft_dirs, lora_llm, tmp_path):
    """q/k B come back from llama.cpp's rotary row order: a wrong orientation or order changes tokens."""
    for index, (name, peft_dir) in enumerate(peft_dirs.items()):
        gguf_file = write_gguf_adapter(tmp_path / f"{name}.gguf", base, peft_dir)
        from_gguf = LoRARequest(f"{name}-gguf", 10 + index, str(gguf_file))
        from_peft = LoRARequest(name, 20 + index, str(peft_dir))
        got = token_ids(lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=from_gguf))
        assert got == token_ids(lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=from_peft))
        merged = tiny_llm(merge_adapter(base, peft_dir, tmp_path / f"merged-{name}"))
        assert got == token_ids(merged.generate(PROMPTS, GREEDY, use_tqdm=False))
        assert got != token_ids(lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False))  # the adapter matters
    bm = lora_llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_q8_0_tensors_dequantized_at_load(base, peft_dirs, lora_llm, tmp_path):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file

    path = write_gguf_adapter(tmp_path / "q8.gguf", base, peft_dirs["all"], quantize_a=True)
    adapter = load_adapter(str(path), lora_llm.engine.model_config, 8)
    a = load_file(peft_dirs["all"] / "adapter_model.safetensors")[
        "base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"
    ]
    q8 = GGMLQuantizationType.Q8_0
    expected = torch.from_numpy(dequantize(quantize(a.numpy(), q8), q8).astype(np.float32))
    assert torch.equal(adapter.weights[(1, "up_proj")][0], expected)
    assert not torch.equal(expected, a)  # really quantized, yet close
    torch.testing.assert_close(expected, a, atol=0.02, rtol=0)
    assert adapter.scale == 2.0
    outputs = lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("q8", 30, str(path)))
    assert all(o.error is None for o in outputs)


def extra(name: str, *shape: int) -> dict:
    return {"extra_tensors": {name: torch.zeros(*shape)}}


BAD_FILES = [
    ({"metadata": {"general.type": "model"}}, "general.type='model' is not supported"),
    ({"metadata": {"adapter.type": "control_vector"}}, "adapter.type='control_vector' is not supported"),
    ({"metadata": {"adapter.lora.alpha": None, "adapter.type": None}}, "adapter.type=None"),
    (extra("token_embd.weight.lora_a", 4, 64), "'token_embd.weight.lora_a' adapts the embedding"),
    (extra("output.weight.lora_b", 64, 4), "'output.weight.lora_b' adapts the embedding or LM head"),
    (extra("blk.0.attn_qkv.weight.lora_a", 4, 64), "'blk.0.attn_qkv.weight.lora_a' adapts no projection"),
    (extra("blk.5.attn_q.weight.lora_a", 4, 64), "is for layer 5; the base model has 2"),
    (extra("blk.0.attn_v.weight.lora_a", 4, 32), "'blk.0.attn_v.weight.lora_a' has shape (4, 32)"),
    (extra("blk.1.ffn_up.weight.lora_b", 128, 4), "layer 1's up_proj has no lora_A"),
    (extra("blk.0.ffn_up.weight.lora_a", 64), "'blk.0.ffn_up.weight.lora_a' has 1 dimensions"),
]


@pytest.mark.parametrize("case, message", BAD_FILES)
def test_bad_gguf_adapter_refused(case, message, base, peft_dirs, lora_llm, tmp_path):
    path = write_gguf_adapter(tmp_path / "bad.gguf", base, peft_dirs["qk"], **case)
    with pytest.raises(AdapterError, match="^LoRA adapter .*" + re.escape(message)):
        load_adapter(str(path), lora_llm.engine.model_config, 8)
    # Through generate: that request fails with the error, the other runs, no block is kept.
    bad, good = LoRARequest("bad", 40, str(path)), LoRARequest("good", 41, str(peft_dirs["qk"]))
    outs = lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[bad, good])
    assert message in outs[0].error and outs[1].error is None
    bm = lora_llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_gguf_rank_above_max_and_other_files_refused(base, peft_dirs, lora_llm, tmp_path):
    cfg = lora_llm.engine.model_config
    path = write_gguf_adapter(tmp_path / "r8.gguf", base, peft_dirs["all"])
    with pytest.raises(AdapterError, match=r"r=8 \(tensor 'blk.0.attn_q.weight.lora_a'\) is above max_lora_rank=4"):
        load_adapter(str(path), cfg, 4)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all")
    with pytest.raises(AdapterError, match="not a readable GGUF file"):
        load_adapter(str(garbage), cfg, 8)
    import gguf

    qwen = tmp_path / "qwen.gguf"
    writer = gguf.GGUFWriter(str(qwen), "qwen2")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(AdapterError, match=r"general.architecture='qwen2' does not fit the base model \(llama\)"):
        load_adapter(str(qwen), cfg, 8)
