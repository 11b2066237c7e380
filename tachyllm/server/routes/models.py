"""/v1/models: the names this server answers to, and what each model is for."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from tachyllm.server import protocol as p
from tachyllm.server.openapi import ERROR_RESPONSES
from tachyllm.server.responses import json_response
from tachyllm.server.state import TASK_ENDPOINTS, ServedModel, ServerState, server_state

router = APIRouter()


@router.get("/v1/models", response_model=p.ModelList)
async def models(state: ServerState = Depends(server_state)) -> Response:
    return json_response(p.ModelList(data=[model_card(m, name) for m in state.models for name in m.names]))


@router.get("/v1/models/{model_id:path}", response_model=p.ModelCard, responses={404: ERROR_RESPONSES[404]})
async def model(model_id: str, state: ServerState = Depends(server_state)) -> Response:
    return json_response(model_card(state.model(model_id), model_id))


def model_card(model: ServedModel, name: str) -> p.ModelCard:
    """A base model's card has its checkpoint as root; a LoRA adapter's (vLLM's form) its path, and its
    base model as parent."""
    root = model.engine.model_name if model.lora is None else model.lora.lora_path
    return p.ModelCard(
        id=name,
        root=root,
        parent=model.parent,
        max_model_len=model.engine.max_model_len,
        task=model.task,
        endpoints=TASK_ENDPOINTS[model.task],
    )
