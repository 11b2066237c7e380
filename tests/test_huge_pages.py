"""A CPU model's weights moved onto transparent huge pages (tachyllm/huge_pages.py): every tensor keeps
its identity, value and sharing, the memory is marked for huge pages, the old memory goes back to the
kernel, and an engine built this way generates exactly what one without it does."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch
from torch import nn

from tachyllm import LLM, SamplingParams, huge_pages

needs_huge_pages = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages on this machine")


def mapping(address: int) -> tuple[int, int, list[str]]:
    """The start, end and VmFlags of the mapping of this process that holds `address`."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return start, end, line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def on_huge_pages(tensor: torch.Tensor) -> bool:
    return "hg" in mapping(tensor.data_ptr())[2]  # madvise(MADV_HUGEPAGE) sets VM_HUGEPAGE


def same_mapping(a: torch.Tensor, b: torch.Tensor) -> bool:
    return mapping(a.data_ptr())[:2] == mapping(b.data_ptr())[:2]


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(256, 256)
        self.second = nn.Linear(256, 256)
        self.second.weight = self.first.weight  # tied: one Parameter in two modules
        self.register_buffer("table", torch.randn(128, 256))
        self.packed = torch.randint(0, 255, (300, 512), dtype=torch.uint8)  # a plain attribute
        self.rows = self.packed[100:]  # a view into the same storage
        self.parts = [torch.randn(64, 512, dtype=torch.bfloat16)]  # inside a list


@needs_huge_pages
def test_weights_keep_identity_value_and_sharing():
    model = Holder()
    tensors = {
        "weight": model.first.weight, "table": model.table, "packed": model.packed, "rows": model.rows,
        "part": model.parts[0], "bias": model.first.bias,
    }  # fmt: skip
    values = {name: t.detach().clone() for name, t in tensors.items()}
    x = torch.randn(3, 256)
    expected = model.second(model.first(x))
    old_bias_ptr = model.first.bias.data_ptr()

    assert huge_pages.move_weights(model) >= 256 * 256 * 4 + 128 * 256 * 4 + 300 * 512 + 64 * 512 * 2

    for name, tensor in tensors.items():
        assert torch.equal(tensor, values[name]), name
    assert model.first.weight is tensors["weight"] and model.second.weight is model.first.weight
    assert model.table is tensors["table"] and model.packed is tensors["packed"] and model.rows is tensors["rows"]
    assert isinstance(model.first.weight, nn.Parameter)
    for name in ("weight", "table", "packed", "rows", "part"):
        assert on_huge_pages(tensors[name]), name
    # Below the size worth a copy: left where it was.
    assert model.first.bias.data_ptr() == old_bias_ptr and not same_mapping(model.first.bias, model.first.weight)
    # The view still looks into the packed tensor's memory.
    assert model.rows.data_ptr() == model.packed.data_ptr() + 100 * 512
    model.packed[100, 0] = 7
    assert model.rows[0, 0] == 7
    assert torch.equal(model.second(model.first(x)), expected)


@pytest.mark.parametrize(
    ("setting", "env", "expected"),
    [
        ("always [madvise] never\n", None, True),
        ("[always] madvise never\n", None, True),
        ("always madvise [never]\n", None, False),
        (None, None, False),  # no such file: not Linux, or a kernel without transparent huge pages
        ("always [madvise] never\n", "0", False),
        ("always [madvise] never\n", "off", False),
        ("always [madvise] never\n", "1", True),
    ],
)
def test_available_reads_the_kernel_setting_and_the_opt_out(tmp_path, monkeypatch, setting, env, expected):
    path = tmp_path / "enabled"
    if setting is not None:
        path.write_text(setting)
    monkeypatch.setattr(huge_pages, "THP_SETTING", path)
    if env is None:
        monkeypatch.delenv("TACHY_HUGE_PAGES", raising=False)
    else:
        monkeypatch.setenv("TACHY_HUGE_PAGES", env)
    assert huge_pages.available() == (expected and hasattr(huge_pages.mmap, "MADV_HUGEPAGE"))


def test_nothing_moves_without_huge_pages():
    model = Holder()
    pointer = model.first.weight.data_ptr()
    with mock.patch.object(huge_pages, "available", return_value=False):
        assert huge_pages.move_weights(model) == 0
    assert model.first.weight.data_ptr() == pointer


def test_a_mapping_that_cannot_be_made_leaves_the_weights(caplog):
    model = Holder()
    pointer, value = model.first.weight.data_ptr(), model.first.weight.detach().clone()
    with (
        mock.patch.object(huge_pages, "available", return_value=True),
        mock.patch.object(huge_pages.mmap, "mmap", side_effect=OSError(12, "Cannot allocate memory")),
        caplog.at_level("INFO", logger="tachyllm"),
    ):
        assert huge_pages.move_weights(model) == 0
    assert model.first.weight.data_ptr() == pointer and torch.equal(model.first.weight, value)
    assert "weights left on 4 KiB pages" in caplog.text and "Cannot allocate memory" in caplog.text


@needs_huge_pages
def test_old_memory_goes_back_to_the_kernel():
    """Weights allocated from malloc's heap, each followed by a block that stays: once the weights move,
    their freed blocks are holes inside the heap, which glibc keeps resident unless trimmed."""
    script = textwrap.dedent("""
        import torch
        from torch import nn
        from tachyllm import huge_pages

        def rss_mib():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * 4096 / 2**20

        block = torch.empty(8 << 20, dtype=torch.uint8)
        del block  # freeing a mapped block raises glibc's mmap threshold: later blocks come from the heap
        layers, pins = [], []
        for _ in range(32):  # 128 MiB of weights
            layers.append(nn.Linear(1024, 1024, bias=False))
            pins.append(torch.ones(64 << 10))
        model = nn.Sequential(*layers)
        before = rss_mib()
        moved = huge_pages.move_weights(model) / 2**20
        print(moved, rss_mib() - before)
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    moved, grown = (float(v) for v in out.stdout.split())
    assert moved >= 128
    assert grown < 0.25 * moved, f"RSS grew {grown:.0f} MiB moving {moved:.0f} MiB: the old blocks stayed resident"


@needs_huge_pages
@pytest.mark.parametrize("tie", [True, False])
def test_engine_weights_on_huge_pages_generate_the_same(tiny_model_factory, tie):
    path = tiny_model_factory("llama", tie=tie)
    options = {"dtype": "bfloat16", "block_size": 4, "kv_cache_memory": 4 << 20, "max_model_len": 128}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [[5, 17, 42, 99, 7], [250, 3, 8]]
    moved = []
    move_weights = huge_pages.move_weights

    def recording(*args, **kwargs):
        moved.append(move_weights(*args, **kwargs))
        return moved[-1]

    # The tiny model's tensors are below the size worth moving in a real model.
    with (
        mock.patch.object(huge_pages, "MIN_STORAGE_BYTES", 4096),
        mock.patch.object(huge_pages, "move_weights", recording),
    ):
        llm = LLM(str(path), **options)
        with mock.patch.object(huge_pages, "available", return_value=False):
            plain = LLM(str(path), **options)
    assert moved[0] > 0 and moved[1] == 0  # the plain engine's weights stayed where they were loaded
    model = llm.engine.model
    qkv = model.layers[0].self_attn.qkv_proj.weight
    if qkv is None:
        pytest.skip("bf16 linears packed by oneDNN (no native kernels): opaque tensors, not moved")
    assert on_huge_pages(qkv) and same_mapping(model.lm_head.weight, qkv)
    # An untied table is only looked up (a row per token): left where it is. (Compared by mapping, not
    # by the flag: malloc memory of this process was seen on huge-page-flagged ranges too, after other
    # test files had run in it.)
    assert same_mapping(model.embed_tokens.weight, qkv) == tie
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    want = plain.generate([{"prompt_token_ids": p} for p in prompts], params)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@needs_huge_pages
def test_lora_adapters_move_onto_huge_pages_and_generate_the_same(tiny_model_factory, tmp_path):
    """An adapter installed into the wrapped linears is moved, every linear's share into one mapping
    on huge pages (the kernels keep reading the moved tensors), and generates what it does unmoved."""
    from helpers.engine import tiny_llm
    from helpers.lora_files import ALL_TARGETS, write_adapter

    from tachyllm.lora.request import LoRARequest

    path = tiny_model_factory()
    adapter = LoRARequest("all", 1, str(write_adapter(tmp_path / "all", path, ALL_TARGETS, rank=8, seed=2)))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [[5, 17, 42, 99, 7], [250, 3, 8]]
    options = {"enable_lora": True, "max_lora_rank": 8}
    llm = tiny_llm(path, **options)
    got = llm.generate(prompts, params, lora_request=adapter, use_tqdm=False)
    with mock.patch.object(huge_pages, "available", return_value=False):
        plain = tiny_llm(path, **options)
        want = plain.generate(prompts, params, lora_request=adapter, use_tqdm=False)
    slot = llm.engine.lora.loaded[adapter].slot
    tensors = [t for layer in llm.engine.lora.layers for w in set(layer.values()) for t in w.slot_tensors(slot)]
    assert tensors and all(on_huge_pages(t) and same_mapping(t, tensors[0]) for t in tensors)
    unmoved = plain.engine.lora.layers[0]["q_proj"].slot_tensors(slot)[0]
    assert not same_mapping(unmoved, tensors[0])
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
