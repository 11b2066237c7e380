"""Speculative decoding with a separate draft model file: a shallower model sharing the
target's tokenizer, as Hugging Face directories and as GGUF files, offline and served; a draft
with another vocabulary is refused with one error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import openai
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from helpers.engine import GREEDY, random_prompts, run, tiny_llm, token_ids
from helpers.gguf_files import add_layer_tensors, add_llama_shape, finish
from helpers.models import build_tokenizer, first_layers, make_tiny_model
from helpers.quantization import BLOCK_KERNELS
from helpers.server import running_server

from tachyllm import SamplingParams
from tachyllm.errors import ConfigError
from tachyllm.quantization import activation_bits
from tachyllm.speculative_config import SpeculativeConfig

# hidden 128: int4 groups divide every layer of a quantized draft
SHAPE = {"hidden_size": 128, "intermediate_size": 256}


def draft_spec(path: Path, k: int = 3, **extra) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k, "adaptive": False, **extra}


@pytest.fixture(scope="module")
def pair(tiny_model_factory, tmp_path_factory) -> tuple[Path, Path]:
    """(target, draft): tiny Qwen2 directories, 3 and 1 layers, the same tokenizer."""
    target = tiny_model_factory("qwen2", num_hidden_layers=3, **SHAPE)
    return target, first_layers(target, tmp_path_factory.mktemp("draft") / "qwen2-1l", 1)


def assert_speculated(llm, partly: bool = True) -> None:
    stats = llm.engine.stats
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0
    if partly:
        assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


@pytest.mark.parametrize("quantization", [None, "int4", "none"])
def test_greedy_output_is_identical_with_a_draft_file(pair, quantization):
    target, draft = pair
    prompts = random_prompts(2, 6, shared=0, tail=(3, 12))
    params = SamplingParams(max_tokens=24, **GREEDY)
    expected = token_ids(run(tiny_llm(target), prompts, params))
    extra = {} if quantization is None else {"quantization": quantization}
    llm = tiny_llm(target, speculative_config=draft_spec(draft, **extra))
    assert token_ids(run(llm, prompts, params)) == expected
    assert_speculated(llm)
    assert llm.engine.speculator.proposer.runner.model.config.num_layers == 1


def record_proposals(llm, monkeypatch) -> list[int]:
    """Every token the engine's draft model proposes from now on."""
    proposer, proposed = llm.engine.speculator.proposer, []
    real = proposer.propose

    def recording(seqs, ks):
        drafts = real(seqs, ks)
        proposed.extend(t for d in drafts for t in d.token_ids)
        return drafts

    monkeypatch.setattr(proposer, "propose", recording)
    return proposed


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_a_draft_head_over_a_vocabulary_shortlist(pair, quantization, monkeypatch):
    """draft_vocab_size: the draft's LM head computes the lowest ids and the special tokens only, so
    it proposes nothing else, and the output stays the target's alone."""
    target, draft = pair
    prompts = random_prompts(3, 6, shared=0, tail=(3, 12))
    params = SamplingParams(max_tokens=24, **GREEDY)
    expected = token_ids(run(tiny_llm(target), prompts, params))
    extra = {"draft_vocab_size": 200} | ({} if quantization is None else {"quantization": quantization})
    llm = tiny_llm(target, speculative_config=draft_spec(draft, **extra))
    model = llm.engine.speculator.proposer.runner.model
    shortlist = set(range(200)) | set(llm.get_tokenizer().special_ids) | set(llm.engine.eos_token_ids)
    assert set(model.head_token_ids.tolist()) == shortlist
    assert model.compute_logits(torch.zeros(1, SHAPE["hidden_size"])).shape == (1, len(shortlist))
    proposed = record_proposals(llm, monkeypatch)
    assert token_ids(run(llm, prompts, params)) == expected
    assert proposed and set(proposed) <= shortlist
    assert_speculated(llm)
    # The head's column c is token head_token_ids[c]: a draft whose logits peak at its last column
    # proposes the last id of the list, and nothing else.
    runner, kept = llm.engine.speculator.proposer.runner, model.head_token_ids.tolist()
    peak = torch.zeros(len(kept))
    peak[-1] = 1.0
    monkeypatch.setattr(runner, "last_token_logits", lambda batch: peak.repeat(len(batch.seqs), 1))
    proposed.clear()
    assert token_ids(run(llm, prompts[:1], params)) == expected[:1]
    assert proposed and set(proposed) == {kept[-1]}
    # A shortlist as large as the vocabulary is the whole head.
    whole = tiny_llm(target, speculative_config=draft_spec(draft, draft_vocab_size=10_000))
    assert whole.engine.speculator.proposer.runner.model.head_token_ids is None


def test_the_draft_follows_the_targets_quantization(pair, caplog):
    """Unset, the draft takes the target's --quantization (its LM head included); 'none' keeps it
    unquantized; 'gguf' needs a GGUF draft."""
    target, draft = pair
    prompts = random_prompts(3, 3, shared=0, tail=(3, 8))
    params = SamplingParams(max_tokens=16, **GREEDY)
    expected = token_ids(run(tiny_llm(target, quantization="int8"), prompts, params))
    with caplog.at_level("INFO", logger="tachyllm"):
        llm = tiny_llm(target, quantization="int8", speculative_config=draft_spec(draft))
    assert f"draft model {draft}: qwen2, 1 layers, quantization int8" in caplog.text
    assert token_ids(run(llm, prompts, params)) == expected
    assert_speculated(llm, partly=False)
    with pytest.raises(ConfigError, match="'gguf' needs a GGUF draft file"):
        tiny_llm(target, speculative_config=draft_spec(draft, quantization="gguf"))
    for bad, message in [("int3", "quantization must be one of none, int8"), ("int4", "applies to a draft model file")]:
        spec = draft_spec(Path("self:int4"), quantization=bad) if bad == "int4" else draft_spec(draft, quantization=bad)
        with pytest.raises(ConfigError, match=message):
            SpeculativeConfig.from_dict(spec)


def test_a_draft_with_another_vocabulary_size_is_refused(pair, tmp_path):
    target, _ = pair
    other = make_tiny_model(tmp_path / "other", "qwen2", num_hidden_layers=1, **SHAPE)
    build_tokenizer(other, vocab_size=300)  # same training text, fewer merges: ids agree, sizes differ
    with pytest.raises(ConfigError, match=r"does not share the target's vocabulary \(draft 300 tokens, target 400"):
        tiny_llm(target, speculative_config=draft_spec(other))
    # The CLI says it in one line and exits with status 2, before serving anything.
    spec = json.dumps(draft_spec(other))
    done = subprocess.run(
        [sys.executable, "-m", "tachyllm.entrypoints.cli", "serve", "--model", str(target), "--port", "0",
         "--dtype", "float32", "--speculative-config", spec],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("tachy: error:")]
    assert len(errors) == 1 and "does not share the target's vocabulary (draft 300 tokens" in errors[0]
    assert "Traceback" not in done.stderr


def test_served_with_a_draft_file(pair):
    """tachy serve --speculative-config with a draft file, through the official openai client:
    greedy completions and chat equal those of a server without speculation."""
    target, draft = pair
    spec = json.dumps(draft_spec(draft))

    def answers(*flags: str) -> tuple[list[str], str]:
        with running_server(str(target), *flags) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            texts = []
            for prompt in ["def add(a, b):", "The quick brown fox"]:
                done = client.completions.create(model=str(target), prompt=prompt, max_tokens=16, temperature=0)
                texts.append(done.choices[0].text)
            chat = client.chat.completions.create(
                model=str(target), messages=[{"role": "user", "content": "numbers 42"}], max_tokens=12, temperature=0
            )
            return texts, chat.choices[0].message.content

    plain = answers()
    spec_texts, spec_chat = answers("--speculative-config", spec)
    assert (spec_texts, spec_chat) == plain
    assert any(plain[0])


# -- GGUF drafts ---------------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, FFN = 64, 4, 2, 128


def write_gguf(path: Path, layers: int) -> Path:
    """A qwen2 GGUF with Q4_0 layers; files of different depth share their first tensors (same seed,
    same order) and the vocabulary."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    stand_ins = {b: chr(b) for b in keep} | {
        b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in keep)
    }
    tokens = [stand_ins[b] for b in range(256)] + ["he", "<|im_end|>"]
    rng = np.random.default_rng(7)
    writer = GGUFWriter(path, "qwen2")
    add_llama_shape(writer, layers=layers, hidden=HIDDEN, ffn=FFN, heads=HEADS, kv_heads=KV_HEADS, context=128)
    for add, value in [
        (writer.add_rope_freq_base, 10000.0), (writer.add_layer_norm_rms_eps, 1e-6),
        (writer.add_tokenizer_model, "gpt2"), (writer.add_tokenizer_pre, "qwen2"), (writer.add_token_list, tokens),
        (writer.add_token_types, [1] * (len(tokens) - 1) + [3]),
        (writer.add_token_merges, ["h e"]), (writer.add_eos_token_id, len(tokens) - 1),
    ]:  # fmt: skip
        add(value)

    def tensor(name: str, *shape: int, quantize: bool = True) -> None:
        data = (rng.standard_normal(shape) * 0.3).astype(np.float32)
        if quantize:
            writer.add_tensor(name, gguf.quants.quantize(data, GGMLQuantizationType.Q4_0), raw_dtype=2)
        else:
            writer.add_tensor(name, np.abs(data) + 0.5 if name.endswith("norm.weight") else data)

    tensor("token_embd.weight", len(tokens), HIDDEN, quantize=False)
    tensor("output_norm.weight", HIDDEN, quantize=False)
    tensor("output.weight", len(tokens), HIDDEN)
    for i in range(layers):
        add_layer_tensors(tensor, i, HIDDEN, HEADS, KV_HEADS, HIDDEN // HEADS, FFN)
        for part, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
            tensor(f"blk.{i}.attn_{part}.bias", rows * HIDDEN // HEADS, quantize=False)
    finish(writer)
    return path


def test_gguf_draft_file_under_gguf_quantization(tmp_path, caplog):
    """Both files GGUF, the target under --quantization gguf: the draft runs its own packed blocks
    too, and the greedy output is the target's alone."""
    target, draft = write_gguf(tmp_path / "target.gguf", 3), write_gguf(tmp_path / "draft.gguf", 1)
    prompts = [[40, 50, 60, 70], [256, 104, 101, 32, 33], [120, 121]]
    params = SamplingParams(max_tokens=20, **GREEDY)
    options = {"quantization": "gguf", "max_model_len": 128}
    expected = token_ids(run(tiny_llm(target, **options), prompts, params))
    with caplog.at_level("INFO", logger="tachyllm"):
        llm = tiny_llm(target, **options, speculative_config=draft_spec(draft))
    assert "1 layers, quantization gguf" in caplog.text
    assert token_ids(run(llm, prompts, params)) == expected
    assert_speculated(llm)


@pytest.mark.native
@pytest.mark.skipif(BLOCK_KERNELS is None, reason="activation bits are a mode of the C++ block kernels")
def test_draft_activation_bits_follow_the_option(tmp_path):
    """--quant-activation-bits reaches the draft as well as the packed target: an int4 draft file, and a
    self:int4 draft (the GGUF file's own blocks), whose bits were fixed at 16 before."""
    target, draft = write_gguf(tmp_path / "target.gguf", 3), write_gguf(tmp_path / "draft.gguf", 1)

    def bits(model: torch.nn.Module) -> set[int]:
        return {m.activation_bits for m in model.modules() if hasattr(m, "activation_bits")}

    for given in (8, 16):
        for spec in (draft_spec(draft, quantization="int4"), draft_spec("self:int4")):
            llm = tiny_llm(
                target, quantization="gguf", quant_activation_bits=given, max_model_len=128, speculative_config=spec
            )
            assert bits(llm.engine.model) == bits(llm.engine.speculator.proposer.runner.model) == {given}


def test_an_unset_activation_rounding_leaves_drafts_at_16_bits_unchecked(tmp_path, monkeypatch):
    """Unset, the gguf target checks 8 bits at load (here made to pass), and its drafts, whose rounding
    costs acceptance and never output, keep 16 bits without a check of their own: a GGUF draft file on
    its blocks and self:int4."""
    target, draft = write_gguf(tmp_path / "target.gguf", 3), write_gguf(tmp_path / "draft.gguf", 1)
    monkeypatch.setattr(activation_bits, "KL_BOUND", float("inf"))
    monkeypatch.setenv("TACHY_CACHE_DIR", "off")  # every start checks (the second would read the first's)
    checked = []
    real = activation_bits.check_8_bits
    monkeypatch.setattr(activation_bits, "check_8_bits", lambda model, ids: checked.append(model) or real(model, ids))

    def bits(model: torch.nn.Module) -> set[int]:
        return {m.activation_bits for m in model.modules() if hasattr(m, "activation_bits")}

    for spec in (draft_spec(draft), draft_spec("self:int4")):
        checked.clear()
        llm = tiny_llm(target, quantization="gguf", max_model_len=128, speculative_config=spec)
        assert checked == [llm.engine.model]
        assert bits(llm.engine.model) == {8}
        assert bits(llm.engine.speculator.proposer.runner.model) == {16}


def test_gguf_draft_head_over_a_vocabulary_shortlist(tmp_path, monkeypatch):
    """The shortlist of a GGUF draft keeps the file's own blocks for the rows it keeps: the head's
    logits equal the full head's at those rows, exactly."""
    target, draft = write_gguf(tmp_path / "target.gguf", 3), write_gguf(tmp_path / "draft.gguf", 1)
    prompts = [[40, 50, 60, 70], [256, 104, 101, 32, 33], [120, 121]]
    params = SamplingParams(max_tokens=20, **GREEDY)
    options = {"quantization": "gguf", "max_model_len": 128}
    expected = token_ids(run(tiny_llm(target, **options), prompts, params))
    full = tiny_llm(target, **options, speculative_config=draft_spec(draft))
    llm = tiny_llm(target, **options, speculative_config=draft_spec(draft, draft_vocab_size=128))
    short_model = llm.engine.speculator.proposer.runner.model
    kept = short_model.head_token_ids
    assert kept.tolist() == [*range(128), 257]  # and <|im_end|>, the EOS
    assert type(short_model.lm_head).__name__ == "GGUFLinear"
    hidden = torch.randn(3, HIDDEN)
    whole = full.engine.speculator.proposer.runner.model.compute_logits(hidden)
    assert torch.equal(short_model.compute_logits(hidden), whole[:, kept])
    proposed = record_proposals(llm, monkeypatch)
    assert token_ids(run(llm, prompts, params)) == expected
    assert proposed and set(proposed) <= set(kept.tolist())
