"""The JSON bodies of the HTTP API as pydantic models: OpenAI's shapes, plus vLLM's extensions.

Requests are validated in strict mode (no "5" -> 5 coercion), so a wrong type is a 400 naming the
field rather than a silent guess; an integral number (17.0) is an integer, as JSON Schema has it.
Every number must be finite (no Infinity, NaN, or 1e400). Ranges live here too, as the API's
contract; SamplingParams checks them again for offline callers. Optional sampling fields accept an
explicit null as "default". A field no model here declares is a 400 naming it (never silently dropped:
the client would believe it was applied); UNSUPPORTED_FIELDS says why for the features we know and
do not serve.
"""

from __future__ import annotations

import time
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from tachyllm.sampling_params import LOGIT_BIAS_RANGE, MAX_LOGPROBS


def _integral_float_as_int(value: object) -> object:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# Integer field types with bounds; each accepts integral floats (17.0).
_AS_INT = BeforeValidator(_integral_float_as_int)


def route_checked(schema: dict) -> object:
    """Documents in the JSON schema the only values the server supports, while validation lets the
    others through to the route, which refuses them with a message that says what is unsupported."""
    return Field(json_schema_extra=schema)


def route_checked_rules(*rules: dict) -> ConfigDict:
    """Documents in a model's JSON schema rules that tie its fields together (each a JSON schema the
    body must match as well), which the route checks itself, as route_checked's values, with a
    message naming the field. A subclass's rules replace its parent's: it lists them all."""
    return ConfigDict(json_schema_extra={"allOf": list(rules)})


NULL: dict = {"type": "null"}


def only_one_given(fields: dict[str, dict]) -> dict:
    """At most one of `fields` is given: a rule whose branches each leave all fields but one unset,
    unset meaning what each field's schema says (its value when absent, usually null)."""
    return {"anyOf": [{"properties": {g: unset for g, unset in fields.items() if g != f}} for f in fields]}


NonNegFloat = Annotated[float, Field(ge=0)]
Probability = Annotated[float, Field(ge=0, le=1)]
TopP = Annotated[float, Field(gt=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
PositiveFloat = Annotated[float, Field(gt=0)]
PositiveInt = Annotated[int, Field(ge=1), _AS_INT]
NonNegInt = Annotated[int, Field(ge=0), _AS_INT]
TopK = Annotated[int, Field(ge=-1), _AS_INT]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), _AS_INT]
TokenId = Annotated[
    int, Field(ge=0, json_schema_extra={"x-token-id": True}), _AS_INT
]  # openapi.py adds the vocabulary's bound
Seed = Annotated[int, Field(ge=0, lt=2**63), _AS_INT]  # what a torch.Generator accepts, with room for seed + i
Bias = Annotated[float, Field(ge=-LOGIT_BIAS_RANGE, le=LOGIT_BIAS_RANGE)]
# Per-token work for every step of a request grows with these lists: bounded, so that one request
# cannot slow the whole batch (OpenAI allows 4 stop strings and 300 biased tokens).
MAX_STOP_STRINGS = 64
MAX_LISTED_TOKENS = 1024
MAX_TOOLS = 128  # OpenAI's cap
Text = Annotated[str, Field(min_length=1)]


# OpenAI and vLLM request fields this server knows and does not serve: refused with this reason.
UNSUPPORTED_FIELDS = {
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "functions": "the legacy functions field is not supported; send tools",
    "function_call": "the legacy function_call field is not supported; send tool_choice",
    "reasoning_effort": "reasoning_effort is not supported; a model whose chat template has a thinking switch "
    'takes it in chat_template_kwargs, e.g. {"enable_thinking": false}',
    "use_beam_search": "beam search is not supported",
    "chat_template": "a chat template per request is not supported; start the server with --chat-template",
    "previous_response_id": "responses are not stored by this server; send the whole conversation as input",
    "conversation": "conversations are not stored by this server; send the whole conversation as input",
}


class Request(BaseModel):
    # Unknown fields are refused: a dropped field is a feature the client believes it got.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(Request):
    include_usage: bool = False
    # vLLM's: every streamed chunk carries the usage so far.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(Request):
    """OpenAI's response_format.json_schema."""

    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


# A json_schema format needs its schema.
FORMAT_RULE = {
    "anyOf": [
        {"properties": {"type": {"enum": ["text", "json_object"]}}},
        {
            "required": ["json_schema"],
            "properties": {
                "json_schema": {"type": "object", "required": ["schema"], "properties": {"schema": {"type": "object"}}}
            },
        },
    ]
}


class ResponseFormat(Request):
    model_config = route_checked_rules(FORMAT_RULE)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


NonEmptyText = Annotated[str, route_checked({"minLength": 1})]
Choices = Annotated[list[str], route_checked({"minItems": 1})]


class StructuredOutputsField(Request):
    """vLLM's structured_outputs: exactly one constraint."""

    model_config = route_checked_rules(
        {
            "anyOf": [
                {"required": [name], "properties": {name: {"type": given}}}
                for name, given in (
                    ("json", ["object", "string"]),
                    ("regex", "string"),
                    ("choice", "array"),
                    ("grammar", "string"),
                )
            ]
            + [{"required": ["json_object"], "properties": {"json_object": {"const": True}}}]
        },
        only_one_given(
            {"json": NULL, "regex": NULL, "choice": NULL, "grammar": NULL, "json_object": {"enum": [None, False]}}
        ),
    )

    json_: dict | str | None = Field(default=None, alias="json")
    regex: NonEmptyText | None = None
    choice: Choices | None = None
    grammar: NonEmptyText | None = None
    json_object: bool | None = None


CONSTRAINT_FIELDS_UNSET = {
    "response_format": {"anyOf": [NULL, {"properties": {"type": {"const": "text"}}}]},
    **{name: NULL for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")},
}
# One structured-output constraint at most.
ONE_CONSTRAINT_RULE = only_one_given(CONSTRAINT_FIELDS_UNSET)
# Prompt logprobs are not streamed (as in vLLM).
PROMPT_LOGPROBS_RULE = {
    "anyOf": [{"properties": {"prompt_logprobs": NULL}}, {"properties": {"stream": {"const": False}}}]
}
# Continuing the final message is no new turn: no generation prompt (as in vLLM).
CONTINUE_RULE = {
    "anyOf": [
        {"properties": {"continue_final_message": {"const": False}}},
        {"required": ["add_generation_prompt"], "properties": {"add_generation_prompt": {"const": False}}},
    ]
}


class SamplingFields(Request):
    """Fields that completions and chat completions share."""

    model_config = route_checked_rules(ONE_CONSTRAINT_RULE, PROMPT_LOGPROBS_RULE)

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: NonNegFloat | None = None
    top_p: TopP | None = None
    n: PositiveInt | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: str | None = None
    # Token id (a JSON object key, so a string) -> added to that token's logit.
    logit_bias: (
        Annotated[
            dict[str, Bias],
            Field(max_length=MAX_LISTED_TOKENS),
            route_checked({"propertyNames": {"pattern": "^[0-9]{1,10}$"}}),
        ]
        | None
    ) = None
    # vLLM extensions.
    top_k: TopK | None = None
    min_p: Probability | None = None
    repetition_penalty: PositiveFloat | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt | None = None
    # Each prompt token's logprob and top-N alternatives (not with stream, as in vLLM).
    prompt_logprobs: NumLogprobs | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_LISTED_TOKENS)] | None = None
    include_stop_str_in_output: bool = False
    # Only these tokens may be generated; never these words (as written and after a space).
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_LISTED_TOKENS)] | None = None
    bad_words: Annotated[list[NonEmptyText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    # Keep the prompt's last k tokens (-1: as many as the model's context holds).
    truncate_prompt_tokens: Literal[-1] | PositiveInt | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, or vLLM's older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict | str | None = None
    guided_regex: NonEmptyText | None = None
    guided_choice: Choices | None = None
    guided_grammar: NonEmptyText | None = None


class CompletionRequest(SamplingFields):
    model_config = route_checked_rules(
        ONE_CONSTRAINT_RULE,
        PROMPT_LOGPROBS_RULE,
        # max_tokens 0 with echo only (the prompt alone).
        {
            "anyOf": [
                {"properties": {"max_tokens": {"anyOf": [NULL, {"minimum": 1}]}}},
                {"required": ["echo"], "properties": {"echo": {"const": True}}},
            ]
        },
    )

    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    # 0 only with echo: the prompt (and its logprobs) alone.
    max_tokens: NonNegInt | None = None
    logprobs: NumLogprobs | None = None
    echo: bool = False
    best_of: PositiveInt | None = None
    suffix: Annotated[str, route_checked({"maxLength": 0})] | None = None


# A text part has its text.
TEXT_PART_RULE = {"required": ["text"], "properties": {"text": {"type": "string"}}}


class ContentPart(Request):
    model_config = route_checked_rules(TEXT_PART_RULE)

    type: Annotated[str, route_checked({"enum": ["text"]})]
    text: str | None = None
    # OpenAI's other parts, declared so that the route refuses them by their type.
    image_url: dict | None = None
    input_audio: dict | None = None
    file: dict | None = None


class FunctionCallIn(Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(Request):
    """A tool call an earlier assistant message made (in the history a client sends back)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


# What a message other than an assistant's has: content, and no tool calls.
CONTENT_GIVEN = {"type": ["string", "array"]}
NO_TOOL_CALLS = {"anyOf": [NULL, {"maxItems": 0}]}
# A response message's own fields, sent back on an assistant message only.
NO_ANSWER_FIELDS = {"tool_calls": NO_TOOL_CALLS, "refusal": NULL, "annotations": NULL}


class ChatMessage(Request):
    # Content is required but for an assistant's (which may carry tool calls instead); only an
    # assistant's carries tool calls, and a tool's names the call it answers.
    model_config = route_checked_rules(
        {
            "anyOf": [
                {"properties": {"role": {"const": "assistant"}}},
                {
                    "required": ["content"],
                    "properties": {
                        "role": {"enum": ["system", "developer", "user"]},
                        "content": CONTENT_GIVEN,
                        **NO_ANSWER_FIELDS,
                    },
                },
                {
                    "required": ["content", "tool_call_id"],
                    "properties": {
                        "role": {"const": "tool"},
                        "content": CONTENT_GIVEN,
                        "tool_call_id": {"type": "string"},
                        **NO_ANSWER_FIELDS,
                    },
                },
            ]
        }
    )

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call they answer
    # The other fields of OpenAI's response message, there when a client sends an answer back as it
    # came (message.model_dump()): a refusal's text, the answer's annotations; audio and the legacy
    # function_call are refused unless null.
    refusal: str | None = None
    annotations: list[dict] | None = None
    audio: Annotated[dict, route_checked({"not": {}})] | None = None
    function_call: Annotated[FunctionCallIn, route_checked({"not": {}})] | None = None


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionDefinition(Request):
    name: FunctionName
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Request):
    name: FunctionName


class NamedToolChoice(Request):
    type: Literal["function"]
    function: NamedFunction


TOOLS_GIVEN = {"type": "array", "minItems": 1}


class ChatCompletionRequest(SamplingFields):
    # ONE_CONSTRAINT_RULE is left out: with the rules below, schemathesis can no longer generate bodies.
    model_config = route_checked_rules(
        PROMPT_LOGPROBS_RULE,
        CONTINUE_RULE,
        # A tool_choice that calls tools needs tools, and no other constraint.
        {
            "anyOf": [
                {"properties": {"tool_choice": {"enum": [None, "none"]}}},
                {"required": ["tools"], "properties": {"tools": TOOLS_GIVEN, "tool_choice": {"const": "auto"}}},
                {"required": ["tools"], "properties": {"tools": TOOLS_GIVEN, **CONSTRAINT_FIELDS_UNSET}},
            ]
        },
        # top_logprobs with logprobs only.
        {
            "anyOf": [
                {"properties": {"top_logprobs": {"anyOf": [NULL, {"maximum": 0}]}}},
                {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
            ]
        },
    )

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    modalities: Annotated[list[str], route_checked({"items": {"enum": ["text"]}})] | None = None
    # Accepted and unused: nothing is stored, and there is one service tier.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # vLLM's chat extensions.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, object] | None = None


class ResponseContentPart(Request):
    """A text part of a Responses API input message: the client's (input_text) or an earlier answer's (output_text)."""

    model_config = route_checked_rules(TEXT_PART_RULE)

    type: Annotated[str, route_checked({"enum": ["input_text", "output_text"]})]
    text: str | None = None
    # What an output_text part of an earlier response carries when a client sends it back.
    annotations: list | None = None
    logprobs: list | None = None
    # Other input parts, declared so that the route refuses them by their type.
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


# The fields of each type of Responses API input item, and those it must have.
RESPONSE_ITEM_FIELDS = {
    "message": ("type", "id", "status", "role", "content"),
    "function_call": ("type", "id", "status", "call_id", "name", "arguments"),
    "function_call_output": ("type", "id", "status", "call_id", "name", "output"),
}
RESPONSE_ITEM_REQUIRED = {
    "message": ("role", "content"),
    "function_call": ("call_id", "name", "arguments"),
    "function_call_output": ("call_id", "output"),
}
RESPONSE_ITEM_ANY_FIELD = sorted({name for fields in RESPONSE_ITEM_FIELDS.values() for name in fields})


def response_item_rule() -> dict:
    """Each item type with its required fields given and the other types' fields unset (a message's type
    may be left out)."""
    branches = []
    for kind, fields in RESPONSE_ITEM_FIELDS.items():
        required = RESPONSE_ITEM_REQUIRED[kind]
        properties: dict = {name: NULL for name in RESPONSE_ITEM_ANY_FIELD if name not in fields}
        properties |= {name: {"not": NULL} for name in required}
        properties["type"] = {"enum": [kind, None] if kind == "message" else [kind]}
        branches.append(
            {"required": list(required) + ([] if kind == "message" else ["type"]), "properties": properties}
        )
    return {"anyOf": branches}


class ResponseInputItem(Request):
    """An item of the Responses API's input: a message (an earlier response's output message too), a
    function call an earlier response made, or a function call's output (the client's answer to it).
    One model for the three, as ChatMessage is one for every role: the route checks each type's fields."""

    model_config = route_checked_rules(response_item_rule())

    type: Annotated[str, route_checked({"enum": ["message", "function_call", "function_call_output"]})] | None = None
    id: str | None = None
    status: str | None = None
    # Messages (type "message", or no type).
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[ResponseContentPart] | None = None
    # function_call: the call (call_id) and what it called; function_call_output: the call it answers, and the answer.
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None  # JSON text, as OpenAI sends it
    output: str | list[ResponseContentPart] | None = None


class ResponseTextFormat(Request):
    """text.format: OpenAI's response formats, the json_schema one flattened."""

    model_config = route_checked_rules(
        {
            "anyOf": [
                {"properties": {"type": {"enum": ["text", "json_object"]}}},
                {"required": ["schema"], "properties": {"schema": {"type": "object"}}},
            ]
        }
    )

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseTextConfig(Request):
    format: ResponseTextFormat | None = None
    verbosity: str | None = None  # accepted, unused


class ResponseFunctionTool(Request):
    """A tool of the Responses API: OpenAI's function tool, flat (chat nests it under "function")."""

    model_config = route_checked_rules({"required": ["name"], "properties": {"name": {"type": "string"}}})

    type: Annotated[str, route_checked({"enum": ["function"]})]
    name: FunctionName | None = None  # required of a function tool, checked by the route
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class ResponseToolChoice(Request):
    """A tool_choice object of the Responses API: {"type": "function", "name": ...} names the tool to call."""

    model_config = route_checked_rules({"required": ["name"], "properties": {"name": {"type": "string"}}})

    type: Annotated[str, route_checked({"enum": ["function"]})]
    name: FunctionName | None = None


class ResponseReasoning(Request):
    """reasoning: accepted and without effect (no model here has a reasoning mode the server controls)."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponseStreamOptions(Request):
    include_obfuscation: bool | None = None  # accepted; the events carry no obfuscation padding


# include values: output_text logprobs are served; there are never reasoning items to add encrypted content to.
RESPONSE_INCLUDES = ["message.output_text.logprobs", "reasoning.encrypted_content"]


class ResponsesRequest(Request):
    """POST /v1/responses: stateless (nothing is stored, so nothing can be continued by id)."""

    # A tool_choice that calls tools needs tools.
    model_config = route_checked_rules(
        {
            "anyOf": [
                {"properties": {"tool_choice": {"enum": [None, "none", "auto"]}}},
                {"required": ["tools"], "properties": {"tools": TOOLS_GIVEN}},
            ]
        }
    )

    model: str | None = None
    input: Text | Annotated[list[ResponseInputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: NonNegFloat | None = None
    top_p: TopP | None = None
    stream: bool = False
    stream_options: ResponseStreamOptions | None = None
    text: ResponseTextConfig | None = None
    tools: Annotated[list[ResponseFunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Annotated[str, route_checked({"enum": ["none", "auto", "required"]})] | ResponseToolChoice | None = (
        None
    )
    parallel_tool_calls: bool | None = None
    include: list[Annotated[str, route_checked({"enum": RESPONSE_INCLUDES})]] | None = None
    top_logprobs: NumLogprobs | None = None
    reasoning: ResponseReasoning | None = None
    previous_response_id: Annotated[str, route_checked({"not": {}})] | None = None
    background: Annotated[bool, route_checked({"const": False})] | None = None
    # Accepted and unused: nothing is stored, the automatic prefix cache needs no key, and there is one service tier.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: Annotated[str, route_checked({"enum": ["disabled"]})] | None = None


class TokenizeRequest(Request):
    """vLLM's /tokenize: either a prompt or chat messages."""

    model_config = route_checked_rules(
        {
            "anyOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": NULL}},
                {
                    "required": ["messages"],
                    "properties": {"messages": {"type": "array"}, "prompt": NULL},
                    **CONTINUE_RULE,
                },
            ]
        },
    )

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, object] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(Request):
    model: str | None = None
    tokens: list[TokenId]


class LoadLoRAAdapterRequest(Request):
    """vLLM's /v1/load_lora_adapter body: the model name the adapter is served as, and its PEFT directory."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(Request):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; the name alone identifies the adapter here


# vLLM's truncate_prompt_tokens: keep that many tokens of a longer input; -1: the model's limit (0 is refused).
TruncatePromptTokens = Annotated[int, Field(ge=-1), route_checked({"not": {"const": 0}}), _AS_INT]
Texts = Text | Annotated[list[Text], Field(min_length=1)]  # a text, or a non-empty list of them
TEXTS_HINT = "a non-empty string or a non-empty list of them"


class PoolingRequest(Request):
    """The fields every pooling route's body has beside its inputs (vLLM's)."""

    model: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    user: str | None = None  # accepted and ignored, as by vLLM


class EmbeddingRequest(PoolingRequest):
    """OpenAI's /v1/embeddings body, with vLLM's truncate_prompt_tokens and normalize."""

    UNION_HINTS: ClassVar[dict[str, str]] = {
        "input": "a non-empty string, a list of strings, a list of token ids, or a list of token-id lists"
    }

    input: (
        Texts
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None  # only for a model with Matryoshka embeddings (route-checked)
    normalize: bool | None = None


class ScoreRequest(PoolingRequest):
    """vLLM's /v1/score: each text_1 scored against each text_2 (1-1, 1-N or N-N, pairwise)."""

    UNION_HINTS: ClassVar[dict[str, str]] = {"text_1": TEXTS_HINT, "text_2": TEXTS_HINT}

    text_1: Texts
    text_2: Texts


class RerankDocumentIn(Request):
    """A document given as an object (Jina's shape): its text."""

    text: Text


class RerankRequest(PoolingRequest):
    """vLLM's /v1/rerank, in Jina's and Cohere's shape: the documents ranked by relevance to the query."""

    UNION_HINTS: ClassVar[dict[str, str]] = {"documents[]": "a non-empty string or an object with a text field"}

    query: Text
    documents: Annotated[list[Text | RerankDocumentIn], Field(min_length=1)]
    top_n: NonNegInt | None = None  # None or 0: every document
    return_documents: bool = True


# -- responses ---------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    # None for an echoed prompt's first token (nothing precedes it).
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob, as its prompt_logprobs return it."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, None for the first, then token id -> PromptLogprob.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM: with the request's prompt_logprobs


class CompletionResponse(BaseModel):
    """Both the whole response and each streamed chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM: with the request's prompt_logprobs


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ResponseOutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = Field(default_factory=list)  # with include message.output_text.logprobs


class ResponseOutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[ResponseOutputText]


class ResponseFunctionCall(BaseModel):
    """A function_call output item: a tool call the answer made (call_id), for the client to run."""

    id: str
    type: Literal["function_call"] = "function_call"
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    arguments: str  # JSON text


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """The Responses API's response; the streamed events carry it too, as it stands at each point."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=_now)
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[ResponseOutputMessage | ResponseFunctionCall]
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict = Field(default_factory=lambda: {"format": {"type": "text"}})
    tools: list[dict] = Field(default_factory=list)
    tool_choice: str | dict[str, str] = "auto"
    parallel_tool_calls: bool = True
    top_logprobs: int | None = None
    previous_response_id: None = None
    background: Literal[False] = False
    store: bool = False
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


class ResponseStreamEvent(BaseModel):
    """One server-sent event of a streamed response: its `type`, its place in the stream, and the
    fields of that type (OpenAI's names)."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "tachyllm"
    root: str
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int
    # What the model is for: "generate" (completions, chat, responses), "embed" (embeddings, and score /
    # rerank by cosine similarity) or "score" (a cross-encoder: score and rerank); the routes it serves.
    task: Literal["generate", "embed", "score"]
    endpoints: list[str]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    # Floats, or with encoding_format base64 the little-endian float32 bytes in base64 (OpenAI's).
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int  # the document's position in the request
    relevance_score: float
    document: RerankDocument | None = None  # with return_documents


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]  # the most relevant first
    usage: PoolingUsage


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class LoRAAdapterResponse(BaseModel):
    lora_name: str
    message: str


class TokenizerInfoResponse(BaseModel):
    """vLLM's /tokenizer_info: what a client-side tokenizer needs (lm-eval's remote tokenizer reads it)."""

    tokenizer_class: str = "PreTrainedTokenizerFast"
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None = None
    add_bos_token: bool
    chat_template: str | None
    model_max_length: int


class VersionResponse(BaseModel):
    version: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
