"""Small command-line and offline-API contracts: size strings in LLM(...), the address a server bound,
--help agreeing with what the flags parse, and errors that point to the subcommand's own help."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tachyllm import LLM
from tachyllm.config import EngineConfig
from tachyllm.entrypoints.cli import build_parser, main
from tachyllm.errors import ConfigError


def tachy_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tachyllm.entrypoints.cli", *argv], capture_output=True, text=True, timeout=120
    )


# -- byte sizes in the offline API ------------------------------------------------------------------


@pytest.mark.parametrize("text, size", [("2G", 2 << 30), ("512M", 512 << 20), ("1.5GiB", 3 << 29), ("4096", 4096)])
def test_byte_size_options_take_the_flags_text(text, size):
    assert EngineConfig(kv_cache_memory=text).kv_cache_memory == size
    assert EngineConfig(max_constraint_bytes=text).max_constraint_bytes == size


@pytest.mark.parametrize("value", ["lots", "2X", "", "infG", 2.5, [1], True])
def test_bad_byte_sizes_are_a_value_error_naming_the_option(value):
    with pytest.raises(ConfigError, match="kv_cache_memory must be a number of bytes or a size such as 512M"):
        EngineConfig(kv_cache_memory=value)
    assert issubclass(ConfigError, ValueError)


def test_llm_takes_the_readmes_kv_cache_memory(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama")), kv_cache_memory="2M", dtype="float32")
    assert llm.engine.config.kv_cache_memory == 2 << 20
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(str(tiny_model_factory("llama")), kv_cache_memory="two gigabytes")


# -- --help and parsing agree ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, choices", [("--quant-activation-bits", "{8,16,none}"), ("--tp-all-reduce", "{shm,gloo,none}")]
)
def test_help_lists_the_words_an_optional_choice_takes(flag, choices, capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = capsys.readouterr().out
    assert f"{flag} {choices}" in help_text
    assert "None" not in re.findall(rf"{flag} (\S+)", help_text)[0]
    dest = flag[2:].replace("-", "_")
    for word in choices.strip("{}").split(","):  # each word listed parses: "none" to unset
        value = getattr(build_parser().parse_args(["serve", flag, word]), dest)
        assert value is None if word == "none" else str(value) == word


def test_optional_choices_refuse_other_words(capsys):
    for argv, value in [(["--tp-all-reduce", "nccl"], "'nccl'"), (["--quant-activation-bits", "4"], "'4'")]:
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(["serve", *argv])
        assert exit_info.value.code == 2
        assert f"invalid choice: {value}" in capsys.readouterr().err


def test_unrecognized_arguments_point_to_the_subcommands_help():
    for argv, prog in [
        (["serve", "--no-such-flag"], "tachy serve"),
        (["bench", "serve", "--no-such-flag"], "tachy bench serve"),
    ]:
        done = tachy_cli(*argv)
        assert done.returncode == 2
        assert done.stderr == f"{prog}: error: unrecognized arguments: --no-such-flag (see {prog} --help)\n"


# -- the bound address is logged -------------------------------------------------------------------


def test_serve_logs_the_port_it_bound(tiny_model_factory):
    """With --port 0 the kernel picks the port: the log line is the only way to learn it."""
    model = str(tiny_model_factory("llama"))
    argv = ["serve", model, "--port", "0", "--dtype", "float32", "--kv-cache-memory", "4M", "--log-stats-interval", "0"]
    process = subprocess.Popen(
        [sys.executable, "-m", "tachyllm.entrypoints.cli", *argv], stderr=subprocess.PIPE, text=True
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stderr], daemon=True).start()
    try:
        deadline, port = time.monotonic() + 120, None
        while port is None:
            assert time.monotonic() < deadline and process.poll() is None, "the server did not log its address"
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if match := re.search(r"serving on http://127\.0\.0\.1:(\d+)$", line.rstrip()):
                port = int(match.group(1))
        assert port != 0
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"][0]["id"]
    finally:
        process.terminate()
        process.wait(30)
