"""/v1/embeddings (OpenAI's, with vLLM's truncate_prompt_tokens and normalize): one engine request per input."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from tachyllm.pooling_params import PoolingParams
from tachyllm.server import protocol as p
from tachyllm.server.openapi import route_doc
from tachyllm.server.parsing import parse_body
from tachyllm.server.pooling import (
    INLINE_MAX_FLOATS,
    ClientGone,
    PoolingInput,
    check_input_count,
    encode_embedding,
    run_pooling,
    usage,
)
from tachyllm.server.responses import json_response
from tachyllm.server.state import ServerState, server_state

router = APIRouter()


@router.post("/v1/embeddings", **route_doc(p.EmbeddingRequest, p.EmbeddingResponse, pools=True))
async def embeddings(request: Request, state: ServerState = Depends(server_state)) -> Response:
    body = await parse_body(request, p.EmbeddingRequest)
    model = state.model(body.model)
    model.check_task("embed", request.url.path)
    inputs = embedding_inputs(body.input)
    check_input_count(state, len(inputs), "input")
    params = PoolingParams(
        task="embed",
        dimensions=body.dimensions,
        normalize=body.normalize,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
    )
    request_id = f"embd-{uuid.uuid4().hex}"
    try:
        outputs = await run_pooling(request, state, model, request_id, inputs, params, "input")
    except ClientGone:
        return Response(status_code=499)  # nobody is listening

    def respond() -> Response:
        data = [
            p.EmbeddingData(index=i, embedding=encode_embedding(out.outputs.data, body.encoding_format))
            for i, out in enumerate(outputs)
        ]
        return json_response(p.EmbeddingResponse(id=request_id, model=model.name, data=data, usage=usage(outputs)))

    # Thousands of floats per input: off the event loop, unless there are only a few.
    if sum(out.outputs.data.numel() for out in outputs) <= INLINE_MAX_FLOATS:
        return respond()
    return await asyncio.to_thread(respond)


def embedding_inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[PoolingInput]:
    """OpenAI's input shapes: a text, texts, one input's token ids, or several inputs' token ids."""
    if isinstance(value, str) or isinstance(value[0], int):
        return [PoolingInput(value)]
    return [PoolingInput(item) for item in value]
