"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names and defaults)."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20  # the default of --max-logprobs, vLLM's and OpenAI's bound on top_logprobs
# A temperature below this is greedy: dividing logits by it would overflow float32 (vLLM's rule).
GREEDY_TEMPERATURE = 1e-5
LOGIT_BIAS_RANGE = 100.0  # OpenAI's bound on each logit_bias value


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a running request holds (vLLM's names)."""

    CUMULATIVE = 0  # everything so far: each output copies the whole completion (O(tokens so far))
    DELTA = 1  # only what is new since the previous output: streaming
    FINAL_ONLY = 2  # nothing until the request finishes, then everything


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's names): exactly one of a JSON schema, any JSON object, a
    regular expression, one of a list of strings, or a grammar (Lark, or GBNF / EBNF as llama.cpp
    writes it). Enforced token by token with llguidance (docs/structured_outputs.md)."""

    json: str | dict[str, Any] | None = None  # a JSON schema (as a dict or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None  # any JSON object

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "structured outputs need exactly one of json, regex, choice, grammar, json_object; "
                f"got {', '.join(given) or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured outputs json must be a JSON schema (object or text), got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured outputs {name} must be a non-empty string, got {value!r}")
        choice = self.choice
        if choice is not None and (
            not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) for c in choice)
        ):
            raise ValueError(f"structured outputs choice must be a non-empty list of strings, got {self.choice!r}")

    @property
    def kind(self) -> str:
        """Which constraint: "json", "json_object", "regex", "choice" or "grammar"."""
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints have equal keys (the compiled-grammar cache's key)."""
        kind = self.kind
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, json.dumps(list(self.choice or ()))
        if kind == "json" and isinstance(self.json, dict):
            return kind, json.dumps(self.json)  # key order kept: the grammar writes properties in it
        return kind, getattr(self, kind)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # >1 discourages tokens seen in prompt or output (multiplicative, HF style)
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (plus the chosen token's)
    # top-N logprobs per prompt token (plus the prompt token's own), given the tokens before it; the
    # first prompt token has none. Computed in the prefill's forward (vLLM's prompt_logprobs).
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> value added to its logit, in [-100, 100]
    skip_special_tokens: bool = True
    # With special tokens kept: False writes consecutive special tokens with nothing decoded between them.
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # a stop string that ends the output is part of its text
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None  # only these tokens may be generated
    # Words never generated (vLLM's rule): the last token of a word's tokens is banned wherever the output
    # ends with the tokens before it; a one-token word is banned everywhere. The InputProcessor tokenizes
    # each word, as written and after a space, into bad_words_token_ids.
    bad_words: list[str] | None = None
    # Keep only the last N prompt tokens (left truncation); -1: the last max_model_len.
    truncate_prompt_tokens: int | None = None
    stop_strings: list[str] = field(init=False, repr=False)
    bad_words_token_ids: list[list[int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {t: float(v) for t, v in self.logit_bias.items()} if self.logit_bias else None
        self.allowed_token_ids = list(self.allowed_token_ids) if self.allowed_token_ids is not None else None
        self.bad_words = list(self.bad_words) if self.bad_words else None
        self.bad_words_token_ids = []

    def _validate(self) -> None:
        def bad(name: str, value: object, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {value!r}")

        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x: object) -> bool:  # finite: inf or NaN would reach the logits
            return is_int(x) or (isinstance(x, float) and math.isfinite(x))

        if not is_int(self.n) or self.n < 1:
            raise bad("n", self.n, "must be an integer >= 1")
        if not is_num(self.temperature) or self.temperature < 0:
            raise bad("temperature", self.temperature, "must be a finite number >= 0")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", self.top_k, "must be -1 (disabled) or an integer >= 1")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", self.repetition_penalty, "must be > 0")
        if not is_num(self.presence_penalty) or not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        if not is_num(self.frequency_penalty) or not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", self.seed, "must be an integer or None")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"must be an integer in [0, max_tokens={self.max_tokens}]")
        # The upper bound is the engine's (--max-logprobs): the InputProcessor checks it.
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", self.logprobs, "must be an integer >= 0 or None")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", self.prompt_logprobs, "must be an integer >= 0 or None")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
            raise bad("stop", self.stop, "must be a non-empty string or a list of non-empty strings")
        ids = self.stop_token_ids or []
        if not isinstance(ids, (list, tuple)) or not all(is_int(t) and t >= 0 for t in ids):
            raise bad("stop_token_ids", self.stop_token_ids, "must be a list of non-negative token ids")
        bias = self.logit_bias or {}
        if not isinstance(bias, dict) or not all(
            is_int(t) and t >= 0 and is_num(v) and abs(v) <= LOGIT_BIAS_RANGE for t, v in bias.items()
        ):
            why = f"must map non-negative token ids to numbers in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]"
            raise bad("logit_bias", self.logit_bias, why)
        flags = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output")
        for name in flags:
            if not isinstance(getattr(self, name), bool):
                raise bad(name, getattr(self, name), "must be a bool")
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not isinstance(allowed, (list, tuple)) or not allowed or not all(is_int(t) and t >= 0 for t in allowed)
        ):
            raise bad("allowed_token_ids", allowed, "must be a non-empty list of non-negative token ids or None")
        words = self.bad_words
        if words is not None and (
            not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words)
        ):
            raise bad("bad_words", words, "must be a list of words (non-blank strings) or None")
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (not is_int(truncate) or (truncate < 1 and truncate != -1)):
            raise bad("truncate_prompt_tokens", truncate, "must be an integer >= 1, -1 (max_model_len) or None")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", self.structured_outputs, "must be a StructuredOutputsParams or None")

    def token_ids_at_or_above(self, vocab_size: int) -> list[tuple[str, int]]:
        """(field, id) of every token id these params name that a vocabulary of vocab_size lacks."""
        named = [("stop_token_ids", t) for t in self.stop_token_ids or ()]
        named += [("logit_bias", t) for t in self.logit_bias or {}]
        named += [("allowed_token_ids", t) for t in self.allowed_token_ids or []]
        return [(name, t) for name, t in named if t >= vocab_size]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def restricts_tokens(self) -> bool:
        """allowed_token_ids or bad words remove tokens from the row's choices (Sampler.process)."""
        return self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
