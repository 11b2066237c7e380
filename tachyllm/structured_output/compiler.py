"""StructuredOutputsParams -> a compiled llguidance grammar, checked, cached by constraint.

Compiling (building the grammar's lexer over the vocabulary) can take from a millisecond to about a
second for a large schema, so it runs where requests are checked (the server's worker threads, the
caller of LLM.generate), never in the engine's step loop, and a constraint compiled once is reused:
each sequence starts from a copy of the compiled matcher.

What a constraint may cost is bounded (ConstraintLimits): its size is checked before anything is
built, and a request waits for its compile at most the compile timeout. A compile cannot be stopped
once llguidance runs it, so one that takes longer goes on in the background, alone (requests asking
for the same constraint wait for that compile rather than start another), and its result is cached.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import numpy as np

from tachyllm.loading.tokenizer import Tokenizer
from tachyllm.sampling_params import StructuredOutputsParams
from tachyllm.structured_output.grammar import Grammar, clean_error
from tachyllm.structured_output.json_schema import without_undeclared_keys

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared in llguidance's stubs only

CACHE_SIZE = 256  # compiled constraints (and refused ones) kept, least recently used dropped first
# JSON as models write it ({"a": 1, "b": [2, 3]}), with no free whitespace: a model cannot spend
# its tokens on blank lines inside an object.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# Without verbose errors llguidance's messages leave out its parser state and the grammar.
PARSER_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


class GrammarError(ValueError):
    """A constraint that cannot be used: an invalid or unsupported schema, regex or grammar, one that
    fails at its first token, or one beyond ConstraintLimits."""


@dataclass(frozen=True)
class ConstraintLimits:
    """What one constraint may cost: the bytes of its text (the JSON schema, regex, grammar or choices)
    and the seconds a request waits for its compile (EngineConfig's max_constraint_bytes and
    constraint_compile_timeout)."""

    max_bytes: int = 256 << 10
    compile_timeout: float = 10.0


class CompiledGrammar:
    """A checked grammar for one constraint; `start()` gives a sequence its own state in it."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size

    def start(self) -> Grammar:
        return Grammar(self._matcher.deep_copy(), self._vocab_size)


def grammar_source(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) of a constraint; raises GrammarError."""
    kind = params.kind
    try:
        if kind == "json":
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
            if not isinstance(schema, dict):
                raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
            return llguidance.LLMatcher.grammar_from_json_schema(without_undeclared_keys(schema), defaults=JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        # params.kind names the field that is set.
        if kind == "regex":
            assert params.regex is not None
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            # One terminal, as a JSON schema's enum is: its strings go into the lexer, where any number
            # of them fits, not into one grammar rule of that many alternatives (llguidance allows 2000).
            assert params.choice is not None
            choices = " | ".join(json.dumps(choice) for choice in params.choice)
            return llguidance.LLMatcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {choices}")
        assert params.grammar is not None
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
    except json.JSONDecodeError as e:
        raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
    except RecursionError:
        raise GrammarError("the JSON schema is nested too deeply") from None
    except (ValueError, TypeError) as e:
        raise GrammarError(clean_error(str(e))) from None


def first_token_error(matcher: llguidance.LLMatcher, eos_token_ids: list[int]) -> str | None:
    """Why a freshly built matcher cannot start an output, if it cannot. A grammar that checks out can
    still fail at its first token: its first mask allows nothing (no output completes it), or the first
    token it allows trips a limit of llguidance (forced bytes that never end, a lexer or rule too large
    to build). Computing that mask and consuming that token, once, finds these where a request is checked,
    instead of in the engine's step. The mask is computed on `matcher` itself, where every sequence
    starts; the token is consumed by a copy."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    if matcher.is_error():
        return matcher.get_error()
    allowed = np.flatnonzero(bits)
    allowed = allowed[~np.isin(allowed, eos_token_ids)]
    if not len(allowed):  # nothing but EOS: the empty output, which is complete
        return None
    probe = matcher.deep_copy()
    if not probe.consume_token(int(allowed[0])) or probe.is_error():
        return probe.get_error()
    return None


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer; any thread may call it."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: list[int],
        limits: ConstraintLimits | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        # Bitmasks cover the larger of the model's and the tokenizer's vocabularies (the sampler
        # reads only the model's); llguidance refuses a size below the tokenizer's.
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self._eos_token_ids = eos_token_ids
        self.limits = limits or ConstraintLimits()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        # A constraint's compiled grammar, or why it cannot be used (a refusal is as deterministic as a
        # compile, and a client retrying a refused constraint would otherwise compile it again each time).
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar | GrammarError] = OrderedDict()
        self._compiling: dict[tuple[str, str], Future] = {}  # compiles under way, by constraint
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        """Pickled (a replica's InputProcessor sent to the Ray Serve ingress) without its cache and
        llguidance objects, which the receiving process builds again when it needs them."""
        return {
            "tokenizer": self._tokenizer,
            "vocab_size": self.vocab_size,
            "eos": self._eos_token_ids,
            "limits": self.limits,
        }

    def __setstate__(self, state: dict) -> None:
        GrammarCompiler.__init__(self, state["tokenizer"], state["vocab_size"], state["eos"], state["limits"])

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """The vocabulary as llguidance sees it, built once (from the same tokenizers pipeline we run)."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                try:
                    self._ll_tokenizer = llguidance.LLTokenizer(
                        self._tokenizer.to_json(), n_vocab=self.vocab_size, eos_token=self._eos_token_ids or None
                    )
                except ValueError as e:
                    raise GrammarError(
                        f"structured outputs cannot use this model's tokenizer: {clean_error(str(e))}"
                    ) from None
            return self._ll_tokenizer

    def lark_text(self, text: str) -> str:
        """A Lark expression that matches `text` as this model writes it. Where `text` is one added token
        (Hermes' `<tool_call>`), that is a reference to the token, `<[id]>`: llguidance counts every added
        token as special, whatever the tokenizer's flag, and matches a special token only by reference,
        never as the bytes it spells. Anything else is a string literal."""
        token = self._tokenizer.token_id(text)
        try:
            special = token is not None and self.ll_tokenizer.is_special_token(token)
        except GrammarError:  # a tokenizer llguidance refuses: compiling the grammar says so
            special = False
        return f"<[{token}]>" if special else json.dumps(text)  # JSON's escapes are Lark's

    def _check_size(self, text: str) -> None:
        """Raises GrammarError if a constraint's text (its key's) is larger than the limit allows."""
        size = len(text.encode())
        if size > self.limits.max_bytes:
            raise GrammarError(
                f"the constraint is {size} bytes, above the limit of {self.limits.max_bytes} bytes "
                "(max_constraint_bytes, --max-constraint-bytes)"
            )

    def check(self, params: StructuredOutputsParams) -> None:
        """Raises GrammarError if `params` would not compile; cheaper than compiling (no lexer over the
        vocabulary) and caches nothing."""
        self._check_size(params.key()[1])
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar_source(params), limits=PARSER_LIMITS
        )
        if is_error:
            raise GrammarError(clean_error(messages[0]) if messages else "invalid grammar")

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of `params` (from the cache when compiled before); raises GrammarError,
        also when the compile takes longer than the limit (it goes on, and is cached when done)."""
        key = params.key()
        self._check_size(key[1])
        with self._lock:
            if (hit := self._cache.get(key)) is not None:
                self._cache.move_to_end(key)
                if isinstance(hit, GrammarError):
                    raise GrammarError(str(hit))
                return hit
            compiling = self._compiling.get(key)
            if compiling is None:
                compiling = self._compiling[key] = Future()
                worker = threading.Thread(
                    target=self._compile_into, args=(params, key, compiling), name="tachy-grammar", daemon=True
                )
                worker.start()
        timeout = self.limits.compile_timeout
        try:
            return compiling.result(timeout)
        except TimeoutError:
            raise GrammarError(
                f"the constraint did not compile within {timeout:g} s "
                "(constraint_compile_timeout, --constraint-compile-timeout)"
            ) from None

    def _compile_into(self, params: StructuredOutputsParams, key: tuple[str, str], result: Future) -> None:
        """Compiles in a thread of its own (a daemon: a compile still running never holds up an exit),
        caches the outcome and hands it to the requests waiting for it."""
        try:
            outcome: CompiledGrammar | GrammarError = self._build(params)
        except GrammarError as e:
            outcome = e
        except BaseException as e:  # not the constraint's fault: nothing is cached
            with self._lock:
                del self._compiling[key]
            result.set_exception(e)
            return
        with self._lock:
            del self._compiling[key]
            self._cache[key] = outcome
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        if isinstance(outcome, GrammarError):
            result.set_exception(outcome)
        else:
            result.set_result(outcome)

    def _build(self, params: StructuredOutputsParams) -> CompiledGrammar:
        source = grammar_source(params)
        # Building the matcher checks the grammar too, and lets go of the GIL while it works.
        matcher = llguidance.LLMatcher(self.ll_tokenizer, source, log_level=0, limits=PARSER_LIMITS)
        if matcher.is_error():
            raise GrammarError(clean_error(matcher.get_error()))
        if (error := first_token_error(matcher, self._eos_token_ids)) is not None:
            raise GrammarError(f"it fails at its first token: {clean_error(error)}")
        return CompiledGrammar(matcher, self.vocab_size)
