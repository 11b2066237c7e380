"""The server's OpenAPI document (/openapi.json).

The routes parse their own bodies (strict validation with errors that name the field), so FastAPI
does not see the request models; route_doc() declares them, and openapi_document() adds their
schemas to the document FastAPI builds from the routes.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from tachyllm.server import protocol as p
from tachyllm.server.state import RequestLimits

_ERRORS = {
    400: "invalid request: the error's `param` names the field",
    401: "missing or wrong API key (only when the server has one)",
    404: "unknown model",
    413: "request body over --max-request-body-bytes",
    415: "body not sent as application/json",
    421: "Host header not in --allowed-hosts",
    500: "the engine failed while running this request (it goes on serving others)",
    503: "busy (queue full), shutting down, or the engine is unhealthy",
}
ERROR_RESPONSES: dict[int, dict[str, Any]] = {
    status: {"model": p.ErrorResponse, "description": text} for status, text in _ERRORS.items()
}
_REQUEST_MODELS: dict[str, type[BaseModel]] = {}  # by name: every app built documents the same


def route_doc(
    request: type[BaseModel],
    response: type[BaseModel],
    generates: bool = False,
    events: str | None = None,
    pools: bool = False,
) -> dict[str, Any]:
    """The route-decorator arguments that document a JSON route: its request body, its response, and
    the errors it can answer; a route that `generates` also answers with server-sent events when the
    body asks to stream (`events` describes them, when they are not OpenAI's chunks ending in [DONE]),
    and with the engine's errors (500, 503), as a route that `pools` (embeddings, scores) does. 421 is
    documented for every route at the app."""
    _REQUEST_MODELS[request.__name__] = request
    ok: dict[str, Any] = {"model": response}
    if generates:
        ok["content"] = {
            "text/event-stream": {
                # One server-sent event, as SSE clients (and schemathesis) parse the stream: its `data`
                # field holds a JSON chunk or [DONE].
                "schema": {
                    "type": "object",
                    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
                    "required": ["data"],
                },
                "description": events
                or f"with `stream: true`: `data: <{response.__name__} chunk>` events, then `data: [DONE]`",
            }
        }
    errors = (400, 404, 413, 415) + ((500, 503) if generates or pools else ())
    return {
        "response_model": response,
        "responses": {200: ok, **{status: ERROR_RESPONSES[status] for status in errors}},
        "openapi_extra": {
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{request.__name__}"}}},
            }
        },
    }


def openapi_document(app: FastAPI, vocab_size: int, limits: RequestLimits) -> dict[str, Any]:
    """The document, with this server's own bounds: token ids below its vocabulary size, n at most
    --max-n, a completions request's prompts at most --max-prompts-per-request, a pooling request's
    inputs at most --max-pooling-inputs."""
    if app.openapi_schema is None:
        # Behind a proxy's path prefix (--root-path), clients reach the routes under it.
        servers = [{"url": app.root_path}] if app.root_path else None
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes, servers=servers)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in _REQUEST_MODELS.values():
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        _bound_token_ids(schemas, vocab_size - 1)
        for schema in schemas.values():
            n = schema.get("properties", {}).get("n")
            for option in n.get("anyOf", []) if n else []:
                if option.get("type") == "integer":
                    option["maximum"] = limits.max_n
        for option in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
            if option.get("items", {}).get("type") in ("string", "array"):  # several prompts, not one of token ids
                option["maxItems"] = limits.max_prompts
        _bound_pooling_inputs(schemas, limits.max_pooling_inputs)
        app.openapi_schema = doc
    return app.openapi_schema


def _bound_pooling_inputs(schemas: dict[str, Any], most: int) -> None:
    """--max-pooling-inputs: embeddings' several inputs, rerank's documents, score's text lists."""
    pooled = (
        ("EmbeddingRequest", "input"),
        ("RerankRequest", "documents"),
        ("ScoreRequest", "text_1"),
        ("ScoreRequest", "text_2"),
    )
    for model, field in pooled:
        schema = schemas[model]["properties"][field]
        for option in schema.get("anyOf", [schema]):
            if option.get("type") == "array" and not (model == "EmbeddingRequest" and _is_token_ids(option)):
                option["maxItems"] = most


def _is_token_ids(schema: dict[str, Any]) -> bool:
    """One input's token ids (a list of integers), which the bound on inputs does not count."""
    return schema.get("items", {}).get("type") == "integer"


def _bound_token_ids(node: Any, largest: int) -> None:
    if isinstance(node, dict):
        if node.pop("x-token-id", False):
            node["maximum"] = largest
        for value in node.values():
            _bound_token_ids(value, largest)
    elif isinstance(node, list):
        for item in node:
            _bound_token_ids(item, largest)
