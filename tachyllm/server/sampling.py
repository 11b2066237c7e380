"""A request's sampling fields as SamplingParams: max_tokens resolved against the context, logit_bias parsed."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

from tachyllm.errors import RequestError
from tachyllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from tachyllm.server import protocol as p
from tachyllm.server.errors import bad_request
from tachyllm.server.request_trace import current_request
from tachyllm.server.state import ServedModel

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


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


def constraint_field(body: p.SamplingFields) -> str | None:
    """The request field that carries its structured-output constraint, if any; 400 when several do."""
    fields = []
    if body.response_format is not None and body.response_format.type != "text":
        fields.append("response_format")
    if body.structured_outputs is not None:
        fields.append("structured_outputs")
    fields += [name for name in GUIDED_FIELDS if getattr(body, name) is not None]
    if len(fields) > 1:
        raise bad_request(f"give one structured-output constraint, not {' and '.join(fields)}", param=fields[1])
    return fields[0] if fields else None


def structured_outputs(body: p.SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint, from whichever field carries it (constraint_field)."""
    field = constraint_field(body)
    if field is None:
        return None
    try:
        if field == "response_format":
            fmt = body.response_format
            assert fmt is not None, "constraint_field found it set"
            schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
            return format_constraint(fmt.type, schema, "response_format", "json_schema.schema")
        if field == "structured_outputs":
            so = body.structured_outputs
            assert so is not None, "constraint_field found it set"
            return StructuredOutputsParams(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar, json_object=so.json_object
            )
        return StructuredOutputsParams(**{GUIDED_FIELDS[field]: getattr(body, field)})
    except ValueError as e:
        raise bad_request(f"{field}: {e}", param=field) from None


def format_constraint(kind: str, schema: dict | None, param: str, schema_path: str) -> StructuredOutputsParams | None:
    """OpenAI's output formats (chat's response_format, the Responses API's text.format) as a constraint:
    "text" is none, "json_object" any JSON object, "json_schema" the schema at `schema_path` (in `param`)."""
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if schema is None:
        raise bad_request(f"{param} of type json_schema needs {schema_path}", param=param)
    return StructuredOutputsParams(json=schema)


def constraint_param(body: p.SamplingFields) -> str:
    """The field an error about the request's constraint names: the one carrying it, else the tools (a
    chat's tool_choice grammar is built from their parameters), else structured_outputs."""
    return constraint_field(body) or ("tools" if getattr(body, "tools", None) else "structured_outputs")


async def compile_constraint(model: ServedModel, params: SamplingParams, field: str) -> None:
    """Compiles the request's grammar off the event loop (the engine then finds it cached); a
    constraint that cannot be compiled is a 400 naming the `field` it came in."""
    if params.structured_outputs is None:
        return
    started = time.perf_counter()
    try:
        await asyncio.to_thread(model.processor.compile_grammar, params)
    except RequestError as e:
        raise bad_request(f"{field}: {e}", param=field) from None
    finally:
        if (traced := current_request()) is not None:
            traced.grammar_compile_seconds += time.perf_counter() - started


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
    if requested is None:  # the room left, or less where the model's generation config says so
        return min(limit - prompt_len, model.sampling_defaults.get("max_tokens", limit))
    if prompt_len + requested > limit:
        raise bad_request(
            f"this server's context limit is {limit} tokens, but {prompt_len + requested} were requested "
            f"({prompt_len} in the prompt, {requested} for the output); lower {max_param} or shorten the prompt",
            param=max_param,
            code="context_length_exceeded",
        )
    return requested


def prompt_logprobs(body: p.SamplingFields) -> int | None:
    """How many alternatives each prompt token's logprob entry needs: vLLM's prompt_logprobs, and a
    completion's echo with logprobs (the echoed prompt's, in the choice's logprobs)."""
    wanted = [body.prompt_logprobs]
    if isinstance(body, p.CompletionRequest) and body.echo:
        wanted.append(body.logprobs)
    return max([n for n in wanted if n is not None], default=None)


def with_defaults(options: dict[str, Any], defaults: dict[str, Any] | None) -> dict[str, Any]:
    """The request's set (not None) sampling options over the model's generation-config defaults;
    max_tokens excepted (resolve_max_tokens applies that one)."""
    fallback = {k: v for k, v in (defaults or {}).items() if k != "max_tokens"}
    return {**fallback, **{k: v for k, v in options.items() if v is not None}}


def sampling_params(
    body: p.SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    bias: dict[int, float] | None,
    tool_constraint: StructuredOutputsParams | None = None,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """`tool_constraint`: the grammar of a chat's tool_choice ("required" or a named tool); `defaults`: the
    values of fields the request leaves unset (ServedModel.sampling_defaults)."""
    constraint = structured_outputs(body)
    if constraint is not None and tool_constraint is not None:
        field = constraint_field(body)
        choice = body.tool_choice if isinstance(body, p.ChatCompletionRequest) else None
        raise bad_request(f"{field} cannot be combined with tool_choice {choice!r}", param=field)
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
        "allowed_token_ids": body.allowed_token_ids,
        "bad_words": body.bad_words,
        "truncate_prompt_tokens": body.truncate_prompt_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs(body),
        "logit_bias": bias,
        "structured_outputs": constraint or tool_constraint,
    }
    try:
        # Unset (None) fields take `defaults`, else SamplingParams' defaults, which are OpenAI's.
        # Per-step deltas, streamed or not: a response accumulates them (output_stream.py).
        return SamplingParams(
            max_tokens=max_tokens, ignore_eos=body.ignore_eos, output_kind=RequestOutputKind.DELTA,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            **with_defaults(options, defaults),
        )  # fmt: skip
    except ValueError as e:  # cross-field checks (e.g. min_tokens > max_tokens); messages start with the field
        raise bad_request(str(e), param=str(e).split(" ", 1)[0]) from None
