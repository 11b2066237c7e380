"""PoolingParams: what a pooling request (an embedding, a score, a classification) asks of the model (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tachyllm.errors import RequestError

PoolingTask = Literal["embed", "classify", "score"]
POOLING_TASKS: tuple[PoolingTask, ...] = ("embed", "classify", "score")


@dataclass
class PoolingParams:
    """`dimensions`: keep the first this many values of the embedding (Matryoshka models), then
    normalise again. `normalize`: None = the model's own default (a sentence-transformers Normalize
    module, or --normalize). `truncate_prompt_tokens`: keep the last k tokens of a longer input
    (-1: the model's limit); without it an over-long input is refused."""

    task: PoolingTask = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def verify(self, tasks: frozenset[str] | None = None, embedding_dim: int | None = None, matryoshka: bool = True):
        """Raises RequestError naming the field at fault: a task the model does not serve (`tasks`), a
        `dimensions` outside [1, embedding_dim] or asked of a model without Matryoshka embeddings, a
        `normalize` that is not a bool, a truncation length that is neither -1 nor >= 1."""
        if self.task not in POOLING_TASKS:
            raise RequestError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}", param="task")
        if tasks is not None and self.task not in tasks:
            served = ", ".join(sorted(tasks)) or "none: it generates text"
            raise RequestError(f"this model does not serve {self.task!r} (it serves: {served})", param="task")
        if self.dimensions is not None:
            if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int):
                raise RequestError(f"dimensions must be an integer, got {self.dimensions!r}", param="dimensions")
            if self.task != "embed":
                raise RequestError("dimensions applies to embeddings only", param="dimensions")
            if not matryoshka:
                raise RequestError(
                    "dimensions: this model does not support truncated (Matryoshka) embeddings", param="dimensions"
                )
            if self.dimensions < 1 or (embedding_dim is not None and self.dimensions > embedding_dim):
                bound = f"[1, {embedding_dim}]" if embedding_dim is not None else ">= 1"
                raise RequestError(f"dimensions must be in {bound}, got {self.dimensions}", param="dimensions")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise RequestError(f"normalize must be true or false, got {self.normalize!r}", param="normalize")
        keep = self.truncate_prompt_tokens
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or (keep < 1 and keep != -1)):
            raise RequestError(
                f"truncate_prompt_tokens must be -1 (the model's limit) or >= 1, got {keep!r}",
                param="truncate_prompt_tokens",
            )
