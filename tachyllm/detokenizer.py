"""Streaming detokenization: turn each new output token into the text it adds, in O(window) time."""

from __future__ import annotations

from collections.abc import Sequence

from tachyllm.loading.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Tokens decoded before the unseen ones, so the first new token is decoded in context (its leading
# space, SentencePiece's stripped prefix space) exactly as in a full decode.
_CONTEXT_TOKENS = 4
# A UTF-8 character has at most 4 bytes, and every token at least one, so a character still
# arriving has its bytes in at most the last 3 tokens.
_MAX_UNFINISHED = 3


class IncrementalDetokenizer:
    """Yields the text each batch of new tokens adds, never emitting half of a multi-byte character.

    Prefix-offset technique: only a window of recent tokens is decoded, starting at a prefix offset
    a few tokens back. The read offset is kept in characters of the window's text (`_emitted`)
    rather than in tokens, so the settled part of a batch is emitted even when a character at its
    end is unfinished. Settled means: the longest window prefix whose text does not end in U+FFFD.
    Byte-level BPE shows an unfinished character as one U+FFFD, and SentencePiece byte fallback
    turns a whole run of byte tokens into U+FFFD until its last character completes, so neither
    is emitted early. The window slides forward at a clean cut once it is long, keeping each call
    to a bounded number of decoded tokens.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._spaces_between_special = spaces_between_special_tokens
        self._window = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # The prompt tail is context only: its text counts as already emitted.
        self._emitted = len(self._decode(self._window))
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._pieces)

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Append output tokens; return the newly complete text (possibly "")."""
        self._window.extend(new_ids)
        end, prefix_text, settled = self._settled_prefix()
        delta = prefix_text[self._emitted : settled] if settled > self._emitted else ""
        self._emitted = max(self._emitted, settled)
        if delta:
            self._pieces.append(delta)
        if end > 2 * _CONTEXT_TOKENS:
            self._slide(end, prefix_text)
        return delta

    def _settled_prefix(self) -> tuple[int, str, int]:
        """(end, text of window[:end], how many of its characters are final)."""
        decoded = self._decode(self._window)
        size = len(self._window)
        for end in range(size, max(size - _MAX_UNFINISHED, 0) - 1, -1):
            text = decoded if end == size else self._decode(self._window[:end])
            if not text.endswith(_REPLACEMENT):
                return end, text, len(text)
        # No cut in the last tokens ends cleanly, so the trailing U+FFFD stand for invalid bytes,
        # not a character in progress; only the last few could still change.
        held = min(len(decoded) - len(decoded.rstrip(_REPLACEMENT)), _MAX_UNFINISHED)
        return size, decoded, len(decoded) - held

    def _slide(self, end: int, prefix_text: str) -> None:
        """Drop leading tokens, keeping a few before `end`, at a clean cut: the kept tokens must
        decode to exactly the tail of `prefix_text` (no character, or byte-fallback run, split
        across the cut) and the dropped text must be emitted already. Four consecutive cut points
        always include a character boundary."""
        for keep in range(_CONTEXT_TOKENS, _CONTEXT_TOKENS + 4):
            cut = end - keep
            kept_text = self._decode(self._window[cut:end])
            dropped_chars = len(prefix_text) - len(kept_text)
            if prefix_text.endswith(kept_text) and self._emitted >= dropped_chars:
                self._window = self._window[cut:]
                self._emitted -= dropped_chars
                return

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, self._skip_special, self._spaces_between_special)
