"""SpeculativeConfig: vLLM's `speculative_config` dict, validated.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": PATH | "self:int4" | "self:layers=N", "num_speculative_tokens": 4}
    {"method": "suffix", "num_speculative_tokens": 24, "suffix_decoding_max_tree_depth": 24,
     "suffix_decoding_max_cached_requests": 1000, "suffix_decoding_max_spec_factor": 1.0,
     "suffix_decoding_min_token_prob": 0.1}

A draft model file also takes "quantization" (int8, int4, awq, gguf or none; unset: the target's
--quantization where it applies to the draft's file), and a draft model (a file or "self:int4")
"draft_vocab_size": N, the size of the shortlist its LM head computes (the N lowest token ids, which
a BPE vocabulary gives its most frequent tokens, plus the special tokens; EAGLE-3's name). Output
stays exactly the target's: the draft only proposes. Common keys: "disable_by_batch_size" (no
speculation while more sequences than this are running) and "adaptive" (default true: speculate,
and pick how many tokens, only where the measured costs and acceptance say it is faster).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from typing import Any

from tachyllm.errors import ConfigError
from tachyllm.option_values import QUANTIZATION_METHODS

METHODS = ("ngram", "draft_model", "suffix")
# Suffix drafts grow with the match behind them, so they may be longer than the other methods'.
MAX_SPECULATIVE_TOKENS = {"suffix": 32}
DEFAULT_MAX_SPECULATIVE_TOKENS = 16
_SELF_LAYERS = re.compile(r"self:layers=(\d+)")


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft_model only
    quantization: str | None = None  # a draft model file's weights; None = as the target's
    prompt_lookup_max: int = 4  # ngram only
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = None
    adaptive: bool = True
    draft_vocab_size: int | None = None  # draft_model only; None: the whole vocabulary
    # suffix only (vLLM's keys): match + draft length bound, finished sequences whose outputs the
    # global tree keeps, draft length per matched token, least probability of a whole draft.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    @classmethod
    def from_dict(cls, options: dict[str, Any] | str) -> SpeculativeConfig:
        if isinstance(options, str):
            try:
                options = json.loads(options)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(options, dict):
            raise ConfigError(f"speculative_config must be a dict / JSON object, got {type(options).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(
                f"speculative_config: unknown key(s) {', '.join(unknown)}; accepted: {', '.join(sorted(known))}"
            )
        if "method" not in options and options.get("model"):
            options = {**options, "method": "draft_model"}  # vLLM infers the method from a model
        if options.get("method") == "suffix" and "num_speculative_tokens" not in options:
            # vLLM's default: the tree's depth, which bounds a draft anyway (the length is adaptive).
            depth = options.get("suffix_decoding_max_tree_depth")
            if not isinstance(depth, int):  # the default, or a bad value that validation reports
                depth = cls.suffix_decoding_max_tree_depth
            options = {**options, "num_speculative_tokens": min(depth, MAX_SPECULATIVE_TOKENS["suffix"])}
        if "method" not in options or "num_speculative_tokens" not in options:
            raise ConfigError("speculative_config needs 'method' and 'num_speculative_tokens'")
        config = cls(**options)
        config._validate()
        return config

    def _validate(self) -> None:
        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if self.method not in METHODS:
            raise ConfigError(f"speculative_config method must be one of {', '.join(METHODS)}, got {self.method!r}")
        most = MAX_SPECULATIVE_TOKENS.get(self.method, DEFAULT_MAX_SPECULATIVE_TOKENS)
        if not is_int(self.num_speculative_tokens) or not 1 <= self.num_speculative_tokens <= most:
            raise ConfigError(
                f"num_speculative_tokens must be an integer in [1, {most}], got {self.num_speculative_tokens!r}"
            )
        if self.disable_by_batch_size is not None and (
            not is_int(self.disable_by_batch_size) or self.disable_by_batch_size < 1
        ):
            raise ConfigError(f"disable_by_batch_size must be an integer >= 1, got {self.disable_by_batch_size!r}")
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"adaptive must be true or false, got {self.adaptive!r}")
        if self.method == "suffix":
            self._validate_suffix()
        elif self.method == "ngram":
            if self.model is not None:
                raise ConfigError("speculative_config: method 'ngram' takes no 'model'")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (is_int(lo) and is_int(hi) and 1 <= lo <= hi):
                raise ConfigError(f"need integers 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r}, {hi!r}")
        else:
            if not isinstance(self.model, str) or not self.model:
                raise ConfigError(
                    "speculative_config: method 'draft_model' needs 'model' (a path, 'self:int4' or 'self:layers=N')"
                )
            if self.model.startswith("self:") and self.model != "self:int4" and self.self_layers is None:
                raise ConfigError(f"unknown self-draft {self.model!r}; accepted: 'self:int4', 'self:layers=N'")
        if self.draft_vocab_size is not None:
            if self.method != "draft_model" or self.self_layers is not None:
                raise ConfigError(
                    "speculative_config 'draft_vocab_size' applies to a draft model with an LM head of its own "
                    f"(a file or 'self:int4'), not to {self.model if self.method == 'draft_model' else self.method!r}"
                )
            if not is_int(self.draft_vocab_size) or self.draft_vocab_size < 1:
                raise ConfigError(f"draft_vocab_size must be an integer >= 1, got {self.draft_vocab_size!r}")
        if self.quantization is not None:
            if self.method != "draft_model" or (self.model or "").startswith("self:"):
                raise ConfigError(
                    "speculative_config 'quantization' applies to a draft model file, not to "
                    f"{self.model if self.method == 'draft_model' else self.method!r}"
                )
            accepted = ("none", *QUANTIZATION_METHODS)
            if self.quantization not in accepted:
                raise ConfigError(
                    f"speculative_config quantization must be one of {', '.join(accepted)}, got {self.quantization!r}"
                )

    def _validate_suffix(self) -> None:
        if self.model is not None:
            raise ConfigError("speculative_config: method 'suffix' takes no 'model'")
        depth, cached = self.suffix_decoding_max_tree_depth, self.suffix_decoding_max_cached_requests
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if not (isinstance(depth, int) and not isinstance(depth, bool) and depth >= 2):
            # A match needs one token and a draft another: a depth-1 tree never proposes.
            raise ConfigError(f"suffix_decoding_max_tree_depth must be an integer >= 2, got {depth!r}")
        if not (isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0):
            raise ConfigError(f"suffix_decoding_max_cached_requests must be an integer >= 0, got {cached!r}")
        if not (isinstance(factor, (int, float)) and not isinstance(factor, bool) and 0 < factor < float("inf")):
            raise ConfigError(f"suffix_decoding_max_spec_factor must be a number > 0, got {factor!r}")
        if not (isinstance(prob, (int, float)) and not isinstance(prob, bool) and 0 <= prob <= 1):
            raise ConfigError(f"suffix_decoding_min_token_prob must be a number in [0, 1], got {prob!r}")

    @property
    def self_layers(self) -> int | None:
        match = _SELF_LAYERS.fullmatch(self.model or "")
        return int(match.group(1)) if match else None
