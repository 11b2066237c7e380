"""vLLM's CPU build on lora_bench.py's offline workload, run by vLLM's own Python (it imports nothing
of tachyllm): the same token-id prompts, greedy, EOS ignored, on a base engine without LoRA and on an
`enable_lora` engine over the same PEFT adapters, one adapter per prompt in turn. It speaks
vllm_rounds.py's protocol: a `round` line on stdin runs both engines once and prints
{"base": tok/s, "lora": tok/s} (output tokens over the wall time of `generate`, prefill included).
Where the LoRA engine fails, at start or in a round, "lora" is null and "lora_error" has the error.

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_PYTHON vllm_lora.py --model HF_DIR \\
        --prompts PROMPTS.json --adapters DIR [DIR ...]    # then `round` lines on stdin

PROMPTS.json is a list of token-id lists. lora_bench.py --vllm-python runs it between its own rounds.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from vllm_rounds import Round, error_text, serve_rounds


def output_rate(llm: Any, prompts: list[Any], params: Any, lora_request: Any = None) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=lora_request, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def setup(args: argparse.Namespace) -> tuple[dict[str, Any], Round]:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.loads(open(args.prompts).read())]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    common = dict(model=args.model, dtype=args.dtype, max_num_seqs=len(prompts),
                  max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len)  # fmt: skip
    base = LLM(**common)
    base.generate(prompts[: len(args.adapters)], warm, use_tqdm=False)
    adapters = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(args.adapters)]
    mixed = [adapters[i % len(adapters)] for i in range(len(prompts))]
    lora, lora_error = None, None
    try:
        lora = LLM(**common, enable_lora=True, max_loras=len(adapters), max_lora_rank=args.max_lora_rank)
        lora.generate(prompts[: len(adapters)], warm, lora_request=adapters, use_tqdm=False)  # loads every adapter
    except Exception as exc:
        lora_error = error_text(exc)

    def run_round() -> dict[str, Any]:
        result: dict[str, Any] = {"base": output_rate(base, prompts, params), "lora": None, "lora_error": lora_error}
        if lora is not None:
            try:
                result["lora"] = output_rate(lora, prompts, params, mixed)
            except Exception as exc:
                result["lora_error"] = error_text(exc)
        return result

    return {"vllm": vllm.__version__, "lora_error": lora_error}, run_round


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the base model's Hugging Face folder")
    ap.add_argument("--prompts", required=True, help="a JSON list of token-id lists")
    ap.add_argument("--adapters", nargs="+", required=True, help="PEFT adapter folders")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-lora-rank", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    serve_rounds(lambda: setup(args))


if __name__ == "__main__":  # vLLM's engine processes import this module again: start nothing then
    main()
