"""Converts a GGUF checkpoint into a Hugging Face model directory, for servers that cannot read GGUF
(vLLM's CPU build). transformers dequantizes the GGUF tensors while loading; the directory gets the
weights in --dtype, the config, and the tokenizer with its chat template.

    python gguf_to_hf.py MODEL.gguf OUT_DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path, help="the .gguf file")
    parser.add_argument("output", type=Path, help="directory to write (created)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    # transformers reads a GGUF as a file inside a model "directory".
    folder, name = str(args.gguf.parent), args.gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # Dense weights: by default transformers keeps GGUF blocks packed, which it cannot save and vLLM cannot read.
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=getattr(torch, args.dtype), quantization_config=GgufConfig(dequantize=True)
    )
    args.output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.output} ({model.config.model_type}, {params / 1e6:.0f}M parameters, {args.dtype})")


if __name__ == "__main__":
    main()
