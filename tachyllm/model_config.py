"""ModelConfig: what the model is (its architecture hyper-parameters), whatever file format it came from."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tachyllm.errors import ConfigError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "bert")
# Encoder-only architectures: bidirectional attention over each whole input, no KV cache, served by the
# pooling runner only (docs/pooling.md).
ENCODER_ARCHITECTURES = ("bert",)


@dataclass
class ModelConfig:
    """Architecture hyper-parameters, independent of the file format they came from."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope_scaling dict ({"rope_type": "llama3", "factor": ..., ...}) or None.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Gemma 3)
    # Gemma 3. Attention scale query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5).
    query_pre_attn_scalar: float | None = None
    # Sliding-window attention: the layers whose index is in `sliding_layers` see only the last
    # `sliding_window` positions (their own included), and rotate with `rope_local_theta` (unscaled).
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None
    final_logit_softcapping: float | None = None  # logits <- cap * tanh(logits / cap)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # dtype the checkpoint was stored in; used by dtype="auto".
    checkpoint_dtype: torch.dtype = torch.float32
    # Encoders (BERT): token-type embeddings, LayerNorm's epsilon, and a classification head's labels
    # (BertForSequenceClassification; None: no head).
    type_vocab_size: int = 0
    layer_norm_eps: float = 1e-12
    num_labels: int | None = None
    # Pooling (docs/pooling.md), from a sentence-transformers folder or the config: how hidden states are
    # pooled (MEAN / CLS / LAST; None: the runner's default), whether embeddings are L2-normalised (None:
    # the runner's default), and whether they may be truncated to fewer dimensions (Matryoshka).
    pooling_type: str | None = None
    pooling_normalize: bool | None = None
    is_matryoshka: bool = False
    max_seq_length: int | None = None  # a sentence-transformers folder's limit on one input (tokens)

    @property
    def is_encoder(self) -> bool:
        return self.architecture in ENCODER_ARCHITECTURES

    def __post_init__(self) -> None:
        self.sliding_layers = tuple(self.sliding_layers)  # a JSON list when read back from the checkpoint cache
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.sliding_layers and not (self.sliding_window or 0) >= 1:
            raise ConfigError(f"sliding-window layers need sliding_window >= 1, got {self.sliding_window!r}")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer's attention, or None where it sees its whole context."""
        return self.sliding_window if layer in self.sliding_layers else None
