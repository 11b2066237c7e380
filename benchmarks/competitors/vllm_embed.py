"""vLLM's CPU build embedding a corpus with a sentence-transformers model (`runner="pooling"`,
`LLM.embed`), run by vLLM's own Python (it imports nothing of tachyllm), one engine per dtype. It
speaks vllm_rounds.py's protocol: when ready it sends, per dtype, the embeddings of the corpus's first
--check sentences (for the caller to compare with sentence-transformers') or the error that stopped
that dtype's engine; a `round` line embeds the whole corpus once per dtype and prints
{"rates": {dtype: inputs/s}}.

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_PYTHON vllm_embed.py --model FOLDER \\
        --corpus SENTENCES.json [--dtypes float32,bfloat16]    # then `round` lines on stdin

SENTENCES.json is a list of strings. embedding_bench.py offline --vllm-python runs it between its
own rounds.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from vllm_rounds import Round, error_text, serve_rounds


def setup(args: argparse.Namespace) -> tuple[dict[str, Any], Round]:
    import vllm
    from vllm import LLM

    corpus = json.loads(open(args.corpus).read())
    engines, ready = {}, {"vllm": vllm.__version__, "embeddings": {}, "errors": {}}
    for dtype in args.dtypes:
        try:
            llm = LLM(model=args.model, runner="pooling", dtype=dtype, max_model_len=args.max_model_len)
            outs = llm.embed(corpus[: args.check], use_tqdm=False)
        except Exception as exc:
            ready["errors"][dtype] = error_text(exc)
            continue
        engines[dtype] = llm
        ready["embeddings"][dtype] = [o.outputs.embedding for o in outs]

    def run_round() -> dict[str, Any]:
        rates = {}
        for dtype, llm in engines.items():
            start = time.perf_counter()
            llm.embed(corpus, use_tqdm=False)
            rates[dtype] = len(corpus) / (time.perf_counter() - start)
        return {"rates": rates}

    return ready, run_round


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a sentence-transformers folder")
    ap.add_argument("--corpus", required=True, help="a JSON list of sentences")
    ap.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    ap.add_argument("--check", type=int, default=100, help="sentences whose embeddings are sent when ready")
    ap.add_argument("--max-model-len", type=int, default=256)
    args = ap.parse_args()
    serve_rounds(lambda: setup(args))


if __name__ == "__main__":  # vLLM's engine processes import this module again: start nothing then
    main()
