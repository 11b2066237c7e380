"""start_requests: a route's requests checked by the engine's InputProcessor and admitted to the engine, all or
none; add_requests: checked requests handed to the engine, and to the request's trace."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

from tachyllm.engine.input_processor import ProcessedRequest, Prompt
from tachyllm.errors import RequestError
from tachyllm.sampling_params import SamplingParams
from tachyllm.server.async_engine import OutputStream, QueueFullError, RequestParams
from tachyllm.server.errors import APIError, bad_request
from tachyllm.server.request_trace import TracedStream, current_request
from tachyllm.server.state import ServedModel, ServerState


async def start_requests(
    state: ServerState,
    model: ServedModel,
    base_id: str,
    prompts: list[Prompt],
    params: list[SamplingParams],
    prompt_param: str,
) -> Sequence[OutputStream]:
    """Admits one engine request per prompt, all or none, while the queue has room for them all. The
    InputProcessor checks them here, once: the engine queues the processed requests as they are."""
    check_admissible(state, len(prompts), prompt_param)
    try:
        processed = [model.processor.process_request(pr, sp) for pr, sp in zip(prompts, params)]
        if model.lora is not None:
            processed = [replace(req, lora_request=model.lora) for req in processed]
        requests = [(f"{base_id}-{i}", req, req.params) for i, req in enumerate(processed)]
        if (traced := current_request()) is not None and traced.record_text:
            traced.prompts = [pr.text for pr in prompts]
        return await add_requests(state, model, base_id, requests, params)
    except (QueueFullError, RequestError) as e:
        raise admission_error(e, prompt_param) from None


async def add_requests(
    state: ServerState,
    model: ServedModel,
    base_id: str,
    requests: list[tuple[str, ProcessedRequest, RequestParams]],
    params: list[SamplingParams],
) -> Sequence[OutputStream]:
    """Hands checked requests to the engine, all or none (QueueFullError: its queue has no room for them).
    The request being traced learns its model, id and sampling parameters (none for a pooling request) and
    when the engine took it, and sees every output of its streams."""
    traced = current_request()
    if traced is None:
        return await model.engine.add_requests(requests, max_queued=state.max_queue_len)
    traced.model, traced.request_id, traced.params = model.name, base_id, params
    traced.admitted_time = time.time()
    streams = await model.engine.add_requests(requests, max_queued=state.max_queue_len)
    return [TracedStream(s, traced) for s in streams]


def check_admissible(state: ServerState, num_requests: int, prompt_param: str) -> None:
    """Refuses a request while the server drains, and one with more engine requests than could ever
    wait at once."""
    state.check_not_draining()
    limit = state.max_queue_len
    if limit is not None and num_requests > limit:
        raise bad_request(
            f"{num_requests} prompts can never wait at once on this server (--max-queue-len {limit})",
            param=prompt_param,
        )


def admission_error(e: QueueFullError | RequestError, prompt_param: str) -> APIError:
    """An engine's refusal as an HTTP error: a full queue 503, a request's own fault 400 naming the field
    (`prompt_param` where the engine's check names none)."""
    if isinstance(e, QueueFullError):
        return APIError(
            503,
            f"the server is busy: {e.num_queued} requests are waiting to start (max_queue_len {e.limit}); retry later",
            "service_unavailable_error",
            code="queue_full",
            headers={"Retry-After": "1"},
        )
    return bad_request(str(e), param=e.param or prompt_param)
