"""Adapters written by PEFT itself (`get_peft_model` + `save_pretrained`), not by the tests' own writer:
the engine's greedy output with the adapter is PEFT's model's own, token for token (fp32), and the PEFT
variants the engine does not run, saved by PEFT, are refused with the error naming their field."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_reference import hf_greedy, mixed_prompts
from helpers.lora_files import write_adapter

from tachyllm import LLM, SamplingParams
from tachyllm.lora.request import LoRARequest

peft = pytest.importorskip("peft")  # the test extra installs it

NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = mixed_prompts(300, lengths=(1, 6, 17))


@pytest.fixture(scope="module")
def base(tiny_model_factory):
    return tiny_model_factory()


@pytest.fixture(scope="module")
def lora_llm(base):
    return LLM(
        str(base), dtype="float32", block_size=4, kv_cache_memory=4 << 20, max_model_len=256,
        enable_lora=True, max_loras=2, max_lora_rank=8,
    )  # fmt: skip


def peft_model(base, **lora_config):
    """The base model wrapped by PEFT, A and B both random (`init_lora_weights=False`: PEFT's zero B would
    leave the output unchanged) and widened so that the adapter moves the greedy tokens."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, task_type="CAUSAL_LM", **lora_config)
    torch.manual_seed(7)
    wrapped = peft.get_peft_model(model, config).eval()
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    return wrapped


@pytest.mark.parametrize(
    "lora_config",
    [
        {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        {"r": 8, "lora_alpha": 4, "target_modules": "all-linear", "use_rslora": True},
        {"r": 2, "lora_alpha": 16, "target_modules": ["o_proj", "gate_proj", "up_proj", "down_proj", "k_proj"]},
    ],
    ids=["qv", "all-linear-rslora", "o-mlp-k"],
)
def test_engine_matches_peft_model(lora_config, base, lora_llm, tmp_path):
    model = peft_model(base, **lora_config)
    model.save_pretrained(tmp_path / "adapter")
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    with model.disable_adapter():
        base_expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    assert base_expected != expected  # the adapter changes the output, so the comparison means something

    lora = LoRARequest("peft", 1, str(tmp_path / "adapter"))
    # The adapter's rows and the base model's in one batch.
    outputs = lora_llm.generate(PROMPTS * 2, GREEDY, use_tqdm=False, lora_request=[lora] * 3 + [None] * 3)
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    got = [o.outputs[0].token_ids for o in outputs]
    assert got[:3] == expected
    assert got[3:] == base_expected


@pytest.mark.parametrize(
    ("lora_config", "message"),
    [
        ({"r": 4, "target_modules": ["q_proj"], "use_dora": True}, "use_dora=True"),
        ({"r": 4, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, "modules_to_save=['lm_head']"),
        ({"r": 4, "target_modules": ["q_proj", "embed_tokens"]}, "'embed_tokens', which is not supported"),
        ({"r": 16, "target_modules": ["q_proj"]}, "r=16 is above max_lora_rank=8"),
    ],
    ids=["dora", "modules_to_save", "embedding", "rank"],
)
def test_unsupported_peft_adapters_refused(lora_config, message, base, lora_llm, tmp_path):
    peft_model(base, **lora_config).save_pretrained(tmp_path / "adapter")
    bad = LoRARequest("bad", 2, str(tmp_path / "adapter"))
    outputs = lora_llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=[bad, None])
    assert outputs[0].error is not None and message in outputs[0].error, outputs[0].error
    assert outputs[1].error is None and len(outputs[1].outputs[0].token_ids) == NEW_TOKENS
    bm = lora_llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (["model.layers.0.self_attn.q_proj", "model.embed_tokens"], "(embedding and LM-head targets are not served)"),
        (["model.layers.0.mlp.fc1"], "'model.layers.0.mlp.fc1', which is not supported (supported: q_proj"),
    ],
    ids=["embedding path", "unknown path"],
)
def test_module_path_targets_checked_by_projection(targets, message, base, lora_llm, tmp_path):
    """Module paths (PEFT's saved form of "all-linear") are read by their last part: a path to the
    embedding or to a module that is not a projection is refused like the short name."""
    path = write_adapter(tmp_path / "adapter", base, ["q_proj"], config_overrides={"target_modules": targets})
    outputs = lora_llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("paths", 3, str(path)))
    assert outputs[0].error is not None and message in outputs[0].error, outputs[0].error
