"""The engine flags are generated from the EngineConfig fields (engine_args.py): one flag per
field, its default, its parser, and no import cycle between the CLI modules."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from tachyllm import engine_args
from tachyllm.config import EngineConfig
from tachyllm.engine_args import add_engine_args, engine_config
from tachyllm.entrypoints.cli import build_parser, main
from tachyllm.speculative_config import SpeculativeConfig


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(argv)


def engine_group(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    return next(g for g in parser._action_groups if g.title == "engine")


def test_every_field_has_one_documented_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    actions = engine_group(parser)._group_actions
    assert [a.dest for a in actions] == [f.name for f in dataclasses.fields(EngineConfig)]
    for action in actions:
        assert action.option_strings[0] == "--" + action.dest.replace("_", "-")
        assert action.help, f"--{action.dest} has no help"


def test_defaults_round_trip():
    assert engine_config(parse()) == EngineConfig()


# (argv, field, parsed value): a non-default value of every field.
NON_DEFAULTS = [
    (["--model", "m.gguf"], "model", "m.gguf"),
    (["--tokenizer", "tok-dir"], "tokenizer", "tok-dir"),
    (["--max-logprobs", "5"], "max_logprobs", 5),
    (["--dtype", "float32"], "dtype", "float32"),
    (["--device", "cpu:0"], "device", "cpu:0"),
    (["--max-model-len", "512"], "max_model_len", 512),
    (["--block-size", "32"], "block_size", 32),
    (["--max-num-seqs", "8"], "max_num_seqs", 8),
    (["--max-num-batched-tokens", "4096"], "max_num_batched_tokens", 4096),
    (["--kv-cache-memory", "2G"], "kv_cache_memory", 2 << 30),
    (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
    (["--no-enable-chunked-prefill"], "enable_chunked_prefill", False),
    (["--max-decode-slowdown", "2.5"], "max_decode_slowdown", 2.5),
    (["--max-constraint-bytes", "1M"], "max_constraint_bytes", 1 << 20),
    (["--constraint-compile-timeout", "2.5"], "constraint_compile_timeout", 2.5),
    (["--seed", "7"], "seed", 7),
    (["--threads", "3"], "threads", 3),
    (["--quantization", "int4"], "quantization", "int4"),
    (["--quant-group-size", "64"], "quant_group_size", 64),
    (["--quant-skip", "lm_head,attn"], "quant_skip", "lm_head,attn"),
    (["--quant-activation-bits", "8"], "quant_activation_bits", 8),
    (["--kv-cache-dtype", "int8"], "kv_cache_dtype", "int8"),
    (["--generation-config", "vllm"], "generation_config", "vllm"),
    (["--gpu-memory-utilization", "0.5"], "gpu_memory_utilization", 0.5),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'], "speculative_config",
     SpeculativeConfig(method="ngram", num_speculative_tokens=4)),
    (["--chat-template", "{{ messages[0].content }}"], "chat_template", "{{ messages[0].content }}"),
    (["--tensor-parallel-size", "2"], "tensor_parallel_size", 2),
    (["--otlp-traces-endpoint", "http://localhost:4317"], "otlp_traces_endpoint", "http://localhost:4317"),
    (["--max-loras", "4"], "max_loras", 4),
    (["--max-lora-rank", "64"], "max_lora_rank", 64),
    (["--max-cpu-loras", "8"], "max_cpu_loras", 8),
]  # fmt: skip


def non_defaults() -> list[tuple[list[str], str, object]]:
    """NON_DEFAULTS, plus a generated non-default value of a field it lacks that is a bool or has choices."""
    known = {name for _, name, _ in NON_DEFAULTS}
    generated = []
    for f in dataclasses.fields(EngineConfig):
        flag = f.name.replace("_", "-")
        if f.name in known:
            continue
        if isinstance(f.default, bool):
            generated.append(([f"--no-{flag}" if f.default else f"--{flag}"], f.name, not f.default))
        elif f.metadata.get("choices"):
            value = next(choice for choice in f.metadata["choices"] if choice != f.default)
            generated.append(([f"--{flag}", str(value)], f.name, value))
        else:
            pytest.fail(f"add a non-default value of {f.name} to NON_DEFAULTS")
    return NON_DEFAULTS + generated


def test_a_non_default_value_of_every_field_reaches_the_config():
    cases = non_defaults()
    config = engine_config(parse(*[arg for argv, _, _ in cases for arg in argv]))
    for argv, name, expected in cases:
        assert getattr(config, name) == expected, argv
        assert expected != getattr(EngineConfig(), name)


@pytest.mark.parametrize("name", ["enable_prefix_caching", "enable_chunked_prefill"])
def test_bool_flags_take_both_spellings(name):
    flag = name.replace("_", "-")
    assert getattr(parse(), name) is True
    assert getattr(parse(f"--no-{flag}"), name) is False
    assert getattr(parse(f"--{flag}"), name) is True
    assert getattr(parse(f"--{flag}", f"--no-{flag}"), name) is False  # the last one wins


@pytest.mark.parametrize(
    "text, size", [("4096", 4096), ("512M", 512 << 20), ("2G", 2 << 30), ("1.5GiB", 3 << 29), ("64kb", 64 << 10)]
)
def test_kv_cache_memory_takes_byte_sizes(text, size):
    assert parse("--kv-cache-memory", text).kv_cache_memory == size


def test_optional_numbers_take_none_and_strings_keep_it():
    args = parse("--max-model-len", "none", "--threads", "None", "--max-decode-slowdown", "NONE")
    assert args.max_model_len is None and args.threads is None and args.max_decode_slowdown is None
    # An optional option with choices (a Ray Serve YAML's null reaches it as "none").
    assert parse("--quant-activation-bits", "none").quant_activation_bits is None
    assert parse("--quant-activation-bits", "8").quant_activation_bits == 8
    args = parse("--max-model-len", "512", "--quant-skip", "none")
    assert args.max_model_len == 512 and args.quant_skip == "none"  # its own meaning: no layer is kept unquantized


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dtype", "float8"], "invalid choice: 'float8'"),
        (["--quant-activation-bits", "4"], "invalid choice: '4' (choose from 8, 16 or none)"),
        (["--block-size", "big"], "invalid int value: 'big'"),
        (["--max-model-len", "x"], "invalid int value: 'x'"),
    ],
)
def test_bad_values_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_speculative_config_is_parsed_from_json():
    config = engine_config(parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'))
    assert config.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=3)


def test_every_command_with_an_engine_takes_the_same_flags():
    parser = build_parser()
    commands = [["generate", "hi"], ["chat"], ["serve"], ["bench", "throughput"], ["bench", "latency"],
                ["eval", "quality"]]  # fmt: skip
    for command in commands:
        assert engine_config(parser.parse_args([*command, "--max-num-seqs", "3"])) == EngineConfig(max_num_seqs=3)


def test_a_new_field_is_a_new_flag_with_no_other_edit(monkeypatch):
    @dataclass
    class WithBackend(EngineConfig):
        backend: str = field(default="auto", metadata={"help": "execution", "choices": ("auto", "torch", "cpu")})

    monkeypatch.setattr(engine_args, "EngineConfig", WithBackend)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args([])) == WithBackend()
    assert engine_config(parser.parse_args(["--backend", "torch"])).backend == "torch"
    assert "--backend {auto,torch,cpu}" in parser.format_help()
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--backend", "gpu"])
    assert exit_info.value.code == 2


def test_a_field_whose_type_does_not_say_how_to_parse_needs_parse(monkeypatch):
    @dataclass
    class WithList(EngineConfig):
        layers: list[int] | None = field(default=None, metadata={"help": "layers"})

    monkeypatch.setattr(engine_args, "EngineConfig", WithList)
    with pytest.raises(TypeError, match="EngineConfig.layers: give its option a parse="):
        add_engine_args(argparse.ArgumentParser())


def test_cli_modules_do_not_import_the_tachy_command():
    modules = ["tachyllm.entrypoints.serve", "tachyllm.bench.cli", "tachyllm.bench.offline", "tachyllm.eval.quality"]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "assert 'tachyllm.entrypoints.cli' not in sys.modules, 'a subcommand module imports the tachy command'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
