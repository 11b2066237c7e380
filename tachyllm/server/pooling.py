"""Pooling requests from the HTTP routes (embeddings, score, rerank): inputs counted against the server's
bounds, checked and tokenized by the engine's InputProcessor, admitted all or none, and their one output
each gathered; embeddings encoded as OpenAI sends them, scores as cosine similarities or a
cross-encoder's."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from fastapi import Request

from tachyllm.engine.input_processor import ProcessedRequest
from tachyllm.errors import RequestError
from tachyllm.outputs import PoolingRequestOutput, ScoringRequestOutput
from tachyllm.pooling_params import PoolingParams
from tachyllm.server import protocol as p
from tachyllm.server.admission import add_requests, admission_error, check_admissible
from tachyllm.server.async_engine import OutputStream, QueueFullError
from tachyllm.server.errors import APIError, bad_request
from tachyllm.server.output_stream import unless_hung_up
from tachyllm.server.state import ServedModel, ServerState


@dataclass
class PoolingInput:
    """One engine request: a text or token ids, and for a cross-encoder the text paired with it."""

    prompt: str | list[int]
    text_pair: str | None = None


class ClientGone(Exception):
    """The client hung up before the outputs were ready (its requests were aborted)."""


def check_input_count(state: ServerState, count: int, param: str) -> None:
    limit = state.limits.max_pooling_inputs
    if count > limit:
        raise bad_request(
            f"{param} has {count} inputs, more than this server's limit of {limit} per request "
            "(--max-pooling-inputs); send them in several requests",
            param=param,
        )


async def run_pooling(
    request: Request,
    state: ServerState,
    model: ServedModel,
    base_id: str,
    inputs: list[PoolingInput],
    params: PoolingParams,
    param: str,
) -> list[PoolingRequestOutput]:
    """Each input's output, in order: every input checked (400 naming `param`, or the field the engine's
    check names), then all admitted at once (503 when the queue is full). Raises ClientGone if the client
    leaves first, and a 500 for a request the engine failed."""
    check_admissible(state, len(inputs), param)
    if params.truncate_prompt_tokens is None:  # a text too long for any truncation-free answer: refused untokenized
        for item in inputs:
            for text in (item.prompt, item.text_pair):
                if isinstance(text, str):
                    model.check_prompt_chars(len(text), param)
    processor = model.processor

    def process() -> list[ProcessedRequest]:
        return [processor.process_pooling(i.prompt, params, text_pair=i.text_pair) for i in inputs]

    try:
        # A few short texts tokenize in tens of microseconds, less than a hop to a worker thread and back
        # costs: those are tokenized on the event loop; anything bigger in a thread.
        processed = process() if inline_sized(inputs) else await asyncio.to_thread(process)
        num_tokens = sum(len(req.prompt_token_ids) for req in processed)
        if num_tokens > state.limits.max_request_tokens:
            raise bad_request(
                f"{param} has {num_tokens} tokens in all, more than this server's limit of "
                f"{state.limits.max_request_tokens} per request (--max-request-tokens); send fewer inputs",
                param=param,
            )
        requests = [(f"{base_id}-{i}", req, req.params) for i, req in enumerate(processed)]
        streams = await add_requests(state, model, base_id, requests, params=[])
    except RequestError as e:  # the engine's checks call an input "input" or "prompt": this route's is `param`
        raise bad_request(str(e), param=param if e.param in (None, "input", "prompt") else e.param) from None
    except QueueFullError as e:
        raise admission_error(e, param) from None
    outputs = await unless_hung_up(request, collect_outputs(streams))
    if outputs is None:
        raise ClientGone
    for out in outputs:
        if out.error is not None:
            raise APIError(500, out.error, "internal_error", code="engine_error")
    return outputs


async def collect_outputs(streams: Sequence[OutputStream]) -> list[PoolingRequestOutput]:
    """Each request's one (final) output, in order. A failure of one, or leaving early (the client hung
    up), ends them all: every unfinished request is aborted."""

    async def final(stream: OutputStream) -> PoolingRequestOutput:
        output = None
        async for out in stream:
            output = out
        if not isinstance(output, PoolingRequestOutput):
            raise TypeError(f"request {stream.request_id}: a pooling request ended without its pooling output")
        return output

    tasks = [asyncio.ensure_future(final(stream)) for stream in streams]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and (error := task.exception()) is not None:
                raise error
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


# Work small enough to do on the event loop rather than in a worker thread: the hop (a thread wake-up,
# and the GIL handed over and back) costs more than the work (docs/design_measurements.md#served-embedding-latency).
INLINE_MAX_CHARS = 4096  # of a request's texts (and token ids), to tokenize
INLINE_MAX_FLOATS = 8192  # of a request's embeddings, to encode as JSON


def inline_sized(inputs: Sequence[PoolingInput]) -> bool:
    """Whether tokenizing `inputs` is cheap enough for the event loop."""
    size = 0
    for item in inputs:
        size += len(item.prompt) + (len(item.text_pair) if item.text_pair is not None else 0)
        if size > INLINE_MAX_CHARS:
            return False
    return True


def usage(outputs: list[PoolingRequestOutput]) -> p.PoolingUsage:
    tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return p.PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)


def encode_embedding(data: torch.Tensor, encoding_format: str) -> list[float] | str:
    """The embedding as JSON floats, or (base64, OpenAI's) its little-endian float32 bytes in base64."""
    values = data.reshape(-1).to(torch.float32)
    if encoding_format == "base64":
        return base64.b64encode(values.numpy().astype("<f4").tobytes()).decode("ascii")
    return values.tolist()


def cosine_scores(left: torch.Tensor, right: torch.Tensor) -> list[float]:
    """Row i of `left` against row i of `right` (a row broadcasts): a bi-encoder's scores."""
    return torch.nn.functional.cosine_similarity(left, right, dim=-1).tolist()


async def pair_scores(
    request: Request,
    state: ServerState,
    model: ServedModel,
    base_id: str,
    queries: list[str],
    documents: list[str],
    truncate_prompt_tokens: int | None,
    fields: tuple[str, str],
) -> tuple[list[float], p.PoolingUsage]:
    """The score of each (query, document) pair, a single query paired with every document: a
    cross-encoder's, or the cosine similarity of an embedding model's embeddings. `fields` names the
    request's query and document fields."""
    query_param, document_param = fields
    if len(queries) != 1 and len(queries) != len(documents):
        raise bad_request(
            f"{query_param} has {len(queries)} texts and {document_param} {len(documents)}: give one "
            f"{query_param} for all, or as many as {document_param} (pairwise)",
            param=document_param,
        )
    check_input_count(state, len(documents), document_param)
    if model.task == "score":  # each pair read together
        paired = queries * len(documents) if len(queries) == 1 else queries
        pairs = [PoolingInput(q, d) for q, d in zip(paired, documents)]
        params = PoolingParams(task="score", truncate_prompt_tokens=truncate_prompt_tokens)
        outputs = await run_pooling(request, state, model, base_id, pairs, params, document_param)
        return [ScoringRequestOutput.from_base(out).outputs.score for out in outputs], usage(outputs)
    # Each text embedded once, a single query too.
    texts = [PoolingInput(t) for t in [*queries, *documents]]
    params = PoolingParams(task="embed", truncate_prompt_tokens=truncate_prompt_tokens)
    outputs = await run_pooling(request, state, model, base_id, texts, params, document_param)
    stacked = torch.stack([out.outputs.data.reshape(-1) for out in outputs])
    return cosine_scores(stacked[: len(queries)], stacked[len(queries) :]), usage(outputs)
