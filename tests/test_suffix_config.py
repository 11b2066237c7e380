"""Suffix decoding's configuration: vLLM's keys and defaults, every bad value refused with one clear
error, and the method refused at engine start where the C++ kernels (its trees) are unavailable."""

from __future__ import annotations

import pytest
from helpers.engine import tiny_llm
from helpers.spec_decode import SUFFIX

from tachyllm.errors import ConfigError
from tachyllm.spec_decode import suffix_tree
from tachyllm.speculative_config import SpeculativeConfig


def test_config_takes_vllm_suffix_keys_and_defaults():
    config = SpeculativeConfig.from_dict('{"method": "suffix"}')
    assert config.num_speculative_tokens == config.suffix_decoding_max_tree_depth == 24
    assert (config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob) == (1.0, 0.1)
    config = SpeculativeConfig.from_dict(
        {"method": "suffix", "num_speculative_tokens": 32, "suffix_decoding_max_tree_depth": 64,
         "suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_spec_factor": 2,
         "suffix_decoding_min_token_prob": 0}
    )  # fmt: skip
    assert config.num_speculative_tokens == 32 and config.suffix_decoding_max_cached_requests == 0
    assert (
        SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_tree_depth": 64}).num_speculative_tokens
        == 32
    )


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_speculative_tokens": 33}, r"num_speculative_tokens must be an integer in \[1, 32\]"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"suffix_decoding_max_tree_depth": 1}, "suffix_decoding_max_tree_depth must be an integer >= 2"),
        ({"suffix_decoding_max_tree_depth": "24"}, "suffix_decoding_max_tree_depth"),
        ({"suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests"),
        ({"suffix_decoding_max_cached_requests": 1.5}, "suffix_decoding_max_cached_requests"),
        ({"suffix_decoding_max_spec_factor": 0}, "suffix_decoding_max_spec_factor must be a number > 0"),
        ({"suffix_decoding_max_spec_factor": float("inf")}, "suffix_decoding_max_spec_factor"),
        ({"suffix_decoding_min_token_prob": 1.5}, r"suffix_decoding_min_token_prob must be a number in \[0, 1\]"),
        ({"suffix_decoding_min_token_prob": True}, "suffix_decoding_min_token_prob"),
        ({"model": "x"}, "method 'suffix' takes no 'model'"),
        ({"suffix_decoding_max_depth": 3}, "unknown key"),
    ],
)
def test_config_rejects_bad_suffix_values(options, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.from_dict({"method": "suffix", **options})


def test_bad_suffix_config_is_refused_at_engine_start(tiny_model_factory):
    with pytest.raises(ConfigError, match="suffix_decoding_min_token_prob"):
        tiny_llm(
            tiny_model_factory("llama"), speculative_config={"method": "suffix", "suffix_decoding_min_token_prob": -1}
        )


def test_suffix_is_refused_at_engine_start_without_the_native_kernels(tiny_model_factory, monkeypatch):
    path = tiny_model_factory("llama")
    monkeypatch.setattr(suffix_tree, "native_ops", lambda: None)
    with pytest.raises(ConfigError, match="method 'suffix' needs tachyllm's C[+][+] kernels"):
        tiny_llm(path, speculative_config=SUFFIX)
    tiny_llm(path, speculative_config={**SUFFIX, "method": "ngram"})  # other methods are unaffected
