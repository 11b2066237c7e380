"""Property-based fuzzing of the HTTP API with schemathesis, driven by the server's own
/openapi.json: every operation, schema-valid and schema-invalid requests. The server must never
answer 5xx, must answer only the statuses and content types it documents, with bodies that match
its response schemas, must refuse (4xx) whatever the schema does not allow, and must serve what
the schema allows but for the refusals no schema can foresee (SCHEMA_CANNOT_SAY)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
import schemathesis
from helpers.pooling_models import make_tiny_bert
from helpers.server import running_server
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode, checks

# Small limits keep each generated request cheap on a 2-core machine (n x max_tokens x prompts).
FLAGS = ["--max-model-len", "64", "--max-n", "2", "--max-prompts-per-request", "2", "--max-request-tokens", "256"]
EXAMPLES = 50  # per operation and mode: ~15 s in all on 2 cores
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_headers_conformance,
    checks.response_schema_conformance,
    checks.negative_data_rejection,
]


# Refusals of schema-valid requests that depend on more than the body's shape, as (param, message)
# patterns: the prompt's length in tokens, a constraint's content (a grammar, a regex or a JSON schema
# the grammar engine cannot use), token ids beyond the vocabulary as logit_bias keys, tool names that
# repeat or that tool_choice does not list, best_of other than n, min_tokens above the max_tokens in
# force, a continued final message that is not the assistant's or not where the chat template puts
# it. Anything else refused is a disagreement between the schema and the route.
SCHEMA_CANNOT_SAY = [
    (
        r"prompt|messages|input|max_tokens|max_completion_tokens|max_output_tokens",
        r"context limit|--max-request-tokens",
    ),
    (r"response_format|structured_outputs|guided_\w+|text\.format|tool_choice", r"structured outputs \(\w+\): "),
    (r"tools|tools\[\d+\]\..*", r"not a usable JSON schema|names must be unique"),
    (r"tool_choice", r"which is not among the tools"),
    (r"logit_bias", r"not in the vocabulary"),
    (r"best_of", r"best_of other than n"),
    (r"min_tokens", r"min_tokens must be an integer in \[0, max_tokens"),
    # Left out of the chat schema (protocol.ChatCompletionRequest says why).
    (r"response_format|structured_outputs|guided_\w+", r"give one structured-output constraint"),
    (r"continue_final_message", r"needs the last message to be the assistant's"),
    (r"messages", r"continue_final_message: the final message's content does not appear in the rendered chat"),
    # The fuzzed server's model generates text: the pooling routes (embeddings, score, rerank) refuse it.
    (r"model", r"is a text generation model: it serves .*, not /"),
    # A pooling model's own bounds: its embedding width (models of one server differ), its input limit.
    (r"dimensions", r"dimensions must be in \[1, \d+\]"),
    (r"input|documents|text_2", r"more than this model's limit|--max-request-tokens"),
    (r"text_2", r"give one text_1 for all, or as many as text_2"),
]


def schema_allowed_it(ctx, response, case) -> None:
    """A check for schema-valid requests: refused only for what no schema can say."""
    if response.status_code != 400:
        return
    error = response.json()["error"]
    param, message = error["param"] or "", error["message"]
    if not any(re.fullmatch(p, param) and re.search(m, message) for p, m in SCHEMA_CANNOT_SAY):
        raise AssertionError(f"the schema allows this request, the route refused it: {param}: {message}")


@pytest.fixture(scope="module")
def base(tiny_model_factory) -> Iterator[str]:
    with running_server(str(tiny_model_factory("llama")), *FLAGS) as url:
        yield url


@pytest.fixture(scope="module")
def api(base) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{base}/openapi.json")


def fuzz_operations(api: schemathesis.BaseSchema, paths: set[str] | None = None) -> int:
    """Fuzzes every operation (those of `paths` only, if given); returns how many, failing with every
    operation's failure in one report."""
    failures, operations = [], 0
    for result in api.get_all_operations():
        operation = result.ok()
        if paths is not None and operation.path not in paths:
            continue
        operations += 1
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            checks = CHECKS + ([schema_allowed_it] if mode == GenerationMode.POSITIVE else [])

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            def fuzz(case) -> None:
                case.call_and_validate(checks=checks)

            try:
                fuzz()
            except Unsatisfiable:  # no input breaks this operation's schema (no body, any string)
                assert mode == GenerationMode.NEGATIVE
            except Exception as e:  # keep going: one report with every operation's failure
                failures.append(f"{operation.label} ({mode}): {e}")
    assert not failures, "\n\n".join(failures)
    return operations


@pytest.mark.slow  # a long workload: every operation of the API fuzzed (~30 s)
def test_every_operation_survives_fuzzing(api):
    """schemathesis' pytest plugin does not run under this pytest; its strategies run under hypothesis directly."""
    assert fuzz_operations(api) >= 8


POOLING_PATHS = {"/v1/embeddings", "/v1/score", "/v1/rerank"}  # /v2/rerank and /rerank: /v1/rerank's route


def test_pooling_operations_survive_fuzzing(tmp_path_factory):
    """The pooling routes on a model that serves them (the fuzzed generation model refuses them whole)."""
    model = make_tiny_bert(tmp_path_factory.mktemp("embedder"), is_matryoshka=True)
    with running_server(str(model), *FLAGS, "--max-pooling-inputs", "4") as url:
        assert fuzz_operations(schemathesis.openapi.from_url(f"{url}/openapi.json"), POOLING_PATHS) == 3


USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TEXT_FORMAT = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}
# (path, body, the field a refusal names or None for a body that is served), the schema and the route
# agreeing on each: the rules between fields that no field's own type says.
BODIES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "system"}, USER]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [USER, {"role": "assistant", "content": None}], "max_tokens": 1}, None),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "12:00"}]}, "messages[0].tool_call_id"),
    ("/v1/chat/completions", {"messages": [{**USER, "tool_calls": [{"id": "1", "function": {"name": "f",
                                                                     "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                              "max_tokens": 1}, None),
    ("/v1/chat/completions", {"messages": [USER], "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [USER], "tool_choice": "auto", "tools": []}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [USER], "tool_choice": "none", "max_tokens": 1}, None),
    ("/v1/chat/completions", {"messages": [USER], "tool_choice": "none", "tools": [TOOL], "max_tokens": 1}, None),
    ("/v1/chat/completions", {"messages": [USER], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [USER], "top_logprobs": 2, "logprobs": False}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [USER], "top_logprobs": 2, "logprobs": True, "max_tokens": 1}, None),
    ("/v1/chat/completions", {"messages": [USER], "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [USER, {"role": "assistant", "content": "It"}],
                              "continue_final_message": True}, "continue_final_message"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": ""}, "stop"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"12345678901": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"choice": []}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a+", "json_object": True}},
     "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json_object": False}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "structured_outputs": {"regex": "a+",
                                                                                "json_object": False}}, None),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "hi", "messages": [USER]}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ("/tokenize", {"prompt": "hi"}, None),
    ("/tokenize", {"messages": [USER]}, None),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ("/v1/responses", {"input": "hi", "previous_response_id": ""}, "previous_response_id"),
    ("/v1/responses", {"input": "hi", "tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 1, "text": TEXT_FORMAT}, None),
]  # fmt: skip


@pytest.mark.parametrize("path, body, param", BODIES)
def test_the_schema_says_what_the_route_accepts(base, path, body, param):
    document = httpx.get(f"{base}/openapi.json").json()
    request_schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    validator = jsonschema.Draft202012Validator({**request_schema, "components": document["components"]})
    response = httpx.post(f"{base}{path}", json=body, timeout=30)
    if param is None:
        assert validator.is_valid(body) and response.status_code == 200, response.text
    else:
        assert not validator.is_valid(body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
