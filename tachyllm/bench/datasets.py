"""Workloads for `tachy bench`: every dataset is a list of sessions of one or more turns.

A single-shot request is a one-turn session. A multi-turn session (the conversation dataset) sends
its turns one after another, each resending the history with the server's actual earlier replies,
so a later turn's prompt is only known at run time.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tachyllm.loading import Tokenizer

DATASETS = ("random", "shared-prefix", "conversation", "file", "sharegpt")
# vLLM's bounds on a ShareGPT conversation it keeps (benchmark_dataset.is_valid_sequence).
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT_LEN, SHAREGPT_MAX_TOTAL_LEN = 4, 1024, 2048


@dataclass
class Turn:
    text: str  # the user's message; for a one-turn session, the whole prompt
    output_len: int  # max_tokens asked for


@dataclass
class Session:
    turns: list[Turn]


@dataclass
class DatasetSpec:
    kind: str = "random"
    num_prompts: int = 100  # requests in all (turns, for conversations)
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0  # lengths uniform in [len * (1 - r), len * (1 + r)]
    prefix_len: int = 512  # shared-prefix: tokens every request of a group starts with
    num_groups: int = 4  # shared-prefix: distinct prefixes
    num_turns: int = 3  # conversation: user turns per session
    path: str | None = None  # file: JSONL of {"prompt": str, "output_len": int (optional)}; sharegpt: its JSON
    sharegpt_output_len: int | None = None  # sharegpt: max_tokens of every request (default: each reply's length)


def sample_lengths(mean: int, range_ratio: float, n: int, rng: np.random.Generator) -> list[int]:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    low, high = max(1, math.floor(mean * (1 - range_ratio))), max(1, math.ceil(mean * (1 + range_ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def random_token_ids(tokenizer: Tokenizer, length: int, rng: np.random.Generator) -> list[int]:
    """Uniform over the ordinary vocabulary: a special token in the text could end or restructure a prompt."""
    ids: list[int] = []
    while len(ids) < length:
        draw = rng.integers(0, tokenizer.vocab_size, size=2 * (length - len(ids)) + 8)
        ids.extend(int(t) for t in draw if not tokenizer.is_special(int(t)))
    return ids[:length]


def random_text(tokenizer: Tokenizer, length: int, rng: np.random.Generator) -> str:
    """Text of about `length` tokens. Decoding random ids and encoding again merges or splits some
    tokens, so the ids are re-cut once to the target length; the few tokens of drift that remain
    do not matter because prompt lengths are measured on the text actually sent."""
    ids = tokenizer.encode(tokenizer.decode(random_token_ids(tokenizer, length, rng)), add_special_tokens=False)
    if len(ids) < length:
        ids += random_token_ids(tokenizer, length - len(ids), rng)
    return tokenizer.decode(ids[:length])


def build_sessions(spec: DatasetSpec, tokenizer: Tokenizer, rng: np.random.Generator) -> list[Session]:
    if spec.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {spec.num_prompts}")
    n = spec.num_prompts
    if spec.kind == "random":
        inputs = sample_lengths(spec.input_len, spec.range_ratio, n, rng)
        outputs = sample_lengths(spec.output_len, spec.range_ratio, n, rng)
        return [Session([Turn(random_text(tokenizer, i, rng), o)]) for i, o in zip(inputs, outputs)]
    if spec.kind == "shared-prefix":
        prefixes = [random_text(tokenizer, spec.prefix_len, rng) for _ in range(spec.num_groups)]
        inputs = sample_lengths(spec.input_len, spec.range_ratio, n, rng)
        outputs = sample_lengths(spec.output_len, spec.range_ratio, n, rng)
        # Round-robin over groups: requests of one group are spread over the run, as users would be.
        return [
            Session([Turn(prefixes[k % spec.num_groups] + random_text(tokenizer, i, rng), o)])
            for k, (i, o) in enumerate(zip(inputs, outputs))
        ]
    if spec.kind == "conversation":
        if spec.num_turns < 1:
            raise ValueError(f"--num-turns must be >= 1, got {spec.num_turns}")
        inputs = sample_lengths(spec.input_len, spec.range_ratio, n, rng)
        outputs = sample_lengths(spec.output_len, spec.range_ratio, n, rng)
        turns = [Turn(random_text(tokenizer, i, rng), o) for i, o in zip(inputs, outputs)]
        return [Session(turns[k : k + spec.num_turns]) for k in range(0, n, spec.num_turns)]
    if spec.kind == "file":
        return [Session([turn]) for turn in read_prompt_file(spec.path, spec.output_len, n)]
    if spec.kind == "sharegpt":
        return [Session([turn]) for turn in read_sharegpt(spec.path, tokenizer, n, spec.sharegpt_output_len, rng)]
    raise ValueError(f"unknown dataset {spec.kind!r}; choose from {', '.join(DATASETS)}")


def read_prompt_file(path: str | None, default_output_len: int, n: int) -> list[Turn]:
    """The first n prompts of a JSONL file, cycling through it again when it holds fewer."""
    if path is None:
        raise ValueError("--dataset file needs --dataset-path FILE.jsonl")
    turns = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            turns.append(Turn(str(record["prompt"]), int(record.get("output_len", default_output_len))))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f'{path}:{number}: expected {{"prompt": str, "output_len": int}}: {e}') from e
    if not turns:
        raise ValueError(f"{path} holds no prompts")
    return [turns[k % len(turns)] for k in range(n)]


def read_sharegpt(
    path: str | None, tokenizer: Tokenizer, n: int, output_len: int | None, rng: np.random.Generator
) -> list[Turn]:
    """n requests drawn as vLLM's ShareGPT dataset draws them: conversations in random order, each one's first
    message the prompt and the reply's token count its max_tokens (or `output_len`), keeping those of 4 to
    1024 prompt tokens, 4 or more output tokens and 2048 at most together; cycling when fewer are kept."""
    if path is None:
        raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json (a local ShareGPT file)")
    try:
        records = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the ShareGPT file {path}: {e}") from e
    if not isinstance(records, list):
        raise ValueError(f'{path}: expected a ShareGPT JSON list of {{"conversations": [...]}}')
    turns: list[Turn] = []
    for index in rng.permutation(len(records)):
        conversation = records[index].get("conversations") if isinstance(records[index], dict) else None
        if not isinstance(conversation, list) or len(conversation) < 2:
            continue
        try:
            prompt, reply = str(conversation[0]["value"]), str(conversation[1]["value"])
        except (KeyError, TypeError):
            continue
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        wanted = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        too_short = prompt_len < SHAREGPT_MIN_LEN or (output_len is None and wanted < SHAREGPT_MIN_LEN)
        if too_short or prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + wanted > SHAREGPT_MAX_TOTAL_LEN:
            continue
        turns.append(Turn(prompt, wanted))
        if len(turns) == n:
            break
    if not turns:
        raise ValueError(f"{path} holds no usable ShareGPT conversation (two messages, within vLLM's lengths)")
    return [turns[k % len(turns)] for k in range(n)]
