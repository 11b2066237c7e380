"""vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters served, or no longer, as
models while the server runs. An admin operation, off unless --allow-runtime-lora-updating; docs/lora.md.

Loading reads and checks the adapter off the event loop, then serves it under its name; the engine
reads it at its first request. Unloading stops serving the name: requests already running with the
adapter finish with it."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from tachyllm.errors import AdapterError
from tachyllm.lora.adapter_files import load_adapter
from tachyllm.lora.request import LoRARequest
from tachyllm.server import protocol as p
from tachyllm.server.errors import APIError, bad_request
from tachyllm.server.openapi import route_doc
from tachyllm.server.parsing import parse_body
from tachyllm.server.responses import json_response
from tachyllm.server.state import ServedModel, ServerState, server_state

router = APIRouter()


@router.post("/v1/load_lora_adapter", **route_doc(p.LoadLoRAAdapterRequest, p.LoRAAdapterResponse))
async def load_lora_adapter(request: Request, state: ServerState = Depends(server_state)) -> Response:
    body = await parse_body(request, p.LoadLoRAAdapterRequest)
    runtime = state.runtime_lora
    assert runtime is not None, "the route is included only with --allow-runtime-lora-updating"
    name = body.lora_name
    check_name_free(state, name)
    base = runtime.base
    try:
        await asyncio.to_thread(load_adapter, body.lora_path, runtime.model_config, runtime.max_lora_rank)
    except AdapterError as e:
        raise bad_request(str(e), param="lora_path") from None
    check_name_free(state, name)  # another load may have taken it meanwhile
    lora = LoRARequest(name, runtime.next_id, body.lora_path)
    runtime.next_id += 1
    state.models.append(ServedModel([name], base.engine, base.tool_call_parser, lora=lora, parent=base.name))
    return json_response(p.LoRAAdapterResponse(lora_name=name, message=f"LoRA adapter {name!r} loaded"))


@router.post("/v1/unload_lora_adapter", **route_doc(p.UnloadLoRAAdapterRequest, p.LoRAAdapterResponse))
async def unload_lora_adapter(request: Request, state: ServerState = Depends(server_state)) -> Response:
    body = await parse_body(request, p.UnloadLoRAAdapterRequest)
    name = body.lora_name
    served = next((m for m in state.models if name in m.names), None)
    if served is None:
        raise APIError(404, f"the LoRA adapter {name!r} is not loaded", param="lora_name", code="model_not_found")
    if served.lora is None:
        raise bad_request(f"{name!r} is the base model, not a LoRA adapter", param="lora_name")
    state.models.remove(served)
    return json_response(p.LoRAAdapterResponse(lora_name=name, message=f"LoRA adapter {name!r} unloaded"))


def check_name_free(state: ServerState, name: str) -> None:
    if name in state.served_names:
        raise bad_request(f"the model name {name!r} is already served", param="lora_name")
