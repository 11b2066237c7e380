"""BERT encoders (docs/pooling.md): BertModel (sentence-transformers embedders such as all-MiniLM-L6-v2)
and BertForSequenceClassification (cross-encoder rerankers).

Each input attends to itself bidirectionally, whole, in one step, with no KV cache (the backend's
`encoder_attention` over the step's packed inputs); absolute position and token-type embeddings,
post-LayerNorm layers with a GELU (erf) MLP. `BertModel.forward` is the whole encoder forward, the one
place to make it faster. Linears are plain nn.Linear, so that the CPU's bf16 packing applies; packed for
oneDNN, a residual add and the MLP's GELU run inside their GEMMs (kernels/linear.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from tachyllm import tracing
from tachyllm.backends.base import PORTABLE_OPS, EncoderMetadata, LayerOps
from tachyllm.errors import ModelLoadError
from tachyllm.kernels.linear import linear_add
from tachyllm.model_config import ModelConfig


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(hidden, 3 * hidden)  # query, key and value in one matmul
        self.o_proj = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=eps)
        self.up_proj = nn.Linear(hidden, cfg.intermediate_size)
        # GELU (erf); nn.Identity where the loader fused it into up_proj's GEMM (kernels/linear.fuse_gelu).
        self.activation: nn.Module = nn.GELU()
        self.down_proj = nn.Linear(cfg.intermediate_size, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        with tracing.span("attention"):
            o = meta.backend.encoder_attention(q, k, v, meta, self.scale)
        x = self.attention_norm(linear_add(self.o_proj, o.reshape(n, -1), x))
        return self.output_norm(linear_add(self.down_proj, self.activation(self.up_proj(x)), x))


class BertModel(nn.Module):
    """The encoder: embeddings, then the layers; forward returns every token's final hidden state."""

    def __init__(self, cfg: ModelConfig, ops: LayerOps = PORTABLE_OPS):
        super().__init__()
        self.config = cfg
        hidden = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, hidden, _weight=torch.empty(cfg.vocab_size, hidden))
        self.position_embeddings = nn.Embedding(
            cfg.max_position_embeddings, hidden, _weight=torch.empty(cfg.max_position_embeddings, hidden)
        )
        types = max(cfg.type_vocab_size, 1)
        self.token_type_embeddings = nn.Embedding(types, hidden, _weight=torch.empty(types, hidden))
        self.embedding_norm = nn.LayerNorm(hidden, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor, meta: EncoderMetadata
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        x = self.embedding_norm(x + self.token_type_embeddings(token_type_ids))
        for layer in cast("list[BertLayer]", self.layers):
            x = layer(x, meta)
        return x

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """Logits of the classification head over pooled vectors [n, hidden] (a BertModel has none)."""
        raise NotImplementedError("a BertModel has no classification head")

    # The names a checkpoint gives our fused parameters' parts: suffix -> (our suffix, row offset in units
    # of hidden_size).
    _FUSED = {
        "attention.self.query": ("qkv_proj", 0),
        "attention.self.key": ("qkv_proj", 1),
        "attention.self.value": ("qkv_proj", 2),
    }
    _RENAMED = {
        "attention.output.dense": "o_proj",
        "attention.output.LayerNorm": "attention_norm",
        "intermediate.dense": "up_proj",
        "output.dense": "down_proj",
        "output.LayerNorm": "output_norm",
    }

    def _our_name(self, name: str) -> tuple[str, int | None]:
        """A checkpoint tensor's parameter here and its row offset within a fused parameter (or None)."""
        name = name.removeprefix("bert.")
        if name.startswith("embeddings."):
            name = name.removeprefix("embeddings.").replace("LayerNorm", "embedding_norm")
            return name, None
        if name.startswith("encoder.layer."):
            index, _, rest = name.removeprefix("encoder.layer.").partition(".")
            module, _, leaf = rest.rpartition(".")
            if module in self._FUSED:
                ours, part = self._FUSED[module]
                return f"layers.{index}.{ours}.{leaf}", part * self.config.hidden_size
            if module in self._RENAMED:
                return f"layers.{index}.{self._RENAMED[module]}.{leaf}", None
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], unloaded: frozenset[str] = frozenset()) -> None:
        """Copies the checkpoint's tensors (BertModel's or BertForSequenceClassification's names) in."""
        params = dict(self.named_parameters())
        filled = dict.fromkeys(params, 0)
        for checkpoint_name, tensor in weights:
            if checkpoint_name.endswith("position_ids"):
                continue  # a buffer some checkpoints store: positions are the step's own
            name, offset = self._our_name(checkpoint_name)
            param = params.get(name)
            if param is None:
                if name.startswith("pooler.") and "pooler.dense.weight" not in params:
                    continue  # an embedder's unused pooler (sentence-transformers pools on its own)
                raise ModelLoadError(f"checkpoint tensor {checkpoint_name!r} has no place in the model")
            target = param.data if offset is None else param.data[offset : offset + tensor.shape[0]]
            if target.shape != tensor.shape:
                raise ModelLoadError(
                    f"checkpoint tensor {checkpoint_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            filled[name] += tensor.numel()
        missing = [n for n, p in params.items() if filled[n] != p.numel() and n not in unloaded]
        if missing:
            raise ModelLoadError(f"checkpoint lacks weights for: {', '.join(missing[:5])}")


class BertForSequenceClassification(BertModel):
    """A cross-encoder: the encoder, then the pooler (dense + tanh over the CLS row) and the classifier."""

    def __init__(self, cfg: ModelConfig, ops: LayerOps = PORTABLE_OPS):
        super().__init__(cfg, ops)
        assert cfg.num_labels is not None, "a classifier's config says how many labels it has"
        self.pooler = nn.Module()
        self.pooler.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        dense = cast(nn.Linear, self.pooler.dense)
        return self.classifier(torch.tanh(dense(pooled)))


def encoder_class(cfg: ModelConfig) -> type[BertModel]:
    """The module class of an encoder checkpoint: with a classification head or without."""
    return BertForSequenceClassification if cfg.num_labels is not None else BertModel
