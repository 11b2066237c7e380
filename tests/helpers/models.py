"""Tiny random-weight Hugging Face models saved to disk: a byte-level BPE tokenizer trained on a small
corpus, a model of any supported family, and a draft checkpoint cut from a model's first layers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

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
