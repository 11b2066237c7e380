"""A request's sampling fields as SamplingParams: max_tokens resolved against the context, logit_bias parsed."""

from __future__ import annotations

import re

from tachyllm.sampling_params import RequestOutputKind, SamplingParams
from tachyllm.server import protocol as p
from tachyllm.server.errors import bad_request
from tachyllm.server.state import ServedModel


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias: token ids (as JSON object keys, so strings) -> a bias in [-100, 100]. The
    engine's InputProcessor checks the ids against the vocabulary, as every other token id a request names."""
    if not bias:
        return None
    parsed = {}
    for key, value in bias.items():
        if not re.fullmatch(r"[0-9]{1,10}", key):
            raise bad_request(f"logit_bias keys must be token ids, got {key[:20]!r}", param="logit_bias")
        parsed[int(key)] = value
    return parsed


def resolve_max_tokens(
    model: ServedModel, requested: int | None, prompt_len: int, prompt_param: str, max_param: str
) -> int:
    """The request's max_tokens; by default whatever room the context leaves, as vLLM does."""
    limit = model.context_limit
    if prompt_len >= limit:
        raise bad_request(
            f"the prompt has {prompt_len} tokens but this server's context limit is {limit} tokens "
            "(prompt and output together); shorten the prompt",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise bad_request(
            f"this server's context limit is {limit} tokens, but {prompt_len + requested} were requested "
            f"({prompt_len} in the prompt, {requested} for the output); lower {max_param} or shorten the prompt",
            param=max_param,
            code="context_length_exceeded",
        )
    return requested


def sampling_params(
    body: p.SamplingFields, max_tokens: int, logprobs: int | None, bias: dict[int, float] | None
) -> SamplingParams:
    options = {
        "n": body.n,
        "temperature": body.temperature,
        "top_p": body.top_p,
        # vLLM reads top_k 0 as "disabled", like -1.
        "top_k": -1 if body.top_k == 0 else body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "seed": body.seed,
        "min_tokens": body.min_tokens,
        "stop": body.stop,
        "stop_token_ids": body.stop_token_ids,
        "logprobs": logprobs,
        "logit_bias": bias,
    }
    try:
        # Unset (None) fields take SamplingParams' defaults, which are OpenAI's.
        # Per-step deltas, streamed or not: a response accumulates them (output_stream.py).
        return SamplingParams(
            max_tokens=max_tokens, ignore_eos=body.ignore_eos, output_kind=RequestOutputKind.DELTA,
            **{k: v for k, v in options.items() if v is not None},
        )  # fmt: skip
    except ValueError as e:  # cross-field checks (e.g. min_tokens > max_tokens); messages start with the field
        raise bad_request(str(e), param=str(e).split(" ", 1)[0]) from None
