"""What one tensor-parallel rank holds of the model, Megatron-style (as vLLM splits it):

- q/k/v and gate/up are split by output rows (column-parallel): a rank owns whole attention heads and
  a slice of the MLP's intermediate units, and computes them without talking to the others;
- o and down are split by input columns (row-parallel): each rank's product is a partial sum, and one
  all-reduce after each gives every rank the layer's full output (two per decoder layer);
- the embedding and the LM head are split by vocabulary (padded to a multiple of the ranks): a rank
  looks up only the ids it owns (the others read zero, then an all-reduce), and the LM head's logit
  shards are gathered on rank 0, the only rank that samples;
- KV heads are split with their query heads (whole GQA groups: where the ranks do not divide the KV
  heads, the first ranks take one group more); with fewer KV heads than ranks each is replicated on
  the ranks whose query heads read it.

A rank's model is an ordinary model of its family built for the shard's own ModelConfig (fewer
heads, a narrower MLP and vocabulary), its checkpoint tensors sliced as they are read, and then the
row-parallel linears, the embedding and the LM head wrapped in modules that add the collectives
(module swaps, as quantization does). Norms, rotary tables and q/k norms are whole on every rank.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from tachyllm.config import EngineConfig
from tachyllm.distributed.group import TPGroup
from tachyllm.errors import ConfigError
from tachyllm.loading import Checkpoint
from tachyllm.loading.weights import Select, WeightSource
from tachyllm.model_config import ModelConfig
from tachyllm.models.llama import LlamaForCausalLM
from tachyllm.runner.model_loader import build_model

# checkpoint name (without "model.") -> how it is split: "rows" of heads / units / vocabulary, or "cols"
_SPLITS = [
    (re.compile(r"layers\.\d+\.self_attn\.q_proj\.(weight|bias)$"), "q"),
    (re.compile(r"layers\.\d+\.self_attn\.[kv]_proj\.(weight|bias)$"), "kv"),
    (re.compile(r"layers\.\d+\.self_attn\.o_proj\.weight$"), "o"),
    (re.compile(r"layers\.\d+\.mlp\.(gate|up)_proj\.weight$"), "gate_up"),
    (re.compile(r"layers\.\d+\.mlp\.down_proj\.weight$"), "down"),
    (re.compile(r"(embed_tokens|lm_head)\.weight$"), "vocab"),
]


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `size`'s share of a model of config `full`."""

    full: ModelConfig
    rank: int
    size: int

    def __post_init__(self) -> None:
        cfg, n = self.full, self.size
        if cfg.sliding_layers:
            # Their KV pool of its own (core/block_manager.py) is not split over ranks yet.
            raise ConfigError(f"tensor_parallel_size={n}: models with sliding-window layers (Gemma 3) run at 1 only")
        if cfg.intermediate_size % n:
            raise ConfigError(
                f"tensor_parallel_size={n} does not divide the model's MLP intermediate size ({cfg.intermediate_size})"
            )
        kv = cfg.num_kv_heads
        if kv < n and (n % kv or (cfg.num_heads // kv) % (n // kv)):
            raise ConfigError(
                f"tensor_parallel_size={n} does not split the model's {cfg.num_heads} attention heads over {kv} KV "
                "heads: with fewer KV heads than ranks, the ranks must be a multiple of the KV heads and each KV "
                "head's query heads split evenly over its ranks"
            )

    @property
    def kv_heads(self) -> int:
        if self.full.num_kv_heads < self.size:
            return 1
        first, end = self._kv_range
        return end - first

    @property
    def first_kv_head(self) -> int:
        kv, n = self.full.num_kv_heads, self.size
        # Replicated: ranks r * n / kv .. share KV head r, whose query heads they own.
        return self._kv_range[0] if kv >= n else self.rank // (n // kv)

    @property
    def _kv_range(self) -> tuple[int, int]:
        """Whole KV heads (with their query heads) per rank, as even as they go: where the ranks do not
        divide them, the first ranks take one more (SmolLM2's 3 over 2 ranks: 2 and 1)."""
        kv, n, r = self.full.num_kv_heads, self.size, self.rank
        return -(-r * kv // n), -(-(r + 1) * kv // n)

    @property
    def heads(self) -> int:
        cfg = self.full
        if cfg.num_kv_heads < self.size:
            return cfg.num_heads // self.size
        return self.kv_heads * (cfg.num_heads // cfg.num_kv_heads)

    @property
    def first_head(self) -> int:
        cfg = self.full
        if cfg.num_kv_heads < self.size:
            return self.rank * self.heads
        return self.first_kv_head * (cfg.num_heads // cfg.num_kv_heads)

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.full.vocab_size // self.size)

    @property
    def first_token(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def config(self) -> ModelConfig:
        """The rank's model: an ordinary model of the family with its shard's sizes."""
        return replace(
            self.full,
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            intermediate_size=self.full.intermediate_size // self.size,
            vocab_size=self.vocab_per_rank,
        )

    def index(self, name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        """The rank's part of a checkpoint tensor ([out, in] linears, [vocab, hidden] embeddings), as
        the index the loaders read (loading/weights.py: only these bytes of a safetensors file)."""
        split = _split(name)
        d, inter = self.full.head_dim, self.full.intermediate_size // self.size
        every = slice(None)
        if split == "q":
            return (slice(self.first_head * d, (self.first_head + self.heads) * d),)
        if split == "kv":
            return (slice(self.first_kv_head * d, (self.first_kv_head + self.kv_heads) * d),)
        if split == "o":
            return every, slice(self.first_head * d, (self.first_head + self.heads) * d)
        if split == "gate_up":
            return (slice(self.rank * inter, (self.rank + 1) * inter),)
        if split == "down":
            return every, slice(self.rank * inter, (self.rank + 1) * inter)
        if split == "vocab":
            return (slice(self.first_token, self.first_token + self.vocab_per_rank),)
        return None

    def full_in_features(self, name: str) -> int:
        """A checkpoint matrix's unsplit input width (quantization picks its groups from it, as at TP=1)."""
        split = _split(name)
        if split == "o":
            return self.full.num_heads * self.full.head_dim
        return self.full.intermediate_size if split == "down" else self.full.hidden_size

    def pad(self, tensor: torch.Tensor) -> torch.Tensor:
        """A vocabulary shard short of vocab_per_rank rows (the last rank's) gets zero rows: never
        looked up, and their logits are cut."""
        if tensor.shape[0] == self.vocab_per_rank:
            return tensor
        return torch.cat([tensor, tensor.new_zeros(self.vocab_per_rank - tensor.shape[0], tensor.shape[1])])

    def weights(
        self, source: WeightSource, leave_out: frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The rank's parts of a checkpoint's tensors, read as parts; `leave_out`: tensors not read."""
        for name, tensor in source(self.index, leave_out):
            if name.removeprefix("model.") in ("embed_tokens.weight", "lm_head.weight"):
                tensor = self.pad(tensor)
            yield name, tensor.contiguous()


@dataclass(frozen=True)
class RankShard(ShardPlan):
    """A rank's share on its started group, as its model loads: int8's per-channel scales of the
    row-parallel layers are the maxima of whole rows, which span the ranks."""

    group: TPGroup | None = None

    def max_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        assert self.group is not None, "a rank's shard is made on its started group"
        return self.group.all_reduce_max(x)


def _split(name: str) -> str | None:
    return next((kind for pattern, kind in _SPLITS if pattern.search(name.removeprefix("model."))), None)


class RowParallel(nn.Module):
    """A linear whose input features are split over the ranks: its partial sums, all-reduced."""

    def __init__(self, inner: nn.Module, group: TPGroup):
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x).contiguous())


class VocabParallelEmbedding(nn.Module):
    """The embedding rows of tokens first .. first + n - 1; other ids read zero before the sum."""

    def __init__(self, inner: nn.Embedding, first: int, group: TPGroup):
        super().__init__()
        self.inner = inner
        self.first = first
        self.group = group

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        outside = (local < 0) | (local >= self.inner.num_embeddings)
        x = self.inner(local.masked_fill(outside, 0))
        return self.group.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Module):
    """The LM head over the rank's vocabulary shard; rank 0 gets the full logits (padding cut)."""

    def __init__(self, inner: nn.Module, vocab_size: int, group: TPGroup):
        super().__init__()
        self.inner = inner
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.gather_last_dim(self.inner(hidden))[..., : self.vocab_size]


def parallelize(model: LlamaForCausalLM, plan: ShardPlan, group: TPGroup) -> None:
    """Wraps a rank's built model (weights loaded, packed) in the collectives of its splits."""
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, plan.first_token, group)  # type: ignore[assignment]  # a module swap
    model.lm_head = ParallelLMHead(model.lm_head, plan.full.vocab_size, group)  # type: ignore[assignment]  # a module swap
    for layer in model.decoder_layers():
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)  # type: ignore[assignment]  # a module swap
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)  # type: ignore[assignment]  # a module swap


def build_rank_model(
    ckpt: Checkpoint, plan: ShardPlan, group: TPGroup, config: EngineConfig, backend, max_model_len: int
) -> tuple[LlamaForCausalLM, int]:
    """The rank's model, ready to run (its collectives included), and the bytes a decode step streams.
    Quantized layers are quantized (int4, int8) or cut from the file's blocks (gguf) per rank, from
    the rank's slices: the same groups, scales and blocks as the whole model's (quantization/apply.py)."""

    def rank_weights(
        select: Select | None = None, leave_out: frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, Tensor]]:
        assert select is None, "a rank's weights are its plan's parts already"
        return plan.weights(ckpt.weights, leave_out)

    shard = replace(ckpt, config=plan.config, weights=rank_weights)
    rank = RankShard(plan.full, plan.rank, plan.size, group)
    model, weight_bytes = build_model(
        shard, config.resolve_dtype(), backend, max_model_len, config.quant_config,
        batch_invariant=config.deterministic, fuse_layers=False, shard=rank,
    )  # fmt: skip
    parallelize(model, plan, group)
    return model, weight_bytes
