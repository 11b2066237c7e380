"""A request body parsed strictly into its protocol model, with errors that name the field at fault,
and the refusal of fields this server does not support."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from tachyllm.server import protocol as p
from tachyllm.server.errors import APIError, bad_request

if TYPE_CHECKING:
    from tachyllm.server.state import ServedModel, ServerState

T = TypeVar("T", bound=BaseModel)
GenerationRequest = TypeVar("GenerationRequest", bound=p.SamplingFields)

# What a union-typed field accepts, for one readable message instead of one per alternative.
UNION_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts",
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
    "guided_json": "a JSON schema (an object, or its JSON text)",
    "json": "a JSON schema (an object, or its JSON text)",
    "input": "a string or a list of messages",
}


async def parse_body(request: Request, model: type[T]) -> T:
    raw = await request.body()
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as e:
        raise invalid_body(e, {**UNION_HINTS, **getattr(model, "UNION_HINTS", {})}) from None


async def parse_generation_request(
    request: Request, model: type[GenerationRequest], state: ServerState
) -> tuple[GenerationRequest, ServedModel]:
    """A completions or chat request's body and the model it names, refused (400/404) for what no
    generation route serves: a model not served or not a generation model, a field this server does not
    support, too many choices; checked in that order."""
    body = await parse_body(request, model)
    served = state.model(body.model)
    served.check_task("generate", request.url.path)
    reject_unsupported(body)
    state.check_n(body.n)
    return body, served


def invalid_body(e: ValidationError, hints: dict[str, str] = UNION_HINTS) -> APIError:
    """The first error of `e` as a 400 naming the field; a union-typed field's errors as one, saying
    what the field accepts (`hints`, by field name; "field[]" for the items of a list)."""
    errors = e.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return bad_request(f"malformed JSON body: {first['msg']}", code="invalid_json")
    if not first["loc"]:
        return bad_request("the request body must be a JSON object")
    # A union-typed field reports one error per alternative, all under the field's location.
    related = [err for err in errors if err["loc"][:1] == first["loc"][:1]]
    common = related[0]["loc"]
    for err in related[1:]:
        k = 0
        while k < min(len(common), len(err["loc"])) and common[k] == err["loc"][k]:
            k += 1
        common = common[:k]
    hint_key = None
    if common:
        hint_key = f"{common[-2]}[]" if isinstance(common[-1], int) and len(common) > 1 else common[-1]
    if len(related) > 1 and hint_key in hints:
        path = loc_path(common)
        # The value had the type of one alternative and broke its constraint (too long, < 0, ...):
        # that one says what is wrong (its location, less the alternative's name).
        # An unknown field inside the one alternative that has fields says it best.
        broken = [err for err in related if err["type"] == "extra_forbidden"]
        broken = broken or [err for err in related if not err["type"].endswith("_type")]
        if len(broken) == 1:
            err = broken[0]
            where = loc_path(common + err["loc"][len(common) + 1 :])
            if err["type"] == "extra_forbidden":
                return unknown_field(where)
            return bad_request(f"{where}: {err['msg']}{got(err)}", param=path)
        return bad_request(f"{path} must be {hints[hint_key]}", param=path)
    path = loc_path(first["loc"])
    if first["type"] == "extra_forbidden":
        return unknown_field(path)
    return bad_request(f"{path}: {first['msg']}{got(first)}", param=path)


def unknown_field(path: str) -> APIError:
    name = path.rsplit(".", 1)[-1]
    if "." not in path and name in p.UNSUPPORTED_FIELDS:
        return bad_request(f"{name}: {p.UNSUPPORTED_FIELDS[name]}", param=name)
    return bad_request(f"unknown field {path!r}: this server does not support it", param=path)


def got(err: ErrorDetails) -> str:
    return "" if err["type"] == "missing" else f" (got {repr(err['input'])[:100]})"


def loc_path(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def reject_unsupported(body: p.SamplingFields) -> None:
    if isinstance(body, p.CompletionRequest):
        if body.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != (body.n or 1):
            raise bad_request("best_of other than n is not supported", param="best_of")
        if body.max_tokens == 0 and not body.echo:
            raise bad_request("max_tokens 0 needs echo (it returns the prompt alone)", param="max_tokens")
    if body.prompt_logprobs is not None and body.stream:
        raise bad_request("prompt_logprobs are not available with stream (as in vLLM)", param="prompt_logprobs")
    if isinstance(body, p.ChatCompletionRequest):  # the other kind of generation request
        if body.top_logprobs and not body.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        if body.modalities is not None and any(m != "text" for m in body.modalities):
            raise bad_request('only text output is supported: modalities must be ["text"]', param="modalities")
