"""tachyllm vs Hugging Face transformers on the same weights and dtype, side by side in one run.

Single stream: a 32-token prompt, 128 new tokens (greedy, EOS ignored) -> decode tokens/s.
Offline batch: 64 prompts of 128 tokens, 128 new tokens each -> output tokens/s
(transformers batched with left padding). Also reports the achieved weight bandwidth of
single-stream decode (weight bytes x decode steps/s).

    .venv/bin/python benchmarks/engine_vs_transformers.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch

from tachyllm import LLM, SamplingParams


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the first ids: special tokens of the default vocabulary.
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def ours_single(llm: LLM, prompt: list[int], new: int) -> float:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new, ignore_eos=True), use_tqdm=False)[0]
    return 1.0 / out.metrics.mean_tpot


def ours_batch(llm: LLM, prompts: list[list[int]], new: int) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True), use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def hf_generate(model, ids: torch.Tensor, mask: torch.Tensor, new: int) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=2
        )
    return time.perf_counter() - start


def hf_single(model, prompt: list[int], new: int) -> float:
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)
    prefill = hf_generate(model, ids, mask, 1)
    total = hf_generate(model, ids, mask, new + 1)
    return new / (total - prefill)


def hf_batch(model, prompts: list[list[int]], new: int) -> float:
    ids = torch.tensor(prompts)  # equal lengths: left padding would be all-ones mask anyway
    return len(prompts) * new / hf_generate(model, ids, torch.ones_like(ids), new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--batch-prompt-len", type=int, default=128)
    ap.add_argument("--skip-hf-batch", action="store_true", help="transformers' batch run is the slowest part")
    ap.add_argument("--bandwidth-gbs", type=float, default=40.0, help="measured machine bandwidth to compare against")
    args = ap.parse_args()

    import transformers

    from tachyllm.loading.default_model import default_model_path

    threads = torch.get_num_threads()
    llm = LLM(dtype=args.dtype, max_num_seqs=args.batch, max_num_batched_tokens=4096)
    vocab = llm.engine.model_config.vocab_size
    single = random_prompts(1, args.prompt_len, vocab)[0]
    batch = random_prompts(args.batch, args.batch_prompt_len, vocab, seed=1)

    ours_single(llm, single[:8], 8)  # warm-up
    ours_1 = ours_single(llm, single, args.new_tokens)
    ours_b = ours_batch(llm, batch, args.new_tokens)

    directory, filename = os.path.split(default_model_path())
    dtype = getattr(torch, args.dtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=dtype).eval()
    hf_single(hf, single[:8], 4)  # warm-up
    hf_1 = hf_single(hf, single, args.new_tokens)
    hf_b = None if args.skip_hf_batch else hf_batch(hf, batch, args.new_tokens)

    weight_bytes = llm.engine.weight_bytes
    gbs = weight_bytes * ours_1 / 1e9
    print(f"default model, dtype {args.dtype}, {threads} threads, torch {torch.__version__}")
    print("| workload | tachyllm | transformers | ratio |")
    print("|---|---|---|---|")
    print(
        f"| single stream decode tok/s ({args.prompt_len} in / {args.new_tokens} out) | "
        f"{ours_1:.1f} | {hf_1:.1f} | {ours_1 / hf_1:.2f}x |"
    )
    if hf_b is not None:
        print(
            f"| offline batch {args.batch} x ({args.batch_prompt_len} in / {args.new_tokens} out), output tok/s | "
            f"{ours_b:.1f} | {hf_b:.1f} | {ours_b / hf_b:.2f}x |"
        )
    else:
        print(
            f"| offline batch {args.batch} x ({args.batch_prompt_len} in / {args.new_tokens} out), output tok/s | "
            f"{ours_b:.1f} | skipped | |"
        )
    print(
        f"single-stream weight bandwidth: {weight_bytes / 1e6:.0f} MB x {ours_1:.1f} steps/s = {gbs:.1f} GB/s "
        f"({100 * gbs / args.bandwidth_gbs:.0f}% of {args.bandwidth_gbs:.0f} GB/s)"
    )


if __name__ == "__main__":
    main()
