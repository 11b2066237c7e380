"""The open routes: probes, monitoring, the API's description (no API key needed)."""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from tachyllm.server import protocol as p
from tachyllm.server.errors import APIError
from tachyllm.server.openapi import ERROR_RESPONSES, openapi_document
from tachyllm.server.responses import json_response
from tachyllm.server.state import ServerState, server_state
from tachyllm.version import __version__

router = APIRouter()


@router.get("/health", response_class=Response, responses={200: {"description": "serving"}, 503: ERROR_RESPONSES[503]})
async def health(state: ServerState = Depends(server_state)) -> Response:
    """200 while the engine serves; 503 while draining, or once the engine stopped or hangs."""
    if problem := state.health_problem():
        error = APIError(503, problem, "service_unavailable_error", code="engine_unhealthy")
        return json_response(error.body, error.status)
    state.check_not_draining()  # 503 while draining
    return Response(status_code=200)


@router.get("/version", response_model=p.VersionResponse)
async def version() -> Response:
    return json_response(p.VersionResponse(version=__version__))


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def prometheus_metrics(state: ServerState = Depends(server_state)) -> Response:
    """Prometheus metrics in the text exposition format."""
    return Response(await state.metrics_text(), media_type=CONTENT_TYPE_LATEST)


# The OpenAPI document is open like /health (it describes the API, it does not use it).
@router.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request, state: ServerState = Depends(server_state)) -> Response:
    vocab_size = max(m.engine.vocab_size for m in state.models)
    document = openapi_document(request.app, vocab_size, state.limits)
    return Response(json.dumps(document), media_type="application/json")
