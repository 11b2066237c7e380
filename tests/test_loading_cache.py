"""The on-disk checkpoint cache (tachyllm/loading/cache.py): a hit loads exactly what the GGUF file
does, a changed file misses, a damaged entry is rebuilt, and TACHY_CACHE_DIR=off turns it off."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from helpers.gguf_files import add_layer_tensors, add_llama_shape, finish

from tachyllm import loading
from tachyllm.loading import Checkpoint, cache, load_checkpoint

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 128, 2
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
TEXTS = [
    "the cat the theater",
    "<|im_start|>user\nhello there<|im_end|>\n",
    "Les élèves 東京 🚀 0123456789",
    "",
]


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, the alphabet of a byte-level vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_gguf(path: Path, seed: int = 0, quant: GGMLQuantizationType = GGMLQuantizationType.Q4_1) -> Path:
    """A two-layer llama GGUF with quantized matrices, float32 norms, a vocabulary and a chat template."""
    tokens = byte_alphabet() + ["Ġt", "he", "Ġthe", "<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, "llama")
    add_llama_shape(writer, layers=LAYERS, hidden=HIDDEN, ffn=FFN, heads=HEADS, kv_heads=KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_chat_template(CHAT_TEMPLATE)

    def add(name: str, *shape: int, quantize: bool = True) -> None:
        data = rng.standard_normal(shape).astype(np.float32)
        if quantize:
            writer.add_tensor(name, gguf.quants.quantize(data, quant), raw_dtype=quant)
        else:
            writer.add_tensor(name, data)

    add("token_embd.weight", len(tokens), HIDDEN)
    add("output_norm.weight", HIDDEN, quantize=False)
    add("output.weight", len(tokens), HIDDEN)
    for i in range(LAYERS):
        add_layer_tensors(add, i, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN)
    finish(writer)
    return path


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("TACHY_CACHE_DIR", str(root))
    return root


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "tiny.gguf")


def entries(root: Path) -> list[Path]:
    return sorted(root.glob("*.safetensors")) if root.is_dir() else []


def uncached(path: Path, monkeypatch: pytest.MonkeyPatch) -> Checkpoint:
    with monkeypatch.context() as m:
        m.setenv("TACHY_CACHE_DIR", "off")
        return load_checkpoint(str(path))


def cached_load_fails_if_parsing(path: Path, monkeypatch: pytest.MonkeyPatch) -> Checkpoint:
    """Loads `path` asserting the GGUF file is not parsed, i.e. the cache was hit."""

    def no_parse(source: str):
        raise AssertionError(f"expected a cache hit, but {source} was parsed")

    with monkeypatch.context() as m:
        m.setattr(loading, "load_gguf", no_parse)
        return load_checkpoint(str(path))


def fill(path: Path) -> Checkpoint:
    """A first load plus one complete pass over the weights, which writes the entry."""
    checkpoint = load_checkpoint(str(path))
    for _ in checkpoint.weights():
        pass
    return checkpoint


def assert_same(ours: Checkpoint, reference: Checkpoint) -> None:
    assert ours.config == reference.config
    assert (ours.source, ours.format) == (reference.source, reference.format)
    a, b = ours.tokenizer, reference.tokenizer
    assert_same_tokenizer(a, b)
    messages = [{"role": "user", "content": "hi"}]
    assert a.apply_chat_template(messages) == b.apply_chat_template(messages)
    ours_weights, reference_weights = list(ours.weights()), list(reference.weights())
    assert [n for n, _ in ours_weights] == [n for n, _ in reference_weights]
    for (name, x), (_, y) in zip(ours_weights, reference_weights):
        assert x.dtype == y.dtype and torch.equal(x, y), name


def test_hit_loads_what_the_gguf_file_holds(model: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = uncached(model, monkeypatch)
    first = load_checkpoint(str(model))
    assert entries(cache_root) == []  # written by the first pass over the weights, not by opening
    assert_same(first, reference)  # the writing pass yields the same tensors
    assert len(entries(cache_root)) == 1
    assert not list(cache_root.glob(".tmp-*"))
    assert_same(first, reference)  # later passes of the writing checkpoint read the entry back
    hit = cached_load_fails_if_parsing(model, monkeypatch)
    assert_same(hit, reference)
    assert hit.source == str(model)  # --quantization gguf re-reads the original file


def test_engine_on_a_hit_generates_the_same(model: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tachyllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    options = {"dtype": "float32", "kv_cache_memory": 1 << 20, "max_num_seqs": 4}
    fill(model)
    with monkeypatch.context() as m:
        m.setattr(loading, "load_gguf", lambda source: pytest.fail("expected a cache hit"))
        hit = LLM(str(model), **options).generate(["the cat"], params, use_tqdm=False)
    monkeypatch.setenv("TACHY_CACHE_DIR", "off")
    reference = LLM(str(model), **options).generate(["the cat"], params, use_tqdm=False)
    assert hit[0].outputs[0].token_ids == reference[0].outputs[0].token_ids


def test_changed_file_misses_and_replaces_the_old_entry(
    model: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fill(model)
    [old_entry] = entries(cache_root)
    write_gguf(model, seed=1)  # same size, new content
    stat = model.stat()
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    changed = fill(model)
    assert_same(changed, uncached(model, monkeypatch))
    [new_entry] = entries(cache_root)
    assert new_entry != old_entry
    # Touching the file (same bytes, new mtime) is a miss too.
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000))
    parsed = []
    original = loading.load_gguf
    monkeypatch.setattr(loading, "load_gguf", lambda source: parsed.append(source) or original(source))
    fill(model)
    assert parsed == [str(model)]
    assert len(entries(cache_root)) == 1 and entries(cache_root) != [new_entry]


def test_other_quantization_types_round_trip(tmp_path: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for quant in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        path = write_gguf(tmp_path / f"{quant.name}.gguf", quant=quant)
        fill(path)
        assert_same(cached_load_fails_if_parsing(path, monkeypatch), uncached(path, monkeypatch))


def truncate(entry: Path) -> None:
    entry.write_bytes(entry.read_bytes()[:-100])


def garble_header(entry: Path) -> None:
    data = bytearray(entry.read_bytes())
    data[8:40] = b"\x00" * 32
    entry.write_bytes(bytes(data))


def huge_header_length(entry: Path) -> None:
    data = bytearray(entry.read_bytes())
    data[:8] = (1 << 62).to_bytes(8, "little")
    entry.write_bytes(bytes(data))


def empty(entry: Path) -> None:
    entry.write_bytes(b"")


def foreign_safetensors(entry: Path) -> None:
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(3)}, str(entry), metadata={"tachyllm.key": "something else"})


@pytest.mark.parametrize("damage", [truncate, garble_header, huge_header_length, empty, foreign_safetensors])
def test_damaged_entry_is_rebuilt(
    damage, model: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fill(model)
    [entry] = entries(cache_root)
    damage(entry)
    with caplog.at_level(logging.WARNING, logger="tachyllm"):
        rebuilt = fill(model)
    assert "ignoring unusable entry" in caplog.text
    reference = uncached(model, monkeypatch)
    assert_same(rebuilt, reference)
    assert entries(cache_root) == [entry]
    assert_same(cached_load_fails_if_parsing(model, monkeypatch), reference)


def test_stored_config_schema_change_is_a_miss(model: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fill(model)
    original = cache._config_from_json

    def older_schema(text: str):
        data = __import__("json").loads(text)
        data.pop("qk_norm")
        return original(__import__("json").dumps(data))

    monkeypatch.setattr(cache, "_config_from_json", older_schema)
    assert cache.load(cache.CacheEntry.for_source(str(model))) is None
    assert entries(cache_root) == []


def test_an_interrupted_pass_leaves_no_entry(model: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint = load_checkpoint(str(model))
    stream = checkpoint.weights()
    next(stream)
    stream.close()
    assert entries(cache_root) == [] and not list(cache_root.glob(".tmp-*"))
    for _ in checkpoint.weights():  # a later complete pass still writes it
        pass
    assert len(entries(cache_root)) == 1
    assert_same(cached_load_fails_if_parsing(model, monkeypatch), uncached(model, monkeypatch))


def test_unwritable_cache_dir_only_warns(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TACHY_CACHE_DIR", str(blocker / "cache"))
    with caplog.at_level(logging.WARNING, logger="tachyllm"):
        checkpoint = fill(model)
    assert "cannot write" in caplog.text
    assert_same(checkpoint, uncached(model, monkeypatch))


@pytest.mark.parametrize("value", ["off", "OFF", "0", "false", "none", " off "])
def test_disabled(value: str, model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TACHY_CACHE_DIR", value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_dir() is None
    fill(model)
    fill(model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


def test_default_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TACHY_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "tachyllm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_dir() == tmp_path / "home" / ".cache" / "tachyllm"
    monkeypatch.setenv("TACHY_CACHE_DIR", "~/elsewhere")
    assert cache.cache_dir() == tmp_path / "home" / "elsewhere"


def test_test_session_does_not_cache_into_home() -> None:
    # conftest points the cache at a temporary directory for the whole session.
    directory = cache.cache_dir()
    assert directory is None or not str(directory).startswith(str(Path.home() / ".cache"))


# -- tokenizer state round trip (what an entry stores) ---------------------------------------------


def vocab_gguf(path: Path, model: str, tokens: list[str], types: list[int], **fields) -> Path:
    writer = GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    for key, value in fields.items():
        getattr(writer, f"add_{key}")(value)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    finish(writer)
    return path


@pytest.mark.parametrize("pre", ["smollm", "llama-bpe", "qwen2", "default"])
def test_byte_level_tokenizer_state_round_trip(pre: str, tmp_path: Path) -> None:
    from gguf import GGUFReader

    from tachyllm.loading.tokenizer import Tokenizer

    tokens = ["<unk>", "<s>", "</s>", *byte_alphabet(), "12", "123", "Ġt", "he", "Ġthe", "<think>"]
    types = [3, 3, 3] + [1] * (len(tokens) - 4) + [4]
    merges = ["1 2", "12 3", "Ġ t", "h e", "Ġt he"]
    path = vocab_gguf(tmp_path / "bpe.gguf", "gpt2", tokens, types, tokenizer_pre=pre, token_merges=merges)
    original = Tokenizer.from_gguf(GGUFReader(path))
    assert_same_tokenizer(Tokenizer.from_state(original.to_state()), original)


def test_sentencepiece_tokenizer_state_round_trip(tmp_path: Path) -> None:
    from gguf import GGUFReader

    from tachyllm.loading.tokenizer import Tokenizer

    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "ll", "▁he", "llo", "▁hello", "▁w", "or", "ld", "▁world"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    path = vocab_gguf(tmp_path / "spm.gguf", "llama", tokens, types, token_scores=scores)
    original = Tokenizer.from_gguf(GGUFReader(path))
    assert original.add_bos
    assert_same_tokenizer(Tokenizer.from_state(original.to_state()), original)


def assert_same_tokenizer(a, b) -> None:
    assert (a.bos_token_id, a.eos_token_id, a.add_bos, a.chat_template) == (
        b.bos_token_id,
        b.eos_token_id,
        b.add_bos,
        b.chat_template,
    )
    assert (a.vocab_size, a.special_ids) == (b.vocab_size, b.special_ids)
    for text in [*TEXTS, "hello world", " hello  world\n", "<s>hello</s>world", "a 123b <think>x", "héllo wörld 😀"]:
        for special in (True, False):
            ids = a.encode(text, add_special_tokens=special)
            assert ids == b.encode(text, add_special_tokens=special), text
            assert a.decode(ids) == b.decode(ids)
            assert a.decode(ids, skip_special_tokens=False) == b.decode(ids, skip_special_tokens=False)


def test_entry_deleted_after_writing_falls_back_to_the_file(
    model: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = fill(model)
    for entry in entries(cache_root):
        entry.unlink()
    assert_same(checkpoint, uncached(model, monkeypatch))


def test_failed_write_leaves_nothing_behind(
    model: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="tachyllm"):
        m.setattr(cache.os, "fsync", disk_full)
        checkpoint = fill(model)
    assert "No space left" in caplog.text
    assert entries(cache_root) == [] and not list(cache_root.glob(".tmp-*"))
    assert_same(checkpoint, uncached(model, monkeypatch))
