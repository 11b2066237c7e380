"""load_checkpoint: the default GGUF, tiny GGUFs of each architecture, tiny HF directories, bad inputs.

References are independent implementations: transformers' GGUF loader for GGUF tensors (including
its own undoing of llama.cpp's q/k row permutation) and the state_dict of the HF model for HF dirs.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from helpers.gguf_files import add_layer_tensors, add_llama_shape, finish
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from tachyllm.errors import ModelLoadError
from tachyllm.loading import Checkpoint, default_model_path, load_checkpoint

DEFAULT = default_model_path()


@pytest.fixture(scope="module")
def default_checkpoint() -> Checkpoint:
    return load_checkpoint(None)


def transformers_gguf_tensors(path: Path) -> dict[str, torch.Tensor]:
    """transformers needs a model to map names; a meta-device one costs no memory."""
    config = load_gguf_checkpoint(str(path))["config"]
    model_config = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[config["model_type"]]
    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "_model_name_or_path")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(**fields))
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]


# -- the default model ---------------------------------------------------------------------------


def test_default_config(default_checkpoint: Checkpoint) -> None:
    config = default_checkpoint.config
    assert default_checkpoint.format == "gguf"
    assert default_checkpoint.source == DEFAULT
    assert config.architecture == "llama"
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == (576, 30, 9, 3)
    assert (config.head_dim, config.intermediate_size, config.vocab_size) == (64, 1536, 49152)
    assert config.rope_theta == 1e5
    assert config.rms_norm_eps == 1e-5
    assert config.max_position_embeddings == 8192
    assert config.tie_word_embeddings and not config.attention_bias and not config.qk_norm
    assert config.rope_scaling is None
    assert config.bos_token_id == 1 and config.eos_token_ids == [2]
    assert config.checkpoint_dtype == torch.float32


@pytest.mark.slow  # transformers loading the real default model (~6 s)
def test_default_weights_match_transformers(default_checkpoint: Checkpoint, tmp_path: Path) -> None:
    # transformers dequantizes every tensor of a file it reads, so it gets a copy holding the raw
    # (still quantized) bytes of the first two layers only.
    layers = 2
    source = GGUFReader(DEFAULT)
    meta = {key: field.contents() for key, field in source.fields.items() if key.startswith("llama.")}
    subset = tmp_path / "subset.gguf"
    writer = GGUFWriter(subset, "llama")
    writer.add_block_count(layers)
    writer.add_context_length(meta["llama.context_length"])
    writer.add_embedding_length(meta["llama.embedding_length"])
    writer.add_feed_forward_length(meta["llama.feed_forward_length"])
    writer.add_head_count(meta["llama.attention.head_count"])
    writer.add_head_count_kv(meta["llama.attention.head_count_kv"])
    writer.add_rope_freq_base(meta["llama.rope.freq_base"])
    writer.add_layer_norm_rms_eps(meta["llama.attention.layer_norm_rms_epsilon"])
    writer.add_vocab_size(meta["llama.vocab_size"])
    kept = [t for t in source.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < layers]
    for tensor in kept:
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    finish(writer)
    assert {t.tensor_type for t in kept} >= {GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0}

    reference = transformers_gguf_tensors(subset)
    ours = {}
    for name, tensor in default_checkpoint.weights():
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers:
            ours[name] = tensor
        # Every tensor, not just the compared ones, comes out fp32 with an nn.Linear shape.
        assert tensor.dtype == torch.float32
    assert "lm_head.weight" not in ours
    assert ours.keys() == reference.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name
    assert ours["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert ours["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert ours["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert ours["model.embed_tokens.weight"].shape == (49152, 576)


def test_default_weights_cover_every_layer(default_checkpoint: Checkpoint) -> None:
    names = [name for name, _ in default_checkpoint.weights()]
    assert len(names) == len(set(names)) == 2 + 30 * 9
    assert "model.layers.29.mlp.up_proj.weight" in names


# -- tiny GGUFs of each architecture ---------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 128, 2


def byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    alphabet = list(bytes_to_unicode().values())
    tokens = alphabet + ["Ġt", "he", "Ġthe", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "Ġt he"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    return tokens, merges, types


def write_tiny_gguf(
    path: Path,
    arch: str,
    *,
    head_dim: int,
    tied: bool,
    bias: bool,
    qk_norm: bool,
    quant: GGMLQuantizationType,
    rope_freqs: np.ndarray | None = None,
    extra: dict[str, np.ndarray] | None = None,
) -> None:
    tokens, merges, types = byte_level_vocab()
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, arch)
    add_llama_shape(writer, layers=LAYERS, hidden=HIDDEN, ffn=FFN, heads=HEADS, kv_heads=KV_HEADS)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch != "llama" else "llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)

    def add(name: str, *shape: int, quantize: bool = True) -> None:
        data = rng.standard_normal(shape).astype(np.float32)
        if quantize and quant != GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(data, quant), raw_dtype=quant)
        else:
            writer.add_tensor(name, data)

    add("token_embd.weight", len(tokens), HIDDEN)
    add("output_norm.weight", HIDDEN, quantize=False)
    if not tied:
        add("output.weight", len(tokens), HIDDEN)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for name, data in (extra or {}).items():
        writer.add_tensor(name, data)
    for i in range(LAYERS):
        add_layer_tensors(add, i, HIDDEN, HEADS, KV_HEADS, head_dim, FFN)
        if bias:
            for part, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                add(f"blk.{i}.attn_{part}.bias", rows * head_dim, quantize=False)
        if qk_norm:
            add(f"blk.{i}.attn_q_norm.weight", head_dim, quantize=False)
            add(f"blk.{i}.attn_k_norm.weight", head_dim, quantize=False)
    finish(writer)


@pytest.mark.parametrize(
    ("arch", "head_dim", "tied", "bias", "qk_norm", "quant"),
    [
        ("llama", 16, False, False, False, GGMLQuantizationType.Q8_0),
        ("qwen2", 16, True, True, False, GGMLQuantizationType.F16),
        ("qwen3", 32, False, False, True, GGMLQuantizationType.BF16),
    ],
)
def test_tiny_gguf_matches_transformers(tmp_path: Path, arch, head_dim, tied, bias, qk_norm, quant) -> None:
    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(path, arch, head_dim=head_dim, tied=tied, bias=bias, qk_norm=qk_norm, quant=quant)
    checkpoint = load_checkpoint(str(path))
    config = checkpoint.config
    assert config.architecture == arch
    shape = (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim)
    assert shape == (HIDDEN, HEADS, KV_HEADS, head_dim)
    assert (config.tie_word_embeddings, config.attention_bias, config.qk_norm) == (tied, bias, qk_norm)
    assert config.vocab_size == checkpoint.tokenizer.vocab_size == len(byte_level_vocab()[0])
    assert config.rope_theta == 500000.0 and config.rms_norm_eps == 1e-6
    assert config.eos_token_ids == [checkpoint.tokenizer.eos_token_id]

    ours = dict(checkpoint.weights())
    reference = transformers_gguf_tensors(path)
    assert ours.keys() == reference.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path: Path) -> None:
    """Llama 3.1 GGUFs carry rope scaling as a rope_freqs tensor; the recovered dict must give
    transformers' llama3 inverse frequencies."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim = 64  # Llama 3.2's: 32 frequencies, a few of them in the interpolated band
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }

    def inv_freq(rope: dict | None) -> torch.Tensor:
        params = {"rope_theta": 500000.0, "rope_type": "default", **(rope or {})}
        hf = LlamaConfig(
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            head_dim=head_dim,
            max_position_embeddings=131072,
            rope_parameters=params,
        )
        init = ROPE_INIT_FUNCTIONS[params["rope_type"]] if rope else None
        if init is None:
            return 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        return init(hf, "cpu")[0].double()

    # llama.cpp stores, per frequency, the divisor that turns the base frequency into the scaled one.
    divisors = (inv_freq(None) / inv_freq(scaling)).numpy()
    path = tmp_path / "llama31.gguf"
    write_tiny_gguf(
        path,
        "llama",
        head_dim=head_dim,
        tied=True,
        bias=False,
        qk_norm=False,
        quant=GGMLQuantizationType.F32,
        rope_freqs=divisors,
    )
    checkpoint = load_checkpoint(str(path))
    recovered = checkpoint.config.rope_scaling
    assert recovered == scaling
    torch.testing.assert_close(inv_freq(recovered), inv_freq(scaling), rtol=1e-5, atol=0)
    assert all(not name.startswith("rope_freqs") for name, _ in checkpoint.weights())


# -- tiny HF directories ---------------------------------------------------------------------------

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tokenizer(directory: Path) -> int:
    """A small byte-level BPE with ChatML special tokens; returns its vocabulary size."""
    tokens, merges, _ = byte_level_vocab()
    backend = Backend(models.BPE({t: i for i, t in enumerate(tokens[:-2])}, [tuple(m.split()) for m in merges]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    backend.save(str(directory / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return backend.get_vocab_size(with_added_tokens=True)


def small(config_class, vocab: int, **extra):
    return config_class(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        intermediate_size=FFN,
        vocab_size=vocab,
        **extra,
    )


HF_CASES = {
    "llama": lambda v: small(
        LlamaConfig,
        v,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        max_position_embeddings=1024,
        eos_token_id=[v - 1, v - 2],
    ),
    "mistral": lambda v: small(MistralConfig, v, tie_word_embeddings=False),
    "qwen2": lambda v: small(Qwen2Config, v, tie_word_embeddings=True),
    "qwen3": lambda v: small(Qwen3Config, v, head_dim=32, tie_word_embeddings=True),
}


@pytest.mark.parametrize("arch", sorted(HF_CASES))
def test_hf_directory(tmp_path: Path, arch: str) -> None:
    vocab = save_tokenizer(tmp_path)
    hf_config = HF_CASES[arch](vocab)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config)
    if arch == "qwen3":
        model = model.to(torch.bfloat16)  # checkpoint_dtype follows the saved dtype
    # A small shard size exercises model.safetensors.index.json.
    model.save_pretrained(tmp_path, max_shard_size="40KB" if arch == "llama" else "1GB")

    checkpoint = load_checkpoint(str(tmp_path))
    config = checkpoint.config
    assert checkpoint.format == "hf"
    assert config.architecture == arch
    assert (config.vocab_size, config.hidden_size, config.num_layers) == (vocab, HIDDEN, LAYERS)
    assert (config.num_heads, config.num_kv_heads, config.intermediate_size) == (HEADS, KV_HEADS, FFN)
    assert config.head_dim == (32 if arch == "qwen3" else HIDDEN // HEADS)
    assert config.tie_word_embeddings == (arch in ("qwen2", "qwen3"))
    assert config.attention_bias == (arch == "qwen2")
    assert config.qk_norm == (arch == "qwen3")
    assert config.checkpoint_dtype == (torch.bfloat16 if arch == "qwen3" else torch.float32)
    if arch == "llama":
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert config.rope_theta == 500000.0
        assert config.rope_scaling == {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        }
        assert config.eos_token_ids == [vocab - 1, vocab - 2]
    else:
        assert config.rope_scaling is None

    expected = model.state_dict()
    if config.tie_word_embeddings:
        del expected["lm_head.weight"]
    ours = dict(checkpoint.weights())
    assert ours.keys() == expected.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name

    tokenizer = checkpoint.tokenizer
    assert tokenizer.eos_token_id == vocab - 1 and tokenizer.bos_token_id is None and not tokenizer.add_bos
    assert tokenizer.decode(tokenizer.encode("the theme")) == "the theme"


def test_hf_legacy_rope_and_generation_config(tmp_path: Path) -> None:
    """Configs written by transformers 4.x: rope_theta and rope_scaling with "type"; eos from
    generation_config.json is added to config.json's."""
    vocab = save_tokenizer(tmp_path)
    model = AutoModelForCausalLM.from_config(small(LlamaConfig, vocab))
    model.save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    raw = json.loads(config_file.read_text())
    raw.pop("rope_parameters", None)
    raw.update(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0}, eos_token_id=3, torch_dtype="bfloat16")
    raw.pop("dtype", None)
    config_file.write_text(json.dumps(raw))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 7]}))
    config = load_checkpoint(str(tmp_path)).config
    assert config.rope_theta == 1e6
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.eos_token_ids == [3, 7]
    assert config.checkpoint_dtype == torch.bfloat16


# -- bad inputs ------------------------------------------------------------------------------------


def assert_load_error(path: Path | str, *words: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(str(path))
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    for word in words:
        assert word in message


def test_missing_path(tmp_path: Path) -> None:
    assert_load_error(tmp_path / "nope.gguf", "does not exist")


def test_directory_without_config(tmp_path: Path) -> None:
    assert_load_error(tmp_path, "config.json")


def test_unsupported_hf_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    assert_load_error(tmp_path, "GPT2LMHeadModel")


def test_hf_directory_missing_shard(tmp_path: Path) -> None:
    save_tokenizer(tmp_path)
    AutoModelForCausalLM.from_config(small(LlamaConfig, 300)).save_pretrained(tmp_path, max_shard_size="40KB")
    next(tmp_path.glob("model-00002-*.safetensors")).unlink()
    assert_load_error(tmp_path, "missing")


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    finish(writer)
    assert_load_error(path, "gpt2")


def test_truncated_default_gguf(tmp_path: Path) -> None:
    path = tmp_path / "truncated.gguf"
    with open(DEFAULT, "rb") as handle:
        path.write_bytes(handle.read(1 << 20))
    assert_load_error(path, "invalid or truncated GGUF")


def test_gguf_with_truncated_tensor_data(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", head_dim=16, tied=True, bias=False, qk_norm=False, quant=GGMLQuantizationType.F32)
    path.write_bytes(path.read_bytes()[:-1000])
    assert_load_error(path, "truncated")


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"blk.0.attn_qkv.weight": np.zeros((48, 64), np.float32)}, ("unexpected tensor", "attn_qkv")),
        ({"blk.0.ffn_gate_inp.weight": np.zeros((4, 64), np.int32)}, ("unexpected tensor",)),
    ],
)
def test_gguf_with_unknown_tensors(tmp_path: Path, extra: dict, words: tuple[str, ...]) -> None:
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(
        path, "llama", head_dim=16, tied=True, bias=False, qk_norm=False, quant=GGMLQuantizationType.F32, extra=extra
    )
    assert_load_error(path, *words)


def test_gguf_with_undequantizable_tensor_type(tmp_path: Path) -> None:
    path = tmp_path / "int.gguf"
    # Declared tied so the helper leaves output.weight to `extra`.
    write_tiny_gguf(
        path,
        "llama",
        head_dim=16,
        tied=True,
        bias=False,
        qk_norm=False,
        quant=GGMLQuantizationType.F32,
        extra={"output.weight": np.zeros((261, 64), np.int32)},
    )
    assert_load_error(path, "output.weight", "I32")


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_text("this is not a model\n" * 10)
    assert_load_error(path, "invalid or truncated GGUF")


def test_unknown_file_type(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 64)
    assert_load_error(path, "not a GGUF file")


def test_gguf_reader_reads_what_the_gguf_package_reads(default_model_path):
    """open_gguf's reader (plain ndarray views, for speed) yields exactly the gguf package's fields and
    tensors on the real default model file."""
    from tachyllm.loading.gguf import open_gguf

    ours, theirs = open_gguf(default_model_path), GGUFReader(default_model_path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), name
        assert len(mine.parts) == len(field.parts), name
        for a, b in zip(mine.parts, field.parts):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert len(ours.tensors) == len(theirs.tensors) > 0
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset
        )  # fmt: skip
        assert np.array_equal(a.shape, b.shape) and np.array_equal(a.data, b.data), a.name
