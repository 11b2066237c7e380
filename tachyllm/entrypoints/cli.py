"""The `tachy` command: generate (stream one completion), chat (interactive REPL), and the subcommands
that serve, eval and bench register."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from dataclasses import replace

import torch

from tachyllm.argtypes import none_or
from tachyllm.bench.cli import add_bench_parser
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.engine_args import add_engine_args, engine_config
from tachyllm.entrypoints.serve import add_serve_parser
from tachyllm.errors import ConfigError, TachyError
from tachyllm.eval.quality import add_eval_parser
from tachyllm.outputs import RequestOutput
from tachyllm.sampling_params import RequestOutputKind, SamplingParams


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
    g.add_argument(
        "--sampling-seed", type=none_or(int), default=None, help="per-request seed for reproducible sampling"
    )
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


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
    engine.add_request(request_id, prompt, replace(params, output_kind=RequestOutputKind.DELTA))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and isinstance(out, RequestOutput) and out.outputs[0].text:
                yield out.outputs[0].text


def terminal_engine(args: argparse.Namespace) -> LLMEngine:
    """The engine of `tachy generate` / `tachy chat`, which trace nothing: a tracing flag is refused, not ignored."""
    if args.otlp_traces_endpoint is not None:
        raise ConfigError(
            "--otlp-traces-endpoint traces the requests of tachy serve, tachy bench and LLM(...); "
            "tachy generate and tachy chat export no traces"
        )
    return LLMEngine(engine_config(args))


def cmd_generate(args: argparse.Namespace) -> int:
    engine = terminal_engine(args)
    params = sampling_params(args)
    prompt: str | list[int] = args.prompt
    if args.chat:
        prompt = engine.input_processor.chat_prompt_ids([{"role": "user", "content": args.prompt}])
    for delta in stream(engine, "generate-0", prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    engine = terminal_engine(args)
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
        ids = engine.input_processor.chat_prompt_ids(messages)
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


# The namespace attribute naming the innermost (sub)command parser that parsed a command line.
_PARSED_BY = "_parsed_by"


class OneLineErrors(argparse.ArgumentParser):
    """A bad flag or value is one line on stderr (not argparse's usage block, which for `tachy serve`
    runs to dozens of lines) and exit status 2; subcommands' parsers are of this class too. Arguments
    no parser knows are told by the subcommand that was given them (`tachy serve: error: unrecognized
    arguments: ... (see tachy serve --help)`), not by `tachy`, whose help does not list its subcommands' flags."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if not hasattr(namespace, _PARSED_BY):  # a subcommand's parser returned first and set it
            setattr(namespace, _PARSED_BY, self)
        return namespace, extras

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        parser = getattr(namespace, _PARSED_BY)
        delattr(namespace, _PARSED_BY)
        if extras:
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="tachy", description="tachyllm: fast LLM inference on PyTorch")
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

    add_serve_parser(sub)
    add_eval_parser(sub)
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
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        return args.func(args)
    except (TachyError, ValueError) as e:
        print(f"tachy: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
