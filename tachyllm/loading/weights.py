"""A checkpoint's weight stream: `source()` yields (name, tensor) for every tensor, `source(select)`
only the part of each that `select` asks for, read without the rest where the format allows
(safetensors slices: a tensor-parallel rank reads its own shard of each matrix), and
`source(select, leave_out)` none of the tensors named in `leave_out`, which are not read at all (a
GGUF file's matrices that run on the file's own blocks)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

# (tensor name, its full shape) -> the index of the part wanted (one slice per leading dimension), or
# None for the whole tensor.
Select = Callable[[str, tuple[int, ...]], tuple[slice, ...] | None]
# Called as source(), source(select) or source(select, leave_out).
WeightSource = Callable[..., Iterator[tuple[str, torch.Tensor]]]


def read_part(handle, name: str, select: Select | None) -> torch.Tensor:
    """From an open safetensors file: the tensor, or only the bytes of its selected part."""
    if select is None:
        return handle.get_tensor(name)
    part = handle.get_slice(name)
    index = select(name, tuple(part.get_shape()))
    return handle.get_tensor(name) if index is None else part[index]


def select_part(select: Select | None, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The selected part of a tensor already in memory (formats read whole: GGUF's quantized blocks)."""
    index = select(name, tuple(tensor.shape)) if select is not None else None
    return tensor if index is None else tensor[index]
