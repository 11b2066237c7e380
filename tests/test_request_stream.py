"""RequestStream: how a consumer that fell behind reads the outputs waiting for it."""

from __future__ import annotations

import asyncio

import pytest

from tachyllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tachyllm.sampling_params import RequestOutputKind
from tachyllm.server.async_engine import RequestStream


class _Engine:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _delta(text: str, token_ids: list[int], finish_reason: str | None = None) -> RequestOutput:
    choice = CompletionOutput(0, text, token_ids, finish_reason, logprobs=[{t: -1.0} for t in token_ids])
    return RequestOutput("r", None, [1, 2], [choice], finish_reason is not None, RequestMetrics(0.0))


def test_waiting_outputs_are_read_as_one() -> None:
    async def main() -> list[RequestOutput]:
        engine = _Engine()
        stream = RequestStream(engine, "r", RequestOutputKind.DELTA)
        stream.put(_delta("Hel", [5]))
        stream.put(_delta("", [6]))  # a token that completes no text yet
        stream.put(_delta("lo", [7], "length"))
        outs = [out async for out in stream]
        stream.close()  # finished: closing aborts nothing
        assert engine.aborted == []
        return outs

    (out,) = asyncio.run(main())
    choice = out.outputs[0]
    assert (choice.text, choice.token_ids, choice.finish_reason) == ("Hello", [5, 6, 7], "length")
    assert choice.logprobs == [{5: -1.0}, {6: -1.0}, {7: -1.0}]
    assert out.finished


def test_waiting_cumulative_outputs_give_the_newest() -> None:
    """Each CUMULATIVE output holds everything before it: added up, the text would repeat."""

    async def main() -> list[RequestOutput]:
        stream = RequestStream(_Engine(), "r", RequestOutputKind.CUMULATIVE)
        stream.put(_delta("Hel", [5]))
        stream.put(_delta("Hel", [5, 6]))
        stream.put(_delta("Hello", [5, 6, 7], "length"))
        return [out async for out in stream]

    (out,) = asyncio.run(main())
    assert (out.outputs[0].text, out.outputs[0].token_ids, out.finished) == ("Hello", [5, 6, 7], True)


def test_an_error_queued_behind_outputs_ends_the_stream() -> None:
    async def main() -> None:
        engine = _Engine()
        stream = RequestStream(engine, "r", RequestOutputKind.DELTA)
        stream.put(_delta("a", [5]))
        stream.put(RuntimeError("engine died"))
        with pytest.raises(RuntimeError, match="engine died"):
            await stream.__anext__()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        stream.close()
        assert engine.aborted == []  # the stream already ended

    asyncio.run(main())


def test_closing_an_unfinished_stream_aborts_its_request() -> None:
    async def main() -> list[str]:
        engine = _Engine()
        stream = RequestStream(engine, "r", RequestOutputKind.DELTA)
        stream.put(_delta("a", [5]))
        assert (await stream.__anext__()).outputs[0].text == "a"
        stream.close()
        stream.close()
        return engine.aborted

    assert asyncio.run(main()) == ["r"]
