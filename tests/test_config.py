"""EngineConfig's groups: the flat options users write, seen as the objects the engine's parts take."""

from __future__ import annotations

import dataclasses

import pytest

from tachyllm.config import (
    BackendConfig,
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    QuantConfig,
    SchedulerConfig,
)
from tachyllm.errors import ConfigError

GROUPS = ("cache_config", "scheduler_config", "quant_config", "parallel_config", "backend_config")


def test_groups_carry_the_flat_options():
    config = EngineConfig(
        block_size=8, kv_cache_dtype="int8", enable_prefix_caching=False, kv_cache_memory="64M",
        max_num_seqs=4, max_num_batched_tokens=512, enable_chunked_prefill=False, max_decode_slowdown=2.0,
        quantization="int4", quant_group_size=64, quant_skip="lm_head,attn", quant_activation_bits=8,
        tp_cpu_binding=True, tp_all_reduce="gloo", backend="torch", dtype="half", threads=3,
        deterministic=False, enforce_eager=True,
    )  # fmt: skip
    assert config.cache_config == CacheConfig(
        block_size=8, kv_cache_dtype="int8", enable_prefix_caching=False, kv_cache_memory=64 << 20
    )
    assert config.scheduler_config == SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=512, enable_chunked_prefill=False, max_decode_slowdown=2.0
    )
    assert config.quant_config == QuantConfig(method="int4", group_size=64, skip="lm_head,attn", activation_bits=8)
    assert config.parallel_config == ParallelConfig(tensor_parallel_size=1, tp_cpu_binding=True, tp_all_reduce="gloo")
    assert config.backend_config == BackendConfig(
        backend="torch", device="cpu", dtype="float16", deterministic=False, enforce_eager=True, threads=3
    )


def test_groups_follow_the_fields_and_cannot_be_changed_apart_from_them():
    """A group is read from the fields at each access: changing a field (or replacing the config) shows
    in the group, and a group is frozen, so it cannot drift from the options the user gave."""
    config = EngineConfig(max_num_seqs=2)
    config.max_num_seqs = 16
    assert config.scheduler_config.max_num_seqs == 16
    assert dataclasses.replace(config, block_size=32).cache_config.block_size == 32
    for name in GROUPS:
        group = getattr(config, name)
        first = dataclasses.fields(group)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(group, first, None)


def test_every_flat_option_stays_a_field():
    """The groups are views, not fields: the flags generated from the fields (and models.yaml, LLM(**kwargs))
    keep their names."""
    names = {field.name for field in dataclasses.fields(EngineConfig)}
    assert not names & set(GROUPS)
    assert {
        "block_size",
        "max_num_seqs",
        "quantization",
        "tensor_parallel_size",
        "backend",
        "speculative_config",
    } <= names


def test_the_default_token_budget_reaches_the_scheduler_group():
    assert EngineConfig().scheduler_config.max_num_batched_tokens == 2048
    with pytest.raises(ConfigError, match="max_num_batched_tokens must be >= 1, got 0"):
        EngineConfig(max_num_batched_tokens=0)
