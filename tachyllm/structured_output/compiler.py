"""StructuredOutputsParams -> a compiled llguidance grammar, checked, cached by constraint.

Compiling (building the grammar's lexer over the vocabulary) can take from a millisecond to about a
second for a large schema, so it runs where requests are checked (the server's worker threads, the
caller of LLM.generate), never in the engine's step loop, and a constraint compiled once is reused:
each sequence starts from a copy of the compiled matcher.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance

from tachyllm.loading.tokenizer import Tokenizer
from tachyllm.sampling_params import StructuredOutputsParams
from tachyllm.structured_output.grammar import Grammar

CACHE_SIZE = 256  # compiled constraints kept (least recently used dropped first)
# JSON as models write it ({"a": 1, "b": [2, 3]}), with no free whitespace: a model cannot spend
# its tokens on blank lines inside an object.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A constraint that cannot be compiled: an invalid or unsupported schema, regex or grammar."""


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
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", list(params.choice))
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
    except json.JSONDecodeError as e:
        raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
    except RecursionError:
        raise GrammarError("the JSON schema is nested too deeply") from None
    except (ValueError, TypeError) as e:
        raise GrammarError(str(e)) from None


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer; any thread may call it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        # Bitmasks cover the larger of the model's and the tokenizer's vocabularies (the sampler
        # reads only the model's); llguidance refuses a size below the tokenizer's.
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self._eos_token_ids = eos_token_ids
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        """Pickled (a replica's InputProcessor sent to the Ray Serve ingress) without its cache and
        llguidance objects, which the receiving process builds again when it needs them."""
        return {"tokenizer": self._tokenizer, "vocab_size": self.vocab_size, "eos": self._eos_token_ids}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["tokenizer"], state["vocab_size"], state["eos"])

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
                    raise GrammarError(f"structured outputs cannot use this model's tokenizer: {e}") from None
            return self._ll_tokenizer

    def check(self, params: StructuredOutputsParams) -> None:
        """Raises GrammarError if `params` would not compile; cheaper than compiling (no lexer over the
        vocabulary) and caches nothing."""
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_source(params))
        if is_error:
            raise GrammarError(messages[0] if messages else "invalid grammar")

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of `params` (from the cache when compiled before); raises GrammarError."""
        key = params.key()
        with self._lock:
            if (hit := self._cache.get(key)) is not None:
                self._cache.move_to_end(key)
                return hit
        source = grammar_source(params)
        # Building the matcher checks the grammar too, and lets go of the GIL while it works.
        matcher = llguidance.LLMatcher(self.ll_tokenizer, source, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        compiled = CompiledGrammar(matcher, self.vocab_size)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled
