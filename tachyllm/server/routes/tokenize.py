"""/tokenize, /detokenize and /tokenizer_info (vLLM's): the model's tokenizer, and chat template, over
HTTP. With them lm-eval's local-completions uses the server's own tokenizer (its "remote" backend,
which it picks by itself), with nothing to download."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from tachyllm.server import protocol as p
from tachyllm.server.errors import bad_request
from tachyllm.server.openapi import ERROR_RESPONSES, route_doc
from tachyllm.server.parsing import parse_body
from tachyllm.server.prompts import chat_token_ids
from tachyllm.server.responses import json_object, json_response
from tachyllm.server.state import ServerState, server_state

router = APIRouter()


@router.post("/tokenize", **route_doc(p.TokenizeRequest, p.TokenizeResponse))
async def tokenize(request: Request, state: ServerState = Depends(server_state)) -> Response:
    body = await parse_body(request, p.TokenizeRequest)
    model = state.model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", param="prompt")
    engine = model.engine
    tokenizer = engine.tokenizer
    if body.messages is not None:
        param = "messages"
        ids = await chat_token_ids(
            model, body.messages, body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs
        )
    else:
        assert body.prompt is not None, "checked above: exactly one of prompt and messages"
        param = "prompt"
        # No token spells more than max_token_chars characters: a longer prompt is refused untokenized.
        state.check_tokens_returned(-(-len(body.prompt) // tokenizer.max_token_chars), param, at_least=True)
        ids = await asyncio.to_thread(tokenizer.encode, body.prompt, body.add_special_tokens)
    state.check_tokens_returned(len(ids), param)

    def respond() -> Response:
        strs = [tokenizer.id_to_token(t) for t in ids] if body.return_token_strs else None
        head = {"count": len(ids), "max_model_len": engine.max_model_len}
        return Response(json_object(head, tokens=ids, token_strs=strs), media_type="application/json")

    return await asyncio.to_thread(respond)


@router.post("/detokenize", **route_doc(p.DetokenizeRequest, p.DetokenizeResponse))
async def detokenize(request: Request, state: ServerState = Depends(server_state)) -> Response:
    body = await parse_body(request, p.DetokenizeRequest)
    engine = state.model(body.model).engine
    if any(t >= engine.vocab_size for t in body.tokens):
        raise bad_request(f"token ids must be below the vocabulary size {engine.vocab_size}", param="tokens")
    text = await asyncio.to_thread(engine.tokenizer.decode, body.tokens, False)
    return json_response(p.DetokenizeResponse(prompt=text))


@router.get("/tokenizer_info", response_model=p.TokenizerInfoResponse, responses={404: ERROR_RESPONSES[404]})
async def tokenizer_info(model: str | None = Query(None), state: ServerState = Depends(server_state)) -> Response:
    engine = state.model(model).engine
    tokenizer = engine.tokenizer

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else tokenizer.decode([token_id], skip_special_tokens=False)

    info = p.TokenizerInfoResponse(
        bos_token=text(tokenizer.bos_token_id),
        eos_token=text(tokenizer.eos_token_id),
        add_bos_token=tokenizer.add_bos,
        chat_template=tokenizer.chat_template,
        model_max_length=engine.max_model_len,
    )
    return json_response(info)
