"""Tiny random-weight pooling models saved to disk: a BERT encoder in a sentence-transformers folder
(modules.json, 1_Pooling/config.json, Normalize), a BERT cross-encoder (BertForSequenceClassification
with one label), both with a WordPiece tokenizer framing inputs as [CLS] a [SEP] b [SEP]."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers.models import CORPUS

BERT_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_POOLING_FLAGS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "last": "pooling_mode_lasttoken"}


def build_wordpiece_tokenizer(directory: Path, vocab_size: int = 300) -> int:
    """Trains a small WordPiece tokenizer (BERT's normaliser, pre-tokenizer and [CLS]/[SEP] template) on
    CORPUS, saves it HF-style; returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=BERT_SPECIAL, show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]"})
    )
    return tok.get_vocab_size()


def make_tiny_bert(
    directory: Path,
    *,
    classifier: bool = False,
    pooling: str | None = "mean",
    normalize: bool = True,
    max_seq_length: int | None = None,
    seed: int = 0,
    **overrides,
) -> Path:
    """Saves a random-weight BertModel (a sentence-transformers folder with `pooling` and, if `normalize`,
    a Normalize module; pooling=None: a bare BERT folder) or, with `classifier`, a one-label
    BertForSequenceClassification."""
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = build_wordpiece_tokenizer(directory)
    settings = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        type_vocab_size=2,
        hidden_act="gelu",
        layer_norm_eps=1e-12,
        num_labels=1,
    )
    settings.update(overrides)
    config = transformers.BertConfig(**settings)
    torch.manual_seed(seed)
    model_class = transformers.BertForSequenceClassification if classifier else transformers.BertModel
    model = model_class(config).eval()
    with torch.no_grad():  # BERT's init leaves biases and LayerNorms at 0 / 1: give them values to check too
        for name, param in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    if not classifier and pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
        kinds = ["Pooling", "Normalize"] if normalize else ["Pooling"]
        for i, kind in enumerate(kinds, start=1):
            path = f"{i}_{kind}"
            modules.append({"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"})
        (directory / "modules.json").write_text(json.dumps(modules))
        (directory / "1_Pooling").mkdir(exist_ok=True)
        flags = {flag: kind == pooling for kind, flag in _POOLING_FLAGS.items()}
        (directory / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **flags}))
        if max_seq_length is not None:
            (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    return directory
