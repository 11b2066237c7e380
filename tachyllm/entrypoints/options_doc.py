"""docs/options.md, rendered from the very argument groups `tachy serve` parses: the engine options
(generated from EngineConfig, engine_args.py), the server's (server/options.py) and the scale-out
options. The page therefore cannot drift from the flags; `make lint` checks the committed page.

    python -m tachyllm.entrypoints.options_doc > docs/options.md    # write the page (make options-doc)
    python -m tachyllm.entrypoints.options_doc --check docs/options.md    # exit 1 when it differs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tachyllm.entrypoints.cli import build_parser

HEADER = """# Options

The options of `tachy serve`, generated from the argument definitions (`make options-doc` rewrites
this page; `make lint` fails when it is out of date). `tachy generate`, `tachy chat`, `tachy bench`
and `tachy eval` take the same engine options.

Engine options are also the keyword arguments of `LLM(...)` and the keys of a model's entry in a
`models.yaml` (`tachy serve --config`), spelt with underscores (the *name* column). A switch shown as
`--name / --no-name` is a boolean; an optional number also takes `none`.
"""

# The request-level options, which no flag carries: written here, on the same page.
SAMPLING_PARAMETERS = """## Sampling parameters

Per request, `SamplingParams` (offline) or the request body (server, [server.md](server.md)):
`temperature` (0, or below 1e-5, = greedy), `top_k`, `top_p`, `min_p`, `repetition_penalty`,
`presence_penalty`, `frequency_penalty`, `seed` (same seed, same output, whatever else is in the batch:
[determinism.md](determinism.md)), `n`, `max_tokens`, `min_tokens`, `stop` (strings, never emitted),
`stop_token_ids`, `include_stop_str_in_output`, `ignore_eos`, `logprobs`, `prompt_logprobs` (vLLM's: each
prompt token's logprob and top-N), `logit_bias` (token id to a bias in [-100, 100]), `skip_special_tokens`,
`spaces_between_special_tokens`, `structured_outputs` ([structured_outputs.md](structured_outputs.md)), and
vLLM's `allowed_token_ids` (the only tokens sampled), `bad_words` (never generated: a word's last
token is banned where the output ends with the tokens before it, the word counted as written and after a
space) and `truncate_prompt_tokens` (keep the prompt's last N tokens; `-1`: `max_model_len`).
Invalid values raise `ValueError` naming the field; a token id outside the vocabulary fails that request
alone (`RequestOutput.error`). `output_kind` says what each output of `LLMEngine.step()` holds:
`CUMULATIVE` (everything so far), `DELTA` (what the step added) or `FINAL_ONLY` (`LLM.generate`).
"""

# The environment variables tachyllm reads: (name, default, meaning).
ENVIRONMENT = (
    (
        "TACHY_CACHE_DIR",
        "`~/.cache/tachyllm`",
        "checkpoint cache: a GGUF file's parsed config, tokenizer and dequantized float32 weights, written at its "
        "first load so that later starts skip parsing and dequantizing; a changed file gets a new entry, a damaged "
        "one is rebuilt; `off` disables it",
    ),
    ("TACHY_NATIVE", "on", "`0`: do not build or load the C++ kernels (the engine runs its PyTorch code path)"),
    ("TACHY_NATIVE_DIR", "`<cache>/tachyllm/native/<key>`", "where the C++ kernels are built (once per version)"),
    ("TACHY_NATIVE_MARCH", "`native`", "the compiler's `-march` for the C++ kernels, e.g. `haswell` (AVX2, FMA)"),
    ("TACHY_HUGE_PAGES", "on", "`0`: keep a CPU model's weights on malloc's pages, not 2 MiB transparent huge pages"),
    ("TACHY_API_KEY", "unset", "the server's `--api-key`"),
    ("OMP_NUM_THREADS", "the usable CPUs", "compute threads when `--threads` is not given"),
)

# The argument groups of `tachy serve` worth a section, in page order, with the sentence that opens it.
SECTIONS = {
    "engine": "The model, its numerics, the KV cache, scheduling and speculation (`EngineConfig`).",
    "server": "The HTTP server: address, authentication, request limits, CORS, health and logging.",
    "scale-out": "Serving on Ray Serve ([scale_out.md](scale_out.md)).",
}


def serve_parser() -> argparse.ArgumentParser:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices["serve"]


def _cell(text: str) -> str:
    """One Markdown table cell: no line breaks, and a literal '|' escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    # A help text that states its own default says it better (it may come from the environment).
    if "(default:" in (action.help or "") or action.default in (None, argparse.SUPPRESS):
        return ""
    if isinstance(action.default, list):
        return " ".join(f"`{v}`" for v in action.default)
    return f"`{action.default}`"


def _flags(action: argparse.Action) -> str:
    return " / ".join(f"`{flag}`" for flag in action.option_strings)


def _description(action: argparse.Action) -> str:
    text = action.help or ""
    if action.choices is not None:
        choices = ", ".join(f"`{c}`" for c in action.choices if c is not None)
        text = f"{text} (one of {choices})"
    return _cell(text)


def _section(group: argparse._ArgumentGroup, title: str, intro: str) -> list[str]:
    lines = [f"## {title}", "", intro, "", "| flag | name | default | description |", "|---|---|---|---|"]
    for action in group._group_actions:
        if action.help == argparse.SUPPRESS:
            continue
        lines.append(f"| {_flags(action)} | `{action.dest}` | {_default(action)} | {_description(action)} |")
    return [*lines, ""]


def render() -> str:
    """The whole page."""
    groups = {group.title.split(" ")[0]: group for group in serve_parser()._action_groups if group.title}
    lines = [HEADER]
    for title, intro in SECTIONS.items():
        lines += _section(groups[title], title.capitalize(), intro)
    lines.append(SAMPLING_PARAMETERS)
    lines += ["## Environment variables", "", "| variable | default | meaning |", "|---|---|---|"]
    lines += [f"| `{name}` | {default} | {meaning} |" for name, default, meaning in ENVIRONMENT]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render docs/options.md from the flag definitions.")
    parser.add_argument("--check", metavar="PATH", help="compare with this file instead of printing; 1 if it differs")
    args = parser.parse_args(argv)
    page = render()
    if args.check is None:
        sys.stdout.write(page)
        return 0
    path = Path(args.check)
    if not path.is_file() or path.read_text() != page:
        print(f"{path} is out of date: run `make options-doc`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
