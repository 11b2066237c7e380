"""The `tachy` command: generate (stream one completion), chat (interactive REPL)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator

import torch

from tachyllm.config import BACKENDS, QUANT_ACTIVATION_BITS, EngineConfig
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.errors import TachyError
from tachyllm.sampling_params import SamplingParams


def at_least(kind: type, minimum: float, inclusive: bool = True):
    """An argparse type: a number of `kind` that is >= minimum (> minimum when not inclusive)."""

    def parse(text: str):
        value = kind(text)
        if not (value >= minimum if inclusive else value > minimum):  # also rejects NaN
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {minimum}, got {text}")
        return value

    return parse


positive_int = at_least(int, 1)
non_negative_int = at_least(int, 0)
positive_float = at_least(float, 0, inclusive=False)
non_negative_float = at_least(float, 0)


def _int_or_none(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def byte_size(text: str) -> int:
    """Accepts plain bytes or a size like 512M / 2G."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or Hugging Face model directory (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="weights and activations dtype; auto = bfloat16")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--max-model-len", type=int, default=None, help="context length limit (default: the model's)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--max-num-seqs", type=int, default=256, help="sequences running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    g.add_argument("--kv-cache-memory", type=byte_size, default=None, help="KV cache size in bytes, e.g. 2G (default: a share of free memory)")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false", help="disable prefix caching")
    g.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false", help="disable chunked prefill")
    g.add_argument(
        "--max-decode-slowdown", type=float, default=None,
        help="cut prefill chunks so that steps with running decodes take at most this factor of the decodes' own step, e.g. 2 (default: off)",
    )  # fmt: skip
    g.add_argument("--seed", type=int, default=0, help="engine seed for requests without their own")
    g.add_argument("--threads", type=int, default=None, help="compute threads (default: OMP_NUM_THREADS, or the usable CPUs: affinity mask, cgroup CPU quota)")
    g.add_argument("--quantization", default=None, help="weight-only quantization: int8, int4, awq, gguf (default: none)")
    g.add_argument("--quant-group-size", type=int, default=None, help="int4/awq group size: 32, 64 or 128 (default: largest that divides each layer)")
    g.add_argument("--quant-skip", default=None, help="layers kept unquantized, comma list: lm_head, attn, mlp, name fragments, or none (default: lm_head)")
    g.add_argument(
        "--quant-activation-bits", type=int, default=16, choices=QUANT_ACTIVATION_BITS,
        help="activation rounding of the int4/gguf C++ kernels: 16, or 8 (llama.cpp's Q8_1: faster batches, lower fidelity) (default: 16)",
    )  # fmt: skip
    g.add_argument("--kv-cache-dtype", default="auto", help="KV cache storage: auto (model dtype), fp8, fp8_e5m2, int8")
    g.add_argument("--backend", default="auto", choices=BACKENDS, help="execution backend: cpu (C++ kernels), torch (PyTorch ops); auto = cpu where they run")
    g.add_argument(
        "--speculative-config", default=None,
        help='speculative decoding, JSON: {"method": "ngram", "num_speculative_tokens": 4} or '
        '{"method": "draft_model", "model": "PATH|self:int4|self:layers=N", "num_speculative_tokens": 4}',
    )  # fmt: skip


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1, help="-1 = disabled")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=_int_or_none, default=None, help="per-request seed for reproducible sampling")
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        max_decode_slowdown=args.max_decode_slowdown,
        seed=args.seed,
        threads=args.threads,
        quantization=args.quantization,
        quant_group_size=args.quant_group_size,
        quant_skip=args.quant_skip,
        quant_activation_bits=args.quant_activation_bits,
        kv_cache_dtype=args.kv_cache_dtype,
        speculative_config=args.speculative_config,
        backend=args.backend,
    )


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.sampling_seed,
        min_tokens=args.min_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def stream(engine: LLMEngine, request_id: str, prompt: str | list[int], params: SamplingParams) -> Iterator[str]:
    """Yields text deltas of one request as the engine produces them."""
    engine.add_request(request_id, prompt, params)
    sent = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                text = out.outputs[0].text
                if len(text) > sent:
                    yield text[sent:]
                    sent = len(text)


def cmd_generate(args: argparse.Namespace) -> int:
    engine = LLMEngine(engine_config(args))
    params = sampling_params(args)
    prompt: str | list[int] = args.prompt
    if args.chat:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    for delta in stream(engine, "generate-0", prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    engine = LLMEngine(engine_config(args))
    params = sampling_params(args)
    messages: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    print("tachy chat: type a message, Ctrl-D or /exit to quit, /reset to forget the conversation.", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        text = engine.tokenizer.apply_chat_template(messages)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        reply = []
        sys.stdout.write("assistant> ")
        try:
            for delta in stream(engine, f"chat-{turn}", ids, params):
                reply.append(delta)
                sys.stdout.write(delta)
                sys.stdout.flush()
        except TachyError as e:  # e.g. the conversation outgrew the context: say so, keep the REPL
            print(f"\nerror: {e}", file=sys.stderr)
            messages.pop()
            continue
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
        turn += 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tachy", description="tachyllm: fast LLM inference on PyTorch")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream a completion of PROMPT to stdout")
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap PROMPT as a user message in the model's chat template")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive multi-turn chat using the model's chat template")
    chat.add_argument("--system", default=None, help="system prompt (default: the template's own)")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    from tachyllm.entrypoints.serve import add_serve_parser  # late: serve.py builds on this module

    add_serve_parser(sub)
    from tachyllm.eval.quality import add_eval_parser  # late: the eval builds on this module too

    add_eval_parser(sub)
    from tachyllm.bench.cli import add_bench_parser  # late: bench builds on this module too

    add_bench_parser(sub)
    return parser


def limit_interop_threads() -> None:
    """One inter-op thread. Intra-op threads (OpenMP, `--threads`) do the compute; the inter-op pool
    only serves torch.jit.fork-style tasks, which tachy never issues, so more of them could only
    compete for cores with the compute threads and, under `tachy serve`, the HTTP event loop. It can
    be set only before the first parallel work of the process, hence here; in a process that already
    did some (tests calling main() again), it stays as it is."""
    if torch.get_num_interop_threads() != 1:
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass


def main(argv: list[str] | None = None) -> int:
    limit_interop_threads()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except (TachyError, ValueError) as e:
        print(f"tachy: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
