"""Shared fixtures: tiny random-weight HF models saved to disk, and the real default model."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Tiny test models gain nothing from a second thread, and OpenMP threads spin badly when another
# process holds a core. Tests that time or exercise the real model pass threads= explicitly.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The checkpoint cache (tachyllm/loading/cache.py) goes to a directory removed after the session,
# never into the user's ~/.cache; set TACHY_CACHE_DIR to keep one between runs (or to off).
if "TACHY_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["TACHY_CACHE_DIR"] = tempfile.mkdtemp(prefix="tachy-test-cache-")
    atexit.register(shutil.rmtree, os.environ["TACHY_CACHE_DIR"], ignore_errors=True)

import pytest
import torch

# Triton fixes whether its kernels (and its own library functions) run compiled or interpreted when
# they are defined, for the whole process. Without a GPU the Triton kernels' tests run in its
# interpreter on the CPU (TRITON_INTERPRET=1 before anything imports triton); with one, compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "Paged attention stores keys and values in fixed-size blocks. Schedulers batch requests continuously.",
    "Les élèves étudient à l'école. 東京は日本の首都です。 Emoji: 🚀✨ done.",
    "0123456789 numbers 42 and 3.14159 and 2026-11-30",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(directory: Path, vocab_size: int = 400) -> int:
    """Trains a small byte-level BPE on CORPUS and saves it HF-style; returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "add_bos_token": False,
                "chat_template": CHATML,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    return tok.get_vocab_size()


def make_tiny_model(directory: Path, arch: str = "llama", tie: bool = False, seed: int = 0, **overrides) -> Path:
    """Saves a random-weight HF model of the given family (llama, mistral, qwen2, qwen3, gemma3) and a tokenizer."""
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(directory)
    eos = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"].get("<|im_end|>", 2)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        eos_token_id=eos,
        bos_token_id=None,
        pad_token_id=0,
    )
    common.update(overrides)
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    if arch in ("qwen3", "gemma3"):
        common.setdefault("head_dim", 16)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common))
    # Random init gives near-uniform logits (many near-ties); widen them so greedy comparisons are meaningful.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
            elif "bias" in name or (arch == "gemma3" and "norm" in name):  # Gemma's norms start at w = 0: 1 + w
                p.normal_(0, 0.1)
    model.save_pretrained(directory)
    return directory


def first_layers(target: Path, into: Path, layers: int) -> Path:
    """A separate checkpoint holding the target's embedding, first `layers` layers, norm and head
    (a real draft's job done by a correlated model, so that some drafts are accepted and some not)."""
    into.mkdir()
    for item in target.iterdir():
        if item.suffix != ".safetensors" and item.name != "config.json":
            shutil.copy(item, into / item.name)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (into / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    weights = load_file(target / "model.safetensors")
    kept = {k: v for k, v in weights.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(kept, into / "model.safetensors", metadata={"format": "pt"})
    return into


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    cache: dict[tuple, Path] = {}

    def factory(arch: str = "llama", tie: bool = False, **overrides) -> Path:
        key = (arch, tie, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, tie, **overrides)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from tachyllm.loading.default_model import default_model_path as path

    return path()


@contextmanager
def serving(server) -> Iterator[str]:
    """Runs a uvicorn server in a thread (port 0 = a free one); yields its base URL."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)


# A server test module defines `url` (its server's base URL); these clients talk to it.
@pytest.fixture(scope="module")
def client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(url: str):
    import httpx

    with httpx.Client(base_url=url, timeout=60) as c:
        yield c
