"""How the engine's outputs of a response's requests reach the response: merged() reads them as they come,
final_outputs() adds each request's outputs up, and choice_updates() tells a stream what to send of each choice.

The server asks the engine for DELTA outputs (each holds only what a step added to a choice), so a stream
sends them as they come, except tokens that complete no text yet (a multi-byte character in progress, a
possible stop string held back): ChoiceProgress keeps those until text arrives with them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request

from tachyllm.outputs import CompletionOutput, DeltaAccumulator, EngineOutput, RequestOutput
from tachyllm.server.async_engine import OutputStream
from tachyllm.server.responses import finish_reason

T = TypeVar("T")


def generation_output(out: EngineOutput) -> RequestOutput:
    """A generation request's output (a pooling engine's never reach the generation routes: the input
    processor refuses their requests)."""
    if not isinstance(out, RequestOutput):
        raise TypeError(f"request {out.request_id}: a pooling output where a generation output was expected")
    return out


async def merged(streams: Sequence[OutputStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several generation requests as they come, tagged with each request's position.
    Leaving early (client gone, error) aborts every unfinished request."""
    tasks: list[asyncio.Task] = []
    try:
        if len(streams) == 1:  # the common case needs no helper tasks
            async for out in streams[0]:
                yield 0, generation_output(out)
            return
        queue: asyncio.Queue[tuple[int, EngineOutput | Exception | None]] = asyncio.Queue()

        async def pump(i: int, stream: OutputStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            except Exception as e:
                queue.put_nowait((i, e))
                return
            queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, generation_output(item)
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


async def final_outputs(request: Request, streams: Sequence[OutputStream]) -> list[RequestOutput] | None:
    """Each request's final output, in order; None if the client hung up first (all are then aborted)."""

    async def collect() -> list[RequestOutput]:
        totals = [DeltaAccumulator() for _ in streams]
        async for i, out in merged(streams):
            totals[i].add(out)
        return [total.result() for total in totals]

    return await unless_hung_up(request, collect())


async def unless_hung_up(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None if the client hung up first (`work` is then cancelled: reading merged()
    streams, that aborts their requests)."""

    async def hang_up() -> None:
        # Once the body is read, receive() returns only when the connection goes away.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(hang_up())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else None


@dataclass
class ChoiceProgress:
    """What a stream has sent of one choice, and what it holds back."""

    num_tokens: int = 0  # tokens sent
    text_offset: int = 0  # completions logprobs: offset of the next token in the choice's text
    finished: bool = False
    pending: CompletionOutput | None = None  # tokens received without text, sent with the next text


@dataclass
class ChoiceUpdate:
    """What a stream sends next for one choice."""

    index: int  # the choice's index in the response
    choice: CompletionOutput  # the tokens (and their logprobs) not sent yet, as the engine sent them
    text: str  # text not sent yet
    finish_reason: str | None
    progress: ChoiceProgress  # already counting this update as sent


def choice_updates(
    out: RequestOutput, progress: list[ChoiceProgress], first_index: int, constraint_param: str
) -> Iterator[ChoiceUpdate]:
    """The choices of `out` with something to send (new text, or their end); the choice of engine index i
    is the response's choice first_index + i. Raises as finish_reason does (a rejected choice: a 400
    naming `constraint_param`)."""
    for c in out.outputs:
        index = first_index + c.index
        pg = progress[index]
        if pg.finished:
            continue
        reason = finish_reason(out, c, constraint_param)
        if pg.pending is not None:
            held, pg.pending = pg.pending, None
            held.extend(c)
            held.text += c.text
            c = held
        if not c.text and reason is None:
            if c.token_ids:
                pg.pending = c
            continue
        pg.num_tokens += len(c.token_ids)
        pg.finished = reason is not None
        yield ChoiceUpdate(index, c, c.text, reason, pg)
