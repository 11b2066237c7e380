"""Tokenizer: a `tokenizers.Tokenizer` plus the special-token facts and chat template a model ships with.

It is built either from a Hugging Face directory (tokenizer.json + tokenizer_config.json) or from the
vocabulary a GGUF file stores as metadata, rebuilt into the equivalent `tokenizers` pipeline.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from tachyllm.chat_template import compile_chat_template
from tachyllm.errors import ConfigError, ModelLoadError, RequestError
from tachyllm.loading.gguf import gguf_value

# What the renderer itself passes a chat template.
RESERVED_TEMPLATE_VARS = frozenset(
    {"messages", "add_generation_prompt", "tools", "bos_token", "eos_token", "chat_template", "continue_final_message"}
)

# llama.cpp token types (tokenizer.ggml.token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The same but for up to three digits in one pre-token.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> (regex splits applied before the byte-level mapping, ignore_merges).
# Mirrors llama.cpp's per-model pre-tokenizer table for the models this engine runs; "smollm" first
# isolates every digit (\p{N}) and then applies the GPT-2 regex, which is what SmolLM2's own
# tokenizer.json does with Digits(individual_digits=True) + ByteLevel. llama.cpp matches a whole
# pre-token against the vocabulary before merging only for Llama 3 (HF: ignore_merges=True).
_BYTE_LEVEL_PRE: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": ((_GPT2_SPLIT,), False),
    "gpt-2": ((_GPT2_SPLIT,), False),
    "smollm": ((r"\p{N}", _GPT2_SPLIT), False),
    "qwen2": ((_QWEN2_SPLIT,), False),
    "deepseek-r1-qwen": ((_QWEN2_SPLIT,), False),
    "llama-bpe": ((_LLAMA3_SPLIT,), True),
    "llama3": ((_LLAMA3_SPLIT,), True),
}

_SPM_SPACE = "\u2581"  # SentencePiece writes spaces as "▁"


class BatchEncoding(dict):
    """What calling a tokenizer returns, as transformers has it: a dict whose keys are also attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Tokenizer:
    """Text <-> token ids, special tokens, and chat-template rendering for one model."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos: bool,
        chat_template: str | None,
        pad_token_id: int | None = None,
    ) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.add_bos = add_bos and bos_token_id is not None
        self.chat_template = chat_template
        # A GGUF vocabulary may repeat a string, leaving holes in the id range, so the size is the
        # highest id + 1 rather than the number of distinct strings.
        self.vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        added = backend.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, tok in added.items() if tok.special)
        self._added_texts = {i: tok.content for i, tok in added.items()}

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, reader: GGUFReader) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes in its tokenizer.ggml.* metadata."""
        kind = gguf_value(reader, "tokenizer.ggml.model")
        tokens: list[str] = gguf_value(reader, "tokenizer.ggml.tokens")
        if tokens is None:
            raise ModelLoadError("GGUF file has no tokenizer.ggml.tokens vocabulary")
        types: list[int] = gguf_value(reader, "tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        if kind == "gpt2":
            backend = _byte_level_bpe(reader, tokens)
            add_bos_default = False
        elif kind == "llama":
            backend = _sentencepiece_bpe(reader, tokens, types)
            # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
            add_bos_default = True
        else:
            raise ModelLoadError(f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2', 'llama')")
        _register_added_tokens(backend, tokens, types)
        return cls(
            backend,
            bos_token_id=gguf_value(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_id=gguf_value(reader, "tokenizer.ggml.eos_token_id"),
            add_bos=gguf_value(reader, "tokenizer.ggml.add_bos_token", add_bos_default),
            chat_template=gguf_value(reader, "tokenizer.chat_template"),
            pad_token_id=gguf_value(reader, "tokenizer.ggml.padding_token_id"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, with special tokens and chat template from tokenizer_config.json."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError("no tokenizer.json (only fast-tokenizer files are supported)")
        backend = Backend.from_file(str(tokenizer_file))
        # Some tokenizer.json files pad and truncate every encoding (all-MiniLM-L6-v2's: to 128 tokens);
        # transformers ignores that unless asked per call, and so does tachyllm: length limits are the
        # input processor's.
        backend.no_padding()
        backend.no_truncation()
        config_file = directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        bos_id = _token_id(backend, config.get("bos_token"))
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # Without the flag, the tokenizer.json post-processor decides (Llama 3 adds BOS there).
            with_special = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and with_special[:1] == [bos_id]
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_id=_token_id(backend, config.get("eos_token")),
            add_bos=add_bos,
            chat_template=_hf_chat_template(directory, config),
            pad_token_id=_token_id(backend, config.get("pad_token")),
        )

    def to_json(self) -> str:
        """The tokenizers pipeline as tokenizer.json text (what other tokenizer-aware libraries load)."""
        return self._backend.to_str()

    def to_state(self) -> dict[str, Any]:
        """Everything needed to rebuild this tokenizer with from_state (JSON-serializable)."""
        return {
            "backend": self.to_json(),
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "add_bos": self.add_bos,
            "chat_template": self.chat_template,
            "pad_token_id": self.pad_token_id,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Tokenizer:
        return cls(
            Backend.from_str(state["backend"]),
            bos_token_id=state["bos_token_id"],
            eos_token_id=state["eos_token_id"],
            add_bos=state["add_bos"],
            chat_template=state["chat_template"],
            pad_token_id=state.get("pad_token_id"),  # absent from checkpoint caches written before it was kept
        )

    def with_chat_template(self, chat_template: str) -> Tokenizer:
        """This tokenizer with another chat template; the original (which a checkpoint cache may
        still write out) keeps its own."""
        other = copy.copy(self)
        other.chat_template = chat_template
        return other

    # -- text <-> ids ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) stay whole."""
        # The post-processor is bypassed so BOS handling is uniform across GGUF and HF sources.
        # The batch call lets go of the GIL while it works (encode holds it throughout: no other
        # thread runs while a large prompt is encoded) and skips the offsets nobody reads
        # (measurements: docs/design_measurements.md#tokenizer-gil).
        ids = self._backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:  # add_bos implies an id
            return [self.bos_token_id, *ids]
        return ids

    def encode_pair(self, text: str, pair: str | None = None) -> tuple[list[int], list[int]]:
        """(token ids, token type ids) of `text`, or of the pair (text, pair), as the tokenizer's own
        post-processor frames them (an encoder's [CLS] text [SEP] pair [SEP], type 0 then 1): what
        transformers' tokenizer(text, pair) gives, which encoders and embedding models were trained on."""
        encoding = self._backend.encode(text, pair, add_special_tokens=True)
        return list(encoding.ids), list(encoding.type_ids)

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str:
        """`spaces_between_special_tokens=False` (vLLM's option; it matters only with special tokens
        kept): added tokens are written as their exact text and each run of other tokens is decoded
        on its own, so nothing the decoder adds around a token (SentencePiece's word space) lands
        next to them."""
        if skip_special_tokens or spaces_between_special_tokens:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        parts: list[str] = []
        run: list[int] = []
        for token in ids:
            if token in self._added_texts:
                if run:
                    parts.append(self._backend.decode(run, skip_special_tokens=False))
                    run = []
                parts.append(self._added_texts[token])
            else:
                run.append(token)
        if run:
            parts.append(self._backend.decode(run, skip_special_tokens=False))
        return "".join(parts)

    @cached_property
    def max_token_chars(self) -> int:
        """No token spells more characters of text than this: a vocabulary entry is written with at
        least one character per character it stands for (byte-level BPE: one per byte; SentencePiece:
        "▁" per space, <0xNN> per byte), so a text of c characters takes at least c / this tokens."""
        return max(map(len, self.get_vocab()))

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included."""
        return self._backend.get_vocab(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry for `token_id`, as stored (byte-level tokens keep their Ġ spelling)."""
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary (size {self.vocab_size})")
        return token

    def token_id(self, token: str) -> int | None:
        """The id of the vocabulary entry `token`, as stored (an added token by its text); None if none."""
        return self._backend.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    # -- Hugging Face's spellings, for code written against a transformers tokenizer (vLLM's get_tokenizer) --

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> BatchEncoding:
        """{"input_ids", "attention_mask"} of a text, or a list of each for a list of texts (unpadded)."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return BatchEncoding(input_ids=ids, attention_mask=[1] * len(ids))
        encoded = [self.encode(t, add_special_tokens) for t in text]
        return BatchEncoding(input_ids=encoded, attention_mask=[[1] * len(ids) for ids in encoded])

    def __len__(self) -> int:
        return self.vocab_size

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        return self.id_to_token(ids) if isinstance(ids, int) else [self.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        """None for a token the vocabulary lacks."""
        if isinstance(tokens, str):
            return self._backend.token_to_id(tokens)
        return [self._backend.token_to_id(t) for t in tokens]

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    # -- chat ---------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        *,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        template_vars: dict[str, Any] | None = None,
        tokenize: bool = False,
        **more_vars: Any,
    ) -> str | list[int]:
        """Render `messages` with the model's chat template (or `chat_template`), as transformers does;
        with `tokenize` its token ids (unlike transformers, text is the default).

        `template_vars` and extra keyword arguments become template variables (e.g. Qwen3's enable_thinking).
        `continue_final_message`: the text ends where the last message's content does, so that the
        model continues that message (a prefilled assistant answer) rather than starting a new one.
        """
        import jinja2

        template_vars = {**(template_vars or {}), **more_vars}
        if reserved := sorted(RESERVED_TEMPLATE_VARS & template_vars.keys()):
            raise RequestError(
                f"chat template variables may not set {', '.join(reserved)} (the server sets them)",
                param="chat_template_kwargs",
            )
        text = chat_template if chat_template is not None else self.chat_template
        if text is None:
            raise ConfigError("this model has no chat template; send a plain-text prompt instead of chat messages")
        try:
            rendered = compile_chat_template(text).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self._token_text(self.bos_token_id),
                eos_token=self._token_text(self.eos_token_id),
                **template_vars,
            )
        except jinja2.TemplateError as exc:
            # raise_exception() in a template rejects the conversation (e.g. roles not alternating).
            raise RequestError(f"chat template rejected the messages: {exc}") from exc
        if continue_final_message:
            rendered = _cut_after_final_message(rendered, messages)
        # The template spells out its special tokens; adding a BOS again would double it.
        return self.encode(rendered, add_special_tokens=False) if tokenize else rendered

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.decode([token_id], skip_special_tokens=False)


# -- GGUF vocabulary -> tokenizers pipeline -------------------------------------------------------


def _byte_level_bpe(reader: GGUFReader, tokens: list[str]) -> Backend:
    """GPT-2 style byte-level BPE: GGUF stores tokens already in the byte-to-unicode alphabet."""
    pre = gguf_value(reader, "tokenizer.ggml.pre", "default")
    if pre not in _BYTE_LEVEL_PRE:
        raise ModelLoadError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: {', '.join(_BYTE_LEVEL_PRE)})")
    splits, ignore_merges = _BYTE_LEVEL_PRE[pre]
    merges = gguf_value(reader, "tokenizer.ggml.merges")
    if merges is None:
        raise ModelLoadError("GGUF byte-level BPE vocabulary has no tokenizer.ggml.merges")
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = Backend(
        models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], ignore_merges=ignore_merges)
    )
    if splits == (_GPT2_SPLIT,):
        # ByteLevel's built-in regex is exactly the GPT-2 one.
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(reader: GGUFReader, tokens: list[str], types: list[int]) -> Backend:
    """SentencePiece BPE with byte fallback (<0xNN> tokens), as HF's Llama/Mistral tokenizers."""
    merges = gguf_value(reader, "tokenizer.ggml.merges")
    if merges is not None:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        scores = gguf_value(reader, "tokenizer.ggml.scores")
        if scores is None:
            raise ModelLoadError("GGUF SentencePiece vocabulary has neither merges nor scores")
        pairs = _merges_from_scores(tokens, scores, types)
    unk_id = gguf_value(reader, "tokenizer.ggml.unknown_token_id", 0)
    backend = Backend(
        models.BPE(
            vocab={token: i for i, token in enumerate(tokens)},
            merges=pairs,
            unk_token=tokens[unk_id],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    # llama.cpp prefixes a space to every run of text that starts the input or follows a special
    # token; a normalizer (applied per segment between added tokens) does the same.
    space_prefix = gguf_value(reader, "tokenizer.ggml.add_space_prefix", True)
    to_spm = normalizers.Replace(" ", _SPM_SPACE)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPM_SPACE), to_spm]) if space_prefix else to_spm
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece merges the highest-scoring adjacent pair first; as BPE ranks, every split of a
    normal token into two vocabulary pieces becomes a merge ranked by the token's score."""
    vocab = {token: i for i, token in enumerate(tokens)}
    ranked = []
    for index, (piece, score, kind) in enumerate(zip(tokens, scores, types)):
        if kind != _NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, index, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _register_added_tokens(backend: Backend, tokens: list[str], types: list[int]) -> None:
    """Control (and unknown) tokens become special added tokens, user-defined ones plain added
    tokens: both are matched whole in the input, as llama.cpp does, but only special ones are
    dropped by decode(skip_special_tokens=True) -- the same split HF makes (Qwen3's <think> is
    user-defined and must survive decoding)."""
    kinds = list(zip(tokens, types))
    special = [AddedToken(t, special=True, normalized=False) for t, k in kinds if k in (_CONTROL, _UNKNOWN)]
    plain = [AddedToken(t, special=False, normalized=False) for t, k in kinds if k == _USER_DEFINED]
    backend.add_special_tokens(special)
    backend.add_tokens(plain)


# -- HF helpers -----------------------------------------------------------------------------------


def _token_id(backend: Backend, token: str | dict | None) -> int | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return None if token is None else backend.token_to_id(token)


def _hf_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    # Newer transformers versions save the template to its own file instead of tokenizer_config.json.
    template_file = directory / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        # Older multi-template form: [{"name": "default", "template": ...}, {"name": "tool_use", ...}].
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default")
    return template


def _cut_after_final_message(rendered: str, messages: list[dict[str, Any]]) -> str:
    """The rendered conversation up to the end of the last message's content (transformers' rule:
    its last occurrence; a template that strips the content's whitespace is allowed for)."""
    final = messages[-1]["content"] if messages else None
    if not isinstance(final, str) or not final.strip() or final.strip() not in rendered:
        raise RequestError(
            "continue_final_message: the final message's content does not appear in the rendered chat template",
            param="messages",
        )
    at = rendered.rindex(final.strip())
    if rendered[at : at + len(final.lstrip())] == final.lstrip():
        return rendered[: at + len(final.lstrip())]
    return rendered[: at + len(final.strip())]
