"""What an engine runs its model for (docs/pooling.md): generation, or pooling (embeddings, scores,
classification), chosen from the options (--runner, --convert, --task) and the checkpoint (an encoder
only pools), and each pooling request's resolved pooling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tachyllm.config import EngineConfig
from tachyllm.errors import ConfigError
from tachyllm.model_config import ModelConfig
from tachyllm.pooling_params import PoolingParams
from tachyllm.step import PoolingInput


@dataclass(frozen=True)
class PoolingSetup:
    """The runner an engine is, and for a pooling engine its tasks and defaults."""

    runner_type: Literal["generate", "pooling"]
    tasks: frozenset[str] = frozenset()
    embedding_dim: int | None = None
    is_matryoshka: bool = False
    pooling_type: str = "LAST"  # how hidden states are pooled (--pooling-type, or the model's own)
    normalize: bool = True  # embeddings L2-normalised unless a request says otherwise
    encoder: bool = False  # bidirectional, whole inputs in one step, no KV cache

    def pooling_input(self, params: PoolingParams, token_type_ids: list[int] | None) -> PoolingInput:
        """How one request's sequence is pooled: the engine's defaults, and what the request asks."""
        normalize = self.normalize if params.normalize is None else params.normalize
        # A classification head reads the first token (BERT's pooler); embeddings pool as the model does.
        pooling_type = "CLS" if params.task != "embed" and self.encoder else self.pooling_type
        return PoolingInput(pooling_type, params.task, normalize, params.dimensions, token_type_ids)


def pooling_setup(config: EngineConfig, mc: ModelConfig) -> PoolingSetup:
    """The engine's runner for this checkpoint and these options; ConfigError for a combination that
    cannot run (an encoder asked to generate, a classifier asked of a model without a head, ...)."""
    requested = config.pooling_requested
    if not mc.is_encoder and not requested:
        return PoolingSetup("generate")
    if requested is False:
        raise ConfigError(
            f"the {mc.architecture} checkpoint is an encoder: it cannot generate text (use --runner pooling or auto)"
        )
    if config.speculative_config is not None:
        raise ConfigError("speculative decoding does not apply to the pooling runner")
    classifier = mc.num_labels is not None and config.convert != "embed" and config.task != "embed"
    if config.convert == "classify" and mc.num_labels is None:
        raise ConfigError(
            "convert='classify' needs a checkpoint with a classification head (BertForSequenceClassification)"
        )
    if config.task in ("score", "classify") and not classifier and not mc.is_encoder:
        raise ConfigError(f"task={config.task!r} needs a checkpoint with a classification head")
    if classifier:
        return PoolingSetup("pooling", frozenset({"classify", "score"}), encoder=mc.is_encoder, pooling_type="CLS")
    default_type = "MEAN" if mc.is_encoder else "LAST"
    pooling_type = config.pooling_type or mc.pooling_type or default_type
    if config.normalize is not None:
        normalize = config.normalize
    else:  # a sentence-transformers folder says (a Normalize module or not); vLLM's default otherwise
        normalize = mc.pooling_normalize if mc.pooling_normalize is not None else True
    return PoolingSetup(
        "pooling",
        frozenset({"embed"}),
        embedding_dim=mc.hidden_size,
        is_matryoshka=mc.is_matryoshka,
        pooling_type=pooling_type,
        normalize=normalize,
        encoder=mc.is_encoder,
    )
