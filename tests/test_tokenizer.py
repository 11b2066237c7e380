"""Tokenizer: the default GGUF's byte-level BPE against transformers, GGUF SentencePiece vocabularies,
HF directories, and chat templates."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from gguf import GGUFReader, GGUFWriter
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tachyllm.errors import ConfigError, ModelLoadError, RequestError
from tachyllm.loading import Tokenizer, default_model_path

DEFAULT = default_model_path()

SAMPLES = [
    "Hello, world!",
    "The year 2024 had 12345 items, pi is 3.14159 and 1,000,000 > 999.",
    "def square(x):\n    return x ** 2  # comment\n\n\nclass A:\n\tpass\n",
    "   leading and trailing spaces   ",
    "tabs\tand\n\nnewlines\r\nmixed \n \t ",
    "emoji 😀🎉👍🏽 and a family 👨‍👩‍👧",
    "中文字符测试，日本語のテキスト、한국어 텍스트",
    "Café naïve résumé façade Ångström jalapeño",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "don't I'll we've they're it's",
    "text<|endoftext|>more text",
    "",
]


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFReader(DEFAULT))


@pytest.fixture(scope="module")
def reference():
    return AutoTokenizer.from_pretrained(os.path.dirname(DEFAULT), gguf_file=os.path.basename(DEFAULT))


@pytest.mark.slow  # transformers reading the real default model (~7 s)
def test_default_matches_transformers(smollm: Tokenizer, reference) -> None:
    # transformers builds this vocabulary with the plain GPT-2 pre-tokenizer, ignoring the "smollm"
    # digit split. It still agrees on digits because SmolLM2 was trained with digits isolated, so its
    # merges never join a digit to anything; test_smollm_pre_tokenizer_isolates_digits covers the split.
    for text in SAMPLES:
        assert smollm.encode(text) == reference.encode(text), text
        assert smollm.decode(smollm.encode(text), skip_special_tokens=False) == text


def test_default_special_tokens(smollm: Tokenizer) -> None:
    assert smollm.vocab_size == 49152
    assert (smollm.bos_token_id, smollm.eos_token_id, smollm.add_bos) == (1, 2, False)
    assert smollm.special_ids == frozenset(range(17))
    assert smollm.is_special(2) and not smollm.is_special(100)
    assert smollm.id_to_token(2) == "<|im_end|>"
    ids = smollm.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm.decode(ids) == "user\nHi"
    assert smollm.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>"
    with pytest.raises(ValueError):
        smollm.id_to_token(10**6)


def test_default_chat_template(smollm: Tokenizer) -> None:
    text = smollm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = smollm.apply_chat_template([{"role": "system", "content": "Be brief."}], add_generation_prompt=False)
    assert no_prompt == "<|im_start|>system\nBe brief.<|im_end|>\n"


# -- synthetic GGUF vocabularies -------------------------------------------------------------------


def write_vocab_gguf(
    path: Path,
    model: str,
    tokens: list[str],
    types: list[int],
    *,
    pre: str | None = None,
    merges: list[str] | None = None,
    scores: list[float] | None = None,
) -> GGUFReader:
    writer = GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if merges is not None:
        writer.add_token_merges(merges)
    if scores is not None:
        writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFReader(path)


def byte_level(tmp_path: Path, pre: str) -> Tokenizer:
    alphabet = list(bytes_to_unicode().values())
    tokens = ["<unk>", "<s>", "</s>", *alphabet, "12", "123", "<think>"]
    types = [3, 3, 3] + [1] * (len(alphabet) + 2) + [4]
    reader = write_vocab_gguf(tmp_path / f"{pre}.gguf", "gpt2", tokens, types, pre=pre, merges=["1 2", "12 3"])
    return Tokenizer.from_gguf(reader)


def test_smollm_pre_tokenizer_isolates_digits(tmp_path: Path) -> None:
    # llama.cpp's "smollm" pre-tokenizer (like SmolLM2's tokenizer.json) splits every digit off
    # before the GPT-2 regex, so digit merges can never apply; the default GPT-2 one keeps "123" whole.
    smollm, gpt2 = byte_level(tmp_path, "smollm"), byte_level(tmp_path, "default")
    digit_ids = [smollm.encode(d)[0] for d in "123"]
    assert smollm.encode("123") == digit_ids
    assert gpt2.encode("123") == [gpt2.encode("123")[0]] and gpt2.id_to_token(gpt2.encode("123")[0]) == "123"
    assert smollm.decode(smollm.encode("a 123b")) == "a 123b"


def test_user_defined_tokens_survive_decoding(tmp_path: Path) -> None:
    tokenizer = byte_level(tmp_path, "qwen2")
    ids = tokenizer.encode("<s>a<think>b</s>")
    assert len(ids) == 5 and not tokenizer.is_special(ids[2]) and tokenizer.is_special(ids[0])
    assert tokenizer.decode(ids) == "a<think>b"


def test_unsupported_gguf_tokenizers(tmp_path: Path) -> None:
    reader = write_vocab_gguf(tmp_path / "bert.gguf", "bert", ["[UNK]", "[CLS]", "[SEP]"], [2, 3, 3])
    with pytest.raises(ModelLoadError, match="'bert'"):
        Tokenizer.from_gguf(reader)
    with pytest.raises(ModelLoadError, match="'mystery'"):
        byte_level(tmp_path, "mystery")


SPM_PIECES = [
    "▁",
    "h",
    "e",
    "l",
    "o",
    "w",
    "r",
    "d",
    "i",
    "n",
    "▁h",
    "ll",
    "▁he",
    "llo",
    "▁hello",
    "▁w",
    "or",
    "▁wor",
    "ld",
    "▁world",
    "▁i",
    "in",
    "▁in",
]


@pytest.fixture
def spm(tmp_path: Path) -> tuple[Tokenizer, object]:
    """A SentencePiece vocabulary with byte fallback and no merges (they come from the scores)."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES]
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))]
    write_vocab_gguf(tmp_path / "spm.gguf", "llama", tokens, types, scores=scores)
    ours = Tokenizer.from_gguf(GGUFReader(tmp_path / "spm.gguf"))
    return ours, AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")


def test_sentencepiece_matches_transformers(spm) -> None:
    ours, reference = spm
    assert ours.add_bos and ours.bos_token_id == 1
    for text in ["hello world", "hello", "héllo wörld 😀", "in win hello", "hello\nworld  twice", ""]:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text)) == text


def test_sentencepiece_space_prefix_follows_llama_cpp(spm) -> None:
    # llama.cpp prefixes a space to the text at the start and after every special token; the
    # transformers conversion (Metaspace, prepend_scheme="first") differs here, so no comparison.
    ours, _ = spm
    space, hello, world = (ours.id_to_token(i) for i in ours.encode(" hello world")[1:])
    assert (space, hello, world) == ("▁", "▁hello", "▁world")
    ids = ours.encode("<s>hello</s>world", add_special_tokens=False)
    assert [ours.id_to_token(i) for i in ids] == ["<s>", "▁hello", "</s>", "▁world"]


# -- HF directories --------------------------------------------------------------------------------


def save_hf_tokenizer(directory: Path, config: dict, *, bos_post_processor: bool = False) -> None:
    alphabet = list(bytes_to_unicode().values())
    backend = Backend(models.BPE({t: i for i, t in enumerate(alphabet)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<bos>", special=True), AddedToken("<eos>", special=True)])
    if bos_post_processor:  # how Llama 3's tokenizer.json adds BOS
        backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 256)])
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def test_hf_tokenizer_config(tmp_path: Path) -> None:
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}"
    save_hf_tokenizer(
        tmp_path,
        {"bos_token": {"content": "<bos>"}, "eos_token": "<eos>", "add_bos_token": True, "chat_template": template},
    )
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.add_bos) == (256, 257, True)
    assert tokenizer.vocab_size == 258
    assert tokenizer.encode("hi") == [256, *tokenizer.encode("hi", add_special_tokens=False)]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "<bos>[user] x<eos>"
    # transformers >= 4.43 saves the template to its own file, which wins.
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }}")
    assert Tokenizer.from_hf_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "1"


def test_hf_bos_from_post_processor(tmp_path: Path) -> None:
    save_hf_tokenizer(tmp_path, {"bos_token": "<bos>"}, bos_post_processor=True)
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    assert tokenizer.add_bos
    plain = tokenizer.encode("ab", add_special_tokens=False)
    assert len(plain) == 2 and tokenizer.encode("ab") == [256, *plain]


def test_hf_tokenizer_json_padding_and_truncation_ignored(tmp_path: Path) -> None:
    """A tokenizer.json that pads and truncates every encoding (all-MiniLM-L6-v2's: to 128) encodes
    inputs as they are, as transformers does: no pad tokens counted in, no tokens silently cut."""
    save_hf_tokenizer(tmp_path, {"pad_token": "<eos>"})
    plain = Tokenizer.from_hf_dir(tmp_path)
    saved = Backend.from_file(str(tmp_path / "tokenizer.json"))
    saved.enable_padding(pad_id=257, pad_token="<eos>", length=8)
    saved.enable_truncation(max_length=8)
    saved.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    for text in ("ab", "a longer input than eight bytes"):
        assert tokenizer.encode(text) == plain.encode(text)
        assert tokenizer.encode_pair(text) == (plain.encode(text), [0] * len(plain.encode(text)))
    assert len(tokenizer.encode("ab")) == 2 and len(tokenizer.encode("a longer input than eight bytes")) > 8


def test_hf_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


# -- chat templates --------------------------------------------------------------------------------


def test_chat_template_errors(tmp_path: Path) -> None:
    save_hf_tokenizer(tmp_path, {})
    with pytest.raises(ConfigError, match="no chat template"):
        Tokenizer.from_hf_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])

    strict = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok"
    )
    save_hf_tokenizer(tmp_path, {"chat_template": strict})
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(RequestError, match="first message must be from the user"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}])

    save_hf_tokenizer(tmp_path, {"chat_template": "{% for %}"})
    with pytest.raises(ConfigError, match="not valid Jinja"):
        Tokenizer.from_hf_dir(tmp_path).apply_chat_template([])


def test_chat_template_tools_and_extra_variables(tmp_path: Path) -> None:
    template = (
        "{% if tools %}{{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}{{ m.content }}\n{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    )
    save_hf_tokenizer(tmp_path, {"chat_template": template})
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    tools = [{"name": "f", "description": "<a> & 'b' é"}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=tools, enable_thinking=False)
    # Unlike Jinja's own tojson, no HTML escaping and no ASCII escaping (as in transformers).
    assert text == '[{"name": "f", "description": "<a> & \'b\' é"}]\nx\n<think></think>'
