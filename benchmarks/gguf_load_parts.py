"""Two parts of loading a GGUF file, old way and new way alternating in one process:

- parsing the metadata: the `gguf` package's GGUFReader (every view a numpy.memmap view) vs
  tachyllm's reader (loading/gguf.py `_Reader`: the same mapping through a plain ndarray view);
- dequantizing the token-embedding table: the `gguf` package's `dequantize` on the whole tensor vs
  tachyllm's `_dequantize` (DEQUANTIZE_ROWS rows per call into one result).

Both pairs check that the two ways give the same result.

    .venv/bin/python benchmarks/gguf_load_parts.py \
        --model /work/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --rounds 2
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from tachyllm.loading.gguf import _dequantize, open_gguf


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for r in range(args.rounds):
        theirs, t_theirs = timed(GGUFReader, args.model)
        ours, t_ours = timed(open_gguf, args.model)
        assert list(ours.fields) == list(theirs.fields) and len(ours.tensors) == len(theirs.tensors)
        print(f"round {r}: metadata parse  gguf.GGUFReader {t_theirs:6.2f} s   tachyllm {t_ours:6.2f} s")
        table = next(t for t in ours.tensors if t.name == "token_embd.weight")
        whole, t_whole = timed(dequantize, table.data, table.tensor_type)
        sliced, t_sliced = timed(_dequantize, table.data, table.tensor_type)
        assert np.array_equal(whole, sliced)
        del whole, sliced
        print(
            f"round {r}: token_embd ({table.tensor_type.name}, {table.data.shape[0]} rows) dequantized  "
            f"whole {t_whole:6.2f} s   in slices {t_sliced:6.2f} s"
        )


if __name__ == "__main__":
    main()
