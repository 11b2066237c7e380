"""IncrementalDetokenizer: streamed deltas add up to the full decode, never show half a character,
and each step decodes only a few tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFReader, GGUFWriter
from helpers.gguf_files import finish

from tachyllm.detokenizer import IncrementalDetokenizer
from tachyllm.loading import Tokenizer, default_model_path

TEXTS = [
    "Hello there, how are you today?",
    "emoji 😀🎉👍🏽 and a family 👨‍👩‍👧 at the end 🚀",
    "中文字符测试，日本語のテキスト、한국어 텍스트",
    "Café naïve résumé façade Ångström jalapeño — “quotes” …",
    "  spaces\tand\nnewlines \n\n 12345 🎉",
]


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFReader(default_model_path()))


def stream(detokenizer: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    return [detokenizer.add_tokens(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_to_full_decode(smollm: Tokenizer, text: str, chunk: int) -> None:
    prompt = smollm.encode("<|im_start|>assistant\n")
    ids = smollm.encode(text)
    detokenizer = IncrementalDetokenizer(smollm, prompt)
    deltas = stream(detokenizer, ids, chunk)
    assert "".join(deltas) == smollm.decode(ids) == text
    assert detokenizer.text == text
    assert not any("\ufffd" in delta for delta in deltas)


def test_split_characters_are_held_back(smollm: Tokenizer) -> None:
    ids = smollm.encode("😀")
    assert len(ids) > 1  # the emoji's bytes span tokens, which is what this test is about
    detokenizer = IncrementalDetokenizer(smollm, [])
    deltas = stream(detokenizer, ids)
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "😀"


def test_first_token_keeps_its_leading_space(smollm: Tokenizer) -> None:
    prompt = smollm.encode("Hello")
    ids = smollm.encode(" world, again")
    deltas = stream(IncrementalDetokenizer(smollm, prompt), ids)
    assert deltas[0] == " world"
    assert "".join(deltas) == " world, again"


def test_special_tokens(smollm: Tokenizer) -> None:
    ids = smollm.encode("Done.<|im_end|>")
    assert "".join(stream(IncrementalDetokenizer(smollm, []), ids)) == "Done."
    kept = IncrementalDetokenizer(smollm, [], skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == "Done.<|im_end|>"


def lone_continuation_byte(tokenizer: Tokenizer) -> int:
    token = tokenizer.encode("😀")[-1]  # the emoji's last byte, 0x80, is a token of its own
    assert tokenizer.decode([token]) == "\ufffd"
    return token


def test_invalid_bytes_are_emitted_once_followed(smollm: Tokenizer) -> None:
    # A lone UTF-8 continuation byte can never complete: it shows as U+FFFD once later text arrives.
    lone = lone_continuation_byte(smollm)
    ids = [lone, *smollm.encode(" ok")]
    deltas = stream(IncrementalDetokenizer(smollm, []), ids)
    assert "".join(deltas) == smollm.decode(ids) == "\ufffd ok"


class CountingTokenizer:
    """Records how many ids each decode call gets."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.sizes: list[int] = []

    def decode(self, ids, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens, spaces_between_special_tokens)


def test_work_per_token_is_bounded(smollm: Tokenizer) -> None:
    text = " ".join(TEXTS) * 20
    ids = smollm.encode(text)
    counting = CountingTokenizer(smollm)
    detokenizer = IncrementalDetokenizer(counting, smollm.encode("prompt " * 100))
    assert "".join(stream(detokenizer, ids)) == text
    # 2 * 4 context tokens, plus the few tokens of a character still being completed.
    assert len(ids) > 1000 and max(counting.sizes) <= 12


def test_bounded_on_endless_invalid_bytes(smollm: Tokenizer) -> None:
    counting = CountingTokenizer(smollm)
    detokenizer = IncrementalDetokenizer(counting, [])
    lone = lone_continuation_byte(smollm)
    for _ in range(300):
        detokenizer.add_tokens([lone])
    assert max(counting.sizes) <= 12
    assert detokenizer.text == "\ufffd" * 297  # the last three might still be the start of a character
    detokenizer.add_tokens(smollm.encode(" ok"))
    assert detokenizer.text == "\ufffd" * 300 + " ok"


# -- SentencePiece byte fallback: one U+FFFD per dangling byte, and a stripped leading space ---------


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    pieces = ["▁", "h", "e", "l", "o", "▁h", "ll", "▁he", "llo", "▁hello", "▁w", "or", "▁wor", "ld", "▁world"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    path = Path(tmp_path_factory.mktemp("spm")) / "spm.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    finish(writer)
    return Tokenizer.from_gguf(GGUFReader(path))


@pytest.mark.parametrize("chunk", [1, 3, 5])
@pytest.mark.parametrize(
    "text", ["hello world", "héllo wörld 😀 中文 hello", "😀😀 world 🎉", "中文字符测试" * 20 + " hello"]
)
def test_sentencepiece_byte_fallback(spm: Tokenizer, text: str, chunk: int) -> None:
    # Every character above is spelled in byte tokens; batches that end mid-character (chunk 3, 5)
    # leave a byte-fallback run unfinished at almost every call.
    ids = spm.encode(text, add_special_tokens=False)
    counting = CountingTokenizer(spm)
    detokenizer = IncrementalDetokenizer(counting, [spm.bos_token_id])
    deltas = stream(detokenizer, ids, chunk)
    assert "".join(deltas) == spm.decode(ids) == text
    assert not any("\ufffd" in delta for delta in deltas)
    assert max(counting.sizes) <= 2 * 4 + 3 + chunk


def test_sentencepiece_continuation_keeps_space(spm: Tokenizer) -> None:
    prompt = spm.encode("hello")
    deltas = stream(IncrementalDetokenizer(spm, prompt), spm.encode("world", add_special_tokens=False))
    assert "".join(deltas) == " world"


def test_spaces_between_special_tokens(spm: Tokenizer) -> None:
    # vLLM's option: False writes special tokens with nothing the decoder adds beside them (here
    # SentencePiece's word space), True is the tokenizer's own decode; it matters only when specials are kept.
    hello, world = (spm.encode(w, add_special_tokens=False) for w in ("hello", "world"))
    ids = [*hello, spm.eos_token_id, spm.bos_token_id, *world]
    assert spm.decode(ids, skip_special_tokens=False) == "hello</s><s> world"
    assert spm.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False) == "hello</s><s>world"
    assert spm.decode(ids, spaces_between_special_tokens=False) == spm.decode(ids) == "hello world"
    # Streamed after a prompt, in context: the first word keeps its space unless a special token precedes it.
    for spaces, text in ((True, " hello</s><s> world"), (False, "hello</s><s>world")):
        detokenizer = IncrementalDetokenizer(spm, [spm.bos_token_id], False, spaces)
        assert "".join(stream(detokenizer, ids)) == text
