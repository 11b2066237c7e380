"""/v1/score and /v1/rerank (vLLM's; rerank in Jina's and Cohere's shape, also at /rerank and /v2/rerank):
pairs of texts scored by a cross-encoder, or by the cosine similarity of an embedding model's embeddings."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from tachyllm.server import protocol as p
from tachyllm.server.openapi import route_doc
from tachyllm.server.parsing import parse_body
from tachyllm.server.pooling import ClientGone, pair_scores
from tachyllm.server.responses import json_response
from tachyllm.server.state import ServerState, server_state

router = APIRouter()


@router.post("/v1/score", **route_doc(p.ScoreRequest, p.ScoreResponse, pools=True))
async def score(request: Request, state: ServerState = Depends(server_state)) -> Response:
    body = await parse_body(request, p.ScoreRequest)
    model = state.model(body.model)
    model.check_task("score", request.url.path)
    queries = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    documents = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    request_id = f"score-{uuid.uuid4().hex}"
    try:
        scores, used = await pair_scores(
            request, state, model, request_id, queries, documents, body.truncate_prompt_tokens, ("text_1", "text_2")
        )
    except ClientGone:
        return Response(status_code=499)  # nobody is listening
    data = [p.ScoreData(index=i, score=s) for i, s in enumerate(scores)]
    return json_response(p.ScoreResponse(id=request_id, model=model.name, data=data, usage=used))


@router.post("/v1/rerank", **route_doc(p.RerankRequest, p.RerankResponse, pools=True))
@router.post("/v2/rerank", **route_doc(p.RerankRequest, p.RerankResponse, pools=True))
@router.post("/rerank", **route_doc(p.RerankRequest, p.RerankResponse, pools=True))
async def rerank(request: Request, state: ServerState = Depends(server_state)) -> Response:
    body = await parse_body(request, p.RerankRequest)
    model = state.model(body.model)
    model.check_task("score", request.url.path)
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    request_id = f"rerank-{uuid.uuid4().hex}"
    try:
        scores, used = await pair_scores(
            request, state, model, request_id, [body.query], texts, body.truncate_prompt_tokens, ("query", "documents")
        )
    except ClientGone:
        return Response(status_code=499)  # nobody is listening
    ranked = sorted(range(len(texts)), key=lambda i: -scores[i])  # stable: ties keep the documents' order
    results = [
        p.RerankResult(
            index=i,
            relevance_score=scores[i],
            document=p.RerankDocument(text=texts[i]) if body.return_documents else None,
        )
        for i in ranked[: body.top_n or None]
    ]
    return json_response(p.RerankResponse(id=request_id, model=model.name, results=results, usage=used))
