"""One sequence's grammar state (an llguidance matcher) and the token bitmasks of a step's rows.

A bitmask row holds one bit per vocabulary token (32 per int32 word, token t at bit t % 32 of word
t // 32): 1 = the grammar allows the token next. The scheduler fills the rows of every constrained
sequence a step samples in one call (llguidance computes them in parallel, without the GIL); the
sampler masks the logits with them.
"""

from __future__ import annotations

import llguidance
import torch

# llguidance may follow a message with its parser state, the grammar or a Rust backtrace, each opening
# with one of these tags: internals (and the client's whole grammar again) that no answer should carry.
_DUMP_TAGS = ("<state>", "<non-verbose/>", "<backtrace>", "<grammar>")
MAX_ERROR_LINES = 8  # a diagnostic's lines kept: the message, the offending source line and its caret
MAX_ERROR_LINE_CHARS = 200  # a longer line (an echoed one-line schema) is cut


def clean_error(message: str) -> str:
    """An llguidance error message as a client may read it: the diagnostic without the dumps that may follow
    it, long lines cut; a Rust panic (an internal limit the constraint ran into) as one sentence."""
    lines: list[str] = []
    for line in message.strip().splitlines():
        if line.lstrip().startswith(_DUMP_TAGS) or len(lines) == MAX_ERROR_LINES:
            break
        lines.append(line if len(line) <= MAX_ERROR_LINE_CHARS else line[:MAX_ERROR_LINE_CHARS] + " ...")
    if lines and lines[0].startswith("panic: "):
        return f"the grammar engine gave up on this constraint ({lines[0].removeprefix('panic: ')}); make it smaller"
    if lines in (["NoExtension"], ["NoExtensionBias"]):  # a bare stop reason: the grammar cannot go on
        return "no output can complete the constraint from here (a rule that never ends, such as root ::= root)"
    return "\n".join(lines).rstrip() or "the grammar engine refused this constraint"


class Grammar:
    """Where one sequence is in its grammar. Only accepted tokens advance it: drafts are checked
    (`valid_prefix`) and masked for without being consumed, so a rejected draft needs no rollback."""

    __slots__ = ("_matcher", "vocab_size")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def accept(self, token: int) -> bool:
        """Advances past `token`; False when the grammar does not allow it (the matcher is then in error)."""
        return self._matcher.consume_token(token)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the first, the grammar allows in turn from here."""
        return self._matcher.validate_tokens(tokens) if tokens else 0

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more (EOS aside): the sequence ends here."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        """Why the grammar failed ("" while it has not): a limit of the grammar engine it ran into."""
        error = self._matcher.get_error()
        return clean_error(error) if error else ""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class BitmaskFiller:
    """Fills the bitmask rows of a step: for each grammar, its next position and one position after
    each of its draft tokens."""

    def __init__(self, vocab_size: int, num_threads: int | None = None) -> None:
        self.words = bitmask_words(vocab_size)
        self._executor = llguidance.LLExecutor(num_threads)

    def fill(self, rows: list[tuple[Grammar, list[int], int]]) -> list[torch.Tensor]:
        """Per (grammar, valid drafts, positions): an int32 tensor [positions, words] of allowed tokens.
        The valid drafts are the first of the sequence's drafts, all allowed in turn; positions beyond
        the row after them (after a refused draft, which verification rejects) stay all zero."""
        counts = [positions for _, _, positions in rows]
        masks = torch.zeros(sum(counts), self.words, dtype=torch.int32)
        plain, drafted, first = [], [], 0
        for (grammar, drafts, _), count in zip(rows, counts):
            if drafts:
                drafted.append((grammar._matcher, first, list(drafts)))
            else:
                plain.append((grammar._matcher, first))
            first += count
        # llguidance refuses an empty job list, and a job with no drafts on the draft-token call.
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, masks.data_ptr(), self.words * 4, len(masks))
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                drafted, masks.data_ptr(), self.words * 4, len(masks)
            )
        return list(masks.split(counts))
